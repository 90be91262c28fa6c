"""FSDP inside a replica: the worker's side of a model sharded with torch's FSDP2.

A task run with ``--fsdp F`` trains replicas of ``F`` ranks of one node that shard the whole
model, its gradients and its optimizer's state with PyTorch's own ``fully_shard`` (the
script builds the model on :func:`unicron.fsdp.mesh`; docs/runtime.md, FSDP inside a
replica). Its ranks are the replica's places, as tensor-parallel ranks are: the same place
in another replica holds the same shard, so the exact reduce, the state transfer and the
checkpoints run per place as they do at ``--tp``. What differs is the work: FSDP's ranks
compute *different* micro-batches. Called by the worker (:mod:`unicron.worker`):

- :func:`unicron.runtime.rounds.rounds` hands the replica's micro-batches out in rounds of
  ``F``, one a place (a short round's extra places compute a padding micro-batch, for the
  collectives, whose gradient is not added);
- :class:`FsdpReducer` takes FSDP2's reduce-scatter apart (``set_custom_reduce_scatter``):
  an all-to-all over the replica gives each place every micro-batch's gradient slice of its
  shard, and those are added one micro-batch at a time into the place's local sums, whose
  "parameters" are one flat shard per FSDP module, as FSDP lays them out. The exchange across
  replicas, partial results and the commit are those of any place; the reduced shard becomes
  each sharded parameter's ``.grad`` for the optimizer;
- :func:`local_state` makes the model's and the optimizer's state dicts hold each DTensor's
  local shard (and load from one), so that the transfer, the checkpoints and the digests,
  which work on plain tensors by name, see the place's shard.

Bits: every micro-batch's gradient slice reaches the summation tree alone, so the update is
the unsharded one, whichever place or replica computed which micro-batch
(``tests/test_fsdp_exact.py`` checks the premise on FSDP2 itself). FSDP2's internals used
here (its parameter groups' ``fsdp_params`` and their sizes) are checked against the sizes of
each reduce-scatter at the first one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from unicron.parallel import TensorParallel
from unicron.runtime.gradients import Reducer
from unicron.runtime.microbatches import refuse
from unicron.runtime.rounds import Round

__all__ = ["FsdpReducer", "local_state", "sharded_modules"]


def sharded_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The modules of ``model`` that FSDP2 shards parameters of (``fully_shard`` called on
    them, each with a parameter group), in module order."""
    return [
        m
        for m in model.modules()
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
    ]


def _params(module: FSDPModule) -> list[Any]:
    """The FSDP2 parameters (``FSDPParam``) of ``module``'s group, in its flat order."""
    group = module._get_fsdp_state()._fsdp_param_group
    assert group is not None
    return list(group.fsdp_params)


def _flat_numel(module: FSDPModule) -> int:
    """Elements of ``module``'s reduce-scatter output: each parameter's padded shard."""
    return sum(p.padded_sharded_param_size.numel() for p in _params(module))


class _Scatter(ReduceScatter):
    """The reduce-scatter of FSDP module ``index``, taken apart: an all-to-all over the
    replica (:meth:`FsdpReducer.scattered`). FSDP's own output is zeros: the sharded
    gradient comes from the exchange at the commit."""

    def __init__(self, reducer: FsdpReducer, index: int) -> None:
        self.reducer, self.index = reducer, index

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
        async_op: bool = False,
    ) -> None:  # fmt: skip
        self.reducer.scattered(self.index, output_tensor, input_tensor)


class FsdpReducer(Reducer):
    """The gradient side of a worker whose model is sharded by FSDP2 over its replica
    (``par``: the replica's ranks, bound to each epoch's group by the worker). Its local sums
    hold, per FSDP module, the flat shard of this place; one :meth:`backward` is a round
    (:attr:`round` set by the caller first: :mod:`unicron.runtime.microbatches`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        par: TensorParallel,
        num_microbatches: int,
        *,
        exact: bool,
        bucket_cap_mb: float,
        device: torch.device,
        stray: Callable[[], None],
    ) -> None:
        self.modules = sharded_modules(model)
        if not self.modules:
            refuse(
                f"--fsdp {par.size}: the model has no module sharded with fully_shard on "
                "unicron.fsdp.mesh() (docs/runtime.md, FSDP inside a replica)"
            )
        for m in self.modules:
            for p in _params(m):
                if p.fsdp_placement.dim != 0:
                    refuse(
                        f"--fsdp: parameter {p._param_fqn} sharded on dim "
                        f"{p.fsdp_placement.dim}: only dim 0 (fully_shard's default)"
                    )
        sharded = {id(p.sharded_param) for m in self.modules for p in _params(m)}
        plain = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in sharded]
        if plain:
            refuse(
                f"--fsdp {par.size}: parameters {', '.join(plain[:3])}"
                f"{' ...' if len(plain) > 3 else ''} are not sharded: call "
                "unicron.fsdp.fully_shard(model) on the whole model last (its blocks first)"
            )
        self.par = par
        dtype = _params(self.modules[0])[0].sharded_param.dtype
        flats = [torch.empty(_flat_numel(m), dtype=dtype, device=device) for m in self.modules]
        super().__init__(
            flats,  # type: ignore[arg-type]  # flat shards: no parameters, no hooks
            num_microbatches,
            exact=exact,
            bucket_cap_mb=bucket_cap_mb,
            device=device,
            stray=stray,
        )
        self.round: Round = ()
        """the micro-batches of the round the next :meth:`backward` computes, by place"""
        self._pieces: dict[int, torch.Tensor] = {}  # module -> (places, flat shard) this round
        for i, m in enumerate(self.modules):
            m.set_custom_reduce_scatter(_Scatter(self, i))
            m.set_force_sum_reduction_for_comms(True)  # the replica's group only sums
            m.set_gradient_divide_factor(1.0)

    def _register_hooks(self) -> list[Any]:
        return []  # the gradients come through the reduce-scatter (scattered)

    def sharded_params(self) -> list[torch.nn.Parameter]:
        return [p.sharded_param for m in self.modules for p in _params(m)]

    # -- a round ----------------------------------------------------------------------------
    def scattered(self, index: int, out: torch.Tensor, inp: torch.Tensor) -> None:
        """FSDP module ``index``'s reduce-scatter in this round's backward pass: this place's
        slice of every place's gradient, kept for :meth:`backward` (the replica's all-to-all;
        skipped once the attempt is broken)."""
        if not self._in_backward:
            self._stray()
        out.zero_()
        size = self.par.size
        if out.numel() != self.sums.layout.sizes[index] or inp.numel() != size * out.numel():
            raise RuntimeError(
                f"FSDP module {index}: a reduce-scatter of {inp.numel()} -> {out.numel()} "
                f"elements, where its parameters' shards make {self.sums.layout.sizes[index]} "
                "(torch's FSDP2 lays out its gradients otherwise than this worker reads them)"
            )
        got = torch.empty_like(inp)
        n = out.numel()

        def run(g: Any) -> None:
            g.wait(g.start_alltoall(got, inp.contiguous(), [n] * size, [n] * size))

        self.par.collective("all-to-all", run)
        self._pieces[index] = got.view(size, n)

    def backward(
        self, mb: int, loss: torch.Tensor, *, last: bool, run: Callable[[], None] | None = None
    ) -> None:
        """A round: this place's micro-batch ``mb`` (one of :attr:`round`) forward is done;
        run its backward pass (FSDP's reduce-scatters give the round's slices), gather the
        round's losses over the replica, then add each real micro-batch of the round, in
        place order, to the local sums. ``last``: the attempt's last round here (its sums'
        buckets are launched). A broken attempt adds nothing (the caller drops the sums)."""
        self._pieces = {}
        self._in_backward = True
        try:
            loss.backward() if run is None else run()
        finally:
            self._in_backward = False
            for p in self.sharded_params():
                p.grad = None  # FSDP's zeros: the gradient is the exchange's, at the commit
        mine = torch.tensor([float(loss.detach())], dtype=torch.float64)
        losses = [mine]

        def gather(g: Any) -> None:
            losses[:] = g.allgather(mine)

        self.par.collective("all-gather", gather)
        if self.par.broken is not None:
            return
        finished: list[int] = []
        real = [(place, m) for place, m in enumerate(self.round) if m is not None]
        for place, m in real:
            self.sums.begin(m)
            finished = []
            for i in range(len(self.modules)):
                piece = self._pieces.get(i)
                b = self.sums.add(i, None if piece is None else piece[place])
                if b is not None:
                    finished.append(b)
            finished += self.sums.end(float(losses[place].item()))
        self._pieces = {}
        self._close(last, finished)

    def add(
        self, mb: int, grads: Sequence[torch.Tensor | None], loss: float, *, last: bool
    ) -> None:
        refuse("step.add_gradients(): not with --fsdp (FSDP computes the gradients' shards)")

    # -- the optimizer's gradients ----------------------------------------------------------
    def apply(self, grads: list[torch.Tensor], whole: torch.Tensor, divisor: int) -> None:
        """Each sharded parameter's ``.grad``: its place in the reduced flat shard of its
        module (``grads``, views of ``whole``, divided at once), as a DTensor like FSDP's."""
        whole.div_(divisor)
        for m, flat in zip(self.modules, grads, strict=True):
            at = 0
            for p in _params(m):
                n = p.sharded_size.numel()
                view = flat.narrow(0, at, n).view(p.sharded_size)
                dtype = p.sharded_param.dtype
                p.sharded_param.grad = p.to_sharded_dtensor(
                    view if view.dtype == dtype else view.to(dtype)
                )
                at += p.padded_sharded_param_size.numel()

    def clear_grads(self) -> None:
        for p in self.sharded_params():
            p.grad = None


# -- the state as the place's shard -------------------------------------------------------------
def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make ``model.state_dict()`` and ``optimizer.state_dict()`` hold each DTensor's local
    shard (a view: writing into it writes the parameter), and their ``load_state_dict`` take
    such shards, wrapped back as DTensors without a copy. Called by the worker once, when it
    adopts an FSDP model: the runtime's transfer, checkpoints and digests move plain tensors by
    name."""
    specs = {
        name: (p.device_mesh, p.placements, p.shape, p.stride())
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    by_param = {id(p): specs[name] for name, p in model.named_parameters() if name in specs}

    def local(v: Any) -> Any:
        return v.to_local() if isinstance(v, DTensor) else v

    def saved(module: Any, state: dict[str, Any], prefix: str, meta: Any) -> None:
        for k, v in state.items():
            if k.startswith(prefix):
                state[k] = local(v)

    def loading(module: Any, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for k, v in state.items():
            spec = specs.get(k[len(prefix) :]) if k.startswith(prefix) else None
            if spec is not None and not isinstance(v, DTensor):
                state[k] = _wrap(v, spec)

    def opt_saved(opt: Any, state: dict[str, Any]) -> dict[str, Any]:
        # its per-parameter dicts are the optimizer's own: new ones, never written into
        shards = {i: {k: local(v) for k, v in s.items()} for i, s in state["state"].items()}
        return {**state, "state": shards}

    def opt_loading(opt: Any, state: dict[str, Any]) -> dict[str, Any]:
        params = [p for g in opt.param_groups for p in g["params"]]
        wrapped: dict[Any, Any] = {}
        for i, s in state["state"].items():
            spec = by_param.get(id(params[i]))
            shape = params[i].to_local().shape if spec is not None else None
            wrapped[i] = {
                k: _wrap(v, spec)
                if spec is not None and type(v) is torch.Tensor and v.dim() and v.shape == shape
                else v
                for k, v in s.items()
            }  # a moment shaped like the parameter's shard: a DTensor like it; a count: as is
        return {**state, "state": wrapped}

    model.register_state_dict_post_hook(saved)
    model.register_load_state_dict_pre_hook(loading)
    optimizer.register_state_dict_post_hook(opt_saved)
    optimizer.register_load_state_dict_pre_hook(opt_loading)


def _wrap(t: torch.Tensor, spec: tuple[Any, ...]) -> DTensor:
    mesh, placements, shape, stride = spec
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
