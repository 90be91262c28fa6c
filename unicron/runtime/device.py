"""Which device each slot trains on, which backend its epochs use, and what does not fit.

Three callers, one set of rules:

- ``unicron run`` (:mod:`unicron.control.runner`) checks ``--device`` against ``--reduce`` and the
  node's GPUs before starting anything (:func:`check`), and passes the choice to its agents
  in the environment (:func:`run_env`);
- the agent maps its node's slots to GPUs (:func:`slot_env`: ``LOCAL_RANK`` as under
  torchrun, and ``UNICRON_DEVICE``, e.g. ``cuda:1``; several slots share a GPU when there
  are more slots than GPUs), and gives the health probe the slot's device;
- the worker learns its device (:func:`current`, exposed as ``unicron.worker.device()``),
  and refuses a model whose training state cannot fit in its slot (:func:`check_fits`).

The backend follows the device: gloo on CPU; NCCL on CUDA when every slot of a node has a
GPU of its own; gloo (with CUDA tensors staged through the CPU) when slots share a GPU, since
NCCL refuses two ranks on one device. What is verified where: ``docs/runtime.md``
("Accelerators").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from unicron.errors import UsageError

if TYPE_CHECKING:  # torch is imported where needed: `unicron run` checks its flags without it
    import torch

ENV_DEVICE = "UNICRON_DEVICE"
"""the slot's device, ``cpu`` or ``cuda:N`` (set per slot by the agent)"""
ENV_DEVICE_KIND = "UNICRON_DEVICE_KIND"
"""what ``unicron run --device`` asked for, ``cpu`` or ``cuda`` (the same for every slot)"""
ENV_BACKEND = "UNICRON_BACKEND"
"""``gloo`` or ``nccl``: the backend of every epoch's process group"""
KINDS = ("cpu", "cuda")
REDUCE_MODES: Mapping[str, tuple[str, ...]] = {"cpu": ("exact", "fast"), "cuda": ("fast",)}
"""``--reduce`` modes each device supports. ``exact`` on CUDA is refused: its bitwise
guarantee also needs deterministic CUDA kernels (every micro-batch's gradient the same bits
wherever it runs), which has not been verified on a GPU."""
STATE_BYTES_PER_PARAM = {"exact": 4 + 4 + 8 + 8 + 8, "fast": 4 + 4 + 8 + 4 + 4}
"""Training state per float32 parameter and reduce mode: the parameter, its gradient, two
AdamW moments, the local gradient sum and the reduce buffer (float64 sums in exact mode)."""


def default_reduce(kind: str) -> str:
    """``--reduce`` when none is given: exact where supported, else fast."""
    return REDUCE_MODES[kind][0]


def check(kind: str, reduce: str, gpus: int) -> None:
    """``unicron run``'s check before anything starts; ``gpus``: this node's CUDA devices."""
    if kind not in KINDS:
        raise UsageError(f"--device must be one of {', '.join(KINDS)}, got {kind!r}")
    if reduce not in REDUCE_MODES[kind]:
        allowed = ", ".join(REDUCE_MODES[kind])
        raise UsageError(
            f"--reduce {reduce} is not supported with --device {kind} (supported: {allowed}); "
            "see docs/runtime.md, Accelerators"
        )
    if kind == "cuda" and gpus < 1:
        raise UsageError("--device cuda: this node has no CUDA device (torch sees none)")


def backend(kind: str, nproc_per_node: int, gpus: int) -> str:
    """gloo on CPU; NCCL on CUDA if each slot of a node gets its own GPU, else gloo."""
    return "nccl" if kind == "cuda" and nproc_per_node <= gpus else "gloo"


def gpu_count() -> int:
    """CUDA devices this process sees (0 on a CPU build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_env(kind: str, nproc_per_node: int, gpus: int) -> dict[str, str]:
    """What every worker of the run is told (through the agents' environment)."""
    return {ENV_DEVICE_KIND: kind, ENV_BACKEND: backend(kind, nproc_per_node, gpus)}


def slot_device(kind: str, local_rank: int, gpus: int) -> str:
    """The device of a node's ``local_rank``-th slot: GPUs round robin, or the CPU. CUDA asked
    for on a node without GPUs is ``cuda:0`` all the same: its worker refuses it as bad input
    (:func:`current`) rather than train on the CPU unasked."""
    if kind != "cuda":
        return "cpu"
    return f"cuda:{local_rank % gpus}" if gpus > 0 else "cuda:0"


def slot_env(kind: str, local_rank: int, local_world: int, gpus: int) -> dict[str, str]:
    """The per-slot environment the agent adds: torchrun's names and the slot's device."""
    return {
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        ENV_DEVICE: slot_device(kind, local_rank, gpus),
    }


def current(env: Mapping[str, str] | None = None) -> torch.device:
    """This worker's device: ``UNICRON_DEVICE``, else ``cuda:LOCAL_RANK`` when CUDA was asked
    for, else the CPU. Raises :class:`UsageError` for a device this node lacks."""
    import torch

    env = os.environ if env is None else env
    name = env.get(ENV_DEVICE)
    if name is None and env.get(ENV_DEVICE_KIND) == "cuda":
        name = f"cuda:{env.get('LOCAL_RANK', '0')}"
    dev = torch.device(name or "cpu")
    if dev.type == "cuda":
        have = gpu_count()
        if dev.index is not None and dev.index >= have:
            raise UsageError(f"the worker asks for {dev}, but this node has {have} CUDA devices")
    elif dev.type != "cpu":
        raise UsageError(f"unsupported device {dev} (supported: {', '.join(KINDS)})")
    return dev


def state_bytes(numel: int, reduce: str) -> int:
    """Memory the training state of ``numel`` float32 parameters needs in one slot."""
    return numel * STATE_BYTES_PER_PARAM[reduce]


def slot_memory(dev: torch.device, local_world: int, sharing: int = 1) -> int:
    """Bytes one slot may use: its GPU's memory divided among the slots sharing it, or the
    node's memory (``MemTotal``) divided among the node's slots."""
    if dev.type == "cuda":
        import torch

        _, total = torch.cuda.mem_get_info(dev)
        return int(total) // max(1, sharing)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 // max(1, local_world)
    raise RuntimeError("no MemTotal in /proc/meminfo")


def check_fits(numel: int, reduce: str, available: int, dev: torch.device) -> None:
    """Refuse a model whose training state needs more than a slot has (before training)."""
    need = state_bytes(numel, reduce)
    if need > available:
        raise UsageError(
            f"the model does not fit: {numel / 1e6:.1f}M parameters need {need / 2**30:.2f} GiB "
            f"per slot on {dev} (parameters, gradients, AdamW moments, {reduce} sums), "
            f"a slot has {available / 2**30:.2f} GiB; use fewer workers per node or a "
            "smaller model"
        )


def seed(value: int, dev: torch.device) -> None:
    """Seed the generators a micro-batch on ``dev`` draws from (dropout masks and the like):
    the CPU's, and ``dev``'s own on CUDA. Called by the worker before each micro-batch, and by
    the benchmarks' baseline loops so that they draw the same numbers.

    Not ``torch.manual_seed``, which draws the same numbers on CPU but also seeds every
    accelerator backend built into torch: for each one not initialized (CUDA on a CPU run,
    XPU and MTIA on any) it queues the seed with a formatted stack trace of the caller
    (``_lazy_call``), about 0.4 ms a micro-batch in a worker, 2 core-ms a step of the example
    model on 4 workers (`bench/results/scale-history.md`)."""
    import torch

    torch.default_generator.manual_seed(value)
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            torch.cuda.manual_seed(value)


def to_device(batch: object, dev: torch.device) -> object:
    """A micro-batch (a tensor, or a tuple, list or dict of them) moved to ``dev``."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(dev, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, dev) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, dev) for b in batch)
    return batch
