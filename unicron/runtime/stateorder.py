"""The state laid out in stream order: tensors packed into one buffer per device in the order
the transfer streams them (:func:`fresh`), a model's parameters and an optimizer's state moved
there once (:func:`lay_out_parameters`, :func:`lay_out_optimizer_state`), and the checks that
a received state fits the model: the part of :mod:`unicron.runtime.transfer` that knows
nothing of the wire.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from unicron.runtime.statetree import _DTYPE_NAME, Spec, _tensors


def fresh(specs: list[Spec], device: torch.device) -> list[torch.Tensor]:
    """Empty tensors for ``specs`` that follow each other in one buffer (each at the next
    offset its dtype allows), so that the stream lands in them in place (:meth:`_Stream.view`)
    and not through a staging buffer. Scalars (the optimizer's step counts) live on the CPU,
    as the optimizer keeps them; they share the buffer when ``device`` is the CPU."""
    cpu = torch.device("cpu")
    return _together(specs, [cpu if not s.shape else device for s in specs])


def _together(specs: list[Spec], where: list[torch.device]) -> list[torch.Tensor]:
    """Empty tensors for ``specs`` on the devices ``where``: those of one device follow each
    other in one buffer, in order, each at the next offset its dtype allows."""
    offsets: list[int] = []
    ends: dict[torch.device, int] = {}
    for s, d in zip(specs, where, strict=True):
        size = s.dtype.itemsize
        at = -(-ends.get(d, 0) // size) * size
        offsets.append(at)
        ends[d] = at + _numel(s.shape) * size
    bufs = {d: torch.empty(n, dtype=torch.uint8, device=d) for d, n in ends.items()}
    typed: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # a state has few distinct shapes
    out = []
    for s, d, at in zip(specs, where, offsets, strict=True):
        whole = typed.get((d, s.dtype))
        if whole is None:  # the buffer seen as this dtype, once (offsets are aligned to it)
            n = bufs[d].numel() // s.dtype.itemsize * s.dtype.itemsize
            whole = typed[d, s.dtype] = bufs[d][:n].view(s.dtype)
        st = strides.get(s.shape)
        if st is None:
            st = strides[s.shape] = _strides(s.shape)
        out.append(whole.as_strided(s.shape, st, at // s.dtype.itemsize))
    return out


# -- the state laid out in stream order ------------------------------------------------------
# A holder sends a chunk from the tensors' own memory, and a needer receives it there, when
# the chunk's tensors follow each other in one storage; tensors allocated one by one (a
# model's parameters, AdamW's moments) are packed through staging buffers instead, a copy
# on each side. The worker therefore lays its state out once, in stream order.
def lay_out_parameters(model: torch.nn.Module) -> bool:
    """Move the model's parameters into one buffer per device, in stream order (their
    ``.data``; the parameter objects, their gradients and hooks stay). Called by the worker
    when it starts. Leaves them where they are, and returns False, if one is not a plain
    contiguous tensor or shares memory with another tensor of the model (a view, a weight
    aliased by a buffer): moving it would undo that sharing."""
    keyed: list[torch.Tensor] = []
    _tensors(model.state_dict(keep_vars=True), keyed)
    params = {id(p) for p in model.parameters()}
    order = list({id(t): t for t in keyed if id(t) in params}.values())  # tied: listed once
    if not order or not all(_movable(p) for p in order):
        return False
    mine = [p.untyped_storage().data_ptr() for p in order]
    theirs = {
        t.untyped_storage().data_ptr()
        for t in keyed
        if id(t) not in params and t.layout == torch.strided and t.device.type != "meta"
    }
    if len(set(mine)) != len(mine) or theirs & set(mine):  # shared memory, or laid out
        return _in_order(order)
    moved = _relocated(order)
    for p, t in zip(order, moved, strict=True):
        p.data = t
    return True


def lay_out_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Move the optimizer's state tensors into one buffer per device, in stream order (the
    order of :func:`_tensors` over its state dict: parameters in their groups' order, each
    one's keys sorted). Called by the worker after a step, until it returns True: False
    while the optimizer has no state yet; True once laid out, or if the state is not one
    this function knows (a key that is not a string, a tensor shared or not contiguous)."""
    if not optimizer.state:
        return False
    entries: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for state in _param_states(optimizer):
        if not all(type(k) is str for k in state):
            return True
        entries += [(state, k, state[k]) for k in sorted(state) if type(state[k]) is torch.Tensor]
    tensors = [t for _, _, t in entries]
    if not tensors or _in_order(tensors) or not all(_movable(t) for t in tensors):
        return True
    if len({t.untyped_storage().data_ptr() for t in tensors}) != len(tensors):
        return True
    for (state, k, _), t in zip(entries, _relocated(tensors), strict=True):
        state[k] = t
    return True


def _param_states(optimizer: torch.optim.Optimizer) -> Iterator[dict[Any, Any]]:
    """The optimizer's non-empty per-parameter states, in its state dict's order (parameters
    in their groups' order)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                yield state


def _movable(t: torch.Tensor) -> bool:
    """A plain dense tensor in memory of its own kind (not a subclass such as a DTensor)."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.device.type != "meta"
        and t.is_contiguous()
    )


def _in_order(tensors: list[torch.Tensor]) -> bool:
    """Each device's tensors lie in one storage, each at or after the end of the one before."""
    last: dict[torch.device, tuple[int, int]] = {}
    for t in tensors:
        base, at = t.untyped_storage().data_ptr(), t.data_ptr()
        prev = last.get(t.device)
        if prev is not None and (prev[0] != base or at < prev[1]):
            return False
        last[t.device] = (base, at + t.numel() * t.element_size())
    return True


def _relocated(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors``, on their devices, laid out by :func:`_together`."""
    out = _together([Spec(tuple(t.shape), t.dtype) for t in tensors], [t.device for t in tensors])
    with torch.no_grad():
        for new, old in zip(out, tensors, strict=True):
            new.copy_(old)
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides."""
    strides = [1] * len(shape)
    for j in range(len(shape) - 2, -1, -1):
        strides[j] = strides[j + 1] * max(shape[j + 1], 1)
    return tuple(strides)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_model(mine: list[torch.Tensor], wanted: list[list[Any]]) -> None:
    """A needer's model tensors against the holder's specs (``["T", shape, dtype]``)."""
    if len(mine) != len(wanted):
        raise RuntimeError(
            f"this worker's model has {len(mine)} tensors, the holder's {len(wanted)}"
        )
    for i, (own, (_, shape, dtype)) in enumerate(zip(mine, wanted, strict=True)):
        if list(own.shape) != shape or _DTYPE_NAME[own.dtype] != dtype:
            raise RuntimeError(
                f"this worker's model differs from the holder's (tensor {i}: "
                f"{tuple(own.shape)} {own.dtype}, holder {tuple(shape)} {dtype})"
            )


def _optim_targets(
    specs: list[Spec], own: list[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """A needer's destinations for the optimizer's tensors: its own if every shape agrees
    (written in place), else fresh ones in one buffer (:func:`fresh`)."""
    if len(own) == len(specs) and all(
        tuple(t.shape) == s.shape and t.dtype == s.dtype for t, s in zip(own, specs, strict=True)
    ):
        return own
    return fresh(specs, device)
