"""Train the small Llama-style model of ``llama_parallel.py`` in model-parallel replicas.

    unicron run --nproc-per-node 4 --tp 2 examples/train_llama_parallel.py --steps 60
    unicron run --nproc-per-node 8 --tp 2 --pp 2 examples/train_llama_parallel.py --steps 60
    unicron run --nproc-per-node 8 --tp 2 --pp 2 --pp-choices 1 \
        examples/train_llama_parallel.py --steps 60   # PP=1 while a slot is excluded
    unicron run --nproc-per-node 4 --tp 2 --tp-choices 1 \
        examples/train_llama_parallel.py --steps 60   # TP=1 x DP=3 while a slot is excluded
    unicron run --nproc-per-node 4 --fsdp 2 examples/train_llama_parallel.py --steps 60

Each replica is ``--tp`` x ``--pp`` ranks of one node: ``--pp`` pipeline stages of an equal
share of the layers, each stage ``--tp`` ranks holding their shard of its attention heads and
MLP units; replicas are data parallel. The model code is plain PyTorch with
``unicron.parallel``'s parts (under ``--fsdp`` the whole model, each block sharded by
PyTorch's ``fully_shard``: :mod:`unicron.fsdp`), or (``--tp-api dtensor``) with PyTorch's
own tensor parallel API (``parallelize_module`` over DTensor); each pipeline stage receives
and sends through ``unicron.parallel``, or (``--pp-api torch``) is PyTorch's own ``PipelineStage``
(``torch.distributed.pipelining``, :mod:`unicron.pipelining`); the loop is
``unicron.worker.train``.
"""

from __future__ import annotations

import argparse

import llama_parallel
import torch

import unicron.parallel
import unicron.worker
from unicron.errors import UsageError


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per global batch")
    p.add_argument("--heads", type=int, default=llama_parallel.LlamaConfig.heads)
    p.add_argument("--kv-heads", type=int, default=llama_parallel.LlamaConfig.kv_heads)
    p.add_argument("--layers", type=int, default=llama_parallel.LlamaConfig.layers)
    p.add_argument("--dim", type=int, default=llama_parallel.LlamaConfig.dim)
    p.add_argument("--hidden", type=int, default=llama_parallel.LlamaConfig.hidden)
    p.add_argument("--out", default=None, help="replica 0 writes OUT/final.pt (a file per shard)")
    p.add_argument("--tp-api", choices=("unicron", "dtensor"), default="unicron",
                   help="split the blocks with unicron.parallel's layers (default) or PyTorch's "
                   "DTensor tensor parallelism (parallelize_module)")  # fmt: skip
    p.add_argument("--pp-api", choices=("unicron", "torch"), default="unicron",
                   help="run each pipeline stage with unicron.parallel's send and receive "
                   "(default) or as PyTorch's PipelineStage (torch.distributed."
                   "pipelining)")  # fmt: skip
    p.add_argument("--schedule", choices=unicron.parallel.SCHEDULES, default="1f1b",
                   help="a pipeline's order of the micro-batches: 1F1B (default: the stages "
                   "overlap, a stage holds at most the activations of as many micro-batches "
                   "as stages from it to the last), GPipe's (every forward, then every "
                   "backward: the same overlap, every activation held) or one at a "
                   "time")  # fmt: skip
    args = p.parse_args()
    tp, pp = unicron.parallel.tensor_parallel(), unicron.parallel.pipeline_parallel()
    cfg = llama_parallel.LlamaConfig(
        heads=args.heads, kv_heads=args.kv_heads, layers=args.layers, dim=args.dim,
        hidden=args.hidden,
    )  # fmt: skip
    layouts = unicron.parallel.layouts()  # --tp x --pp, and any of --tp-choices, --pp-choices
    for degree, depth in layouts:
        why = llama_parallel.check(cfg, degree, depth)
        if why is not None:
            raise UsageError(f"--tp {degree} --pp {depth}: {why}")
    dtensor = args.tp_api == "dtensor"
    if dtensor and len({degree for degree, _ in layouts}) > 1:
        raise UsageError(
            "--tp-api dtensor with --tp-choices: the DeviceMesh keeps one tensor-parallel "
            "degree for the process's life (use unicron.parallel's layers to change it)"
        )
    torch_stage = args.pp_api == "torch"
    fsdp = unicron.parallel.fsdp_parallel().size > 1  # unicron run --fsdp F
    model, optimizer, dataset = llama_parallel.build(
        tp, seed=args.seed, cfg=cfg, pp=pp, dtensor=dtensor, torch_stage=torch_stage, fsdp=fsdp
    )
    model.train()
    stage = llama_parallel.stage(model, args.micro_batch_size) if torch_stage else None

    def rebuild(
        tp: unicron.parallel.TensorParallel, pp: unicron.parallel.PipelineParallel
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """This rank's shard at another layout (a layout change): another pipeline depth or
        tensor-parallel degree, as the handles ``tp`` and ``pp`` say."""
        model, optimizer, _ = llama_parallel.build(tp, seed=args.seed, cfg=cfg, pp=pp,
                                                   dtensor=dtensor)  # fmt: skip
        return model.train(), optimizer

    result = unicron.worker.train(
        model=model,
        optimizer=optimizer,
        loss_fn=None if torch_stage else llama_parallel.loss_fn,
        stage=stage,
        dataset=dataset,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=args.microbatches,
        steps=args.steps,
        seed=args.seed,
        out=args.out,
        rebuild=None if torch_stage else rebuild,
        schedule=args.schedule,
    )
    if result is not None and result.rank == 0:
        print(
            f"done: {result.steps} steps, loss {result.final_loss:.4f}, "
            f"params of shard 0 {result.params_sha256[:16]}"
        )


if __name__ == "__main__":
    main()
