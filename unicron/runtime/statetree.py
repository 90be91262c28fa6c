"""A training state (model and optimizer state dicts) as a skeleton and a list of tensors in
stream order, and the skeleton as JSON (the transfer's manifest): the part of
:mod:`unicron.runtime.transfer` that knows nothing of the wire.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Spec:
    """Where the manifest has a tensor: its shape and dtype (its bytes come in the stream)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


# -- the state as a list of tensors --------------------------------------------------------
# One pass over a state dict, dispatched on the exact type (a transfer walks a few hundred
# tensors; isinstance chains and a dataclass per tensor cost more than moving 5 MB does).
def _tensors(obj: Any, out: list[torch.Tensor]) -> None:
    """Append the tensors in ``obj`` to ``out`` in stream order: dicts with integer keys (the
    optimizer's state) or with string keys in sorted order, lists and tuples in order."""
    kind = type(obj)
    if kind is dict or isinstance(obj, dict):
        keys = _ordered(obj)
        for k in keys:
            v = obj[k]
            if type(v) is torch.Tensor:
                out.append(v)
            else:
                _tensors(v, out)
    elif kind is list or kind is tuple:
        for v in obj:
            _tensors(v, out)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)


def _ordered(d: dict[Any, Any]) -> list[Any]:
    """``d``'s keys in stream order: sorted if all are strings or all integers, else as
    they come."""
    return _keys(d)[0]


def _keys(d: dict[Any, Any]) -> tuple[list[Any], bool]:
    """(:func:`_ordered`'s keys, whether all are strings: an empty dict's are)."""
    keys = list(d)
    kind = type(keys[0]) if keys else str
    same = all(type(k) is kind for k in keys)
    if same and (kind is str or kind is int):
        keys.sort()
    return keys, same and kind is str


def _skeleton(obj: Any, out: list[torch.Tensor]) -> Any:
    """``obj`` as JSON-ready data (:func:`encode`'s format) with each tensor replaced by its
    spec; the tensors go to ``out`` in the order of :func:`_tensors`."""
    kind = type(obj)
    if kind is torch.Tensor or isinstance(obj, torch.Tensor):
        out.append(obj)
        return ["T", list(obj.shape), _DTYPE_NAME[obj.dtype]]
    if kind is dict or isinstance(obj, dict):
        keys, named = _keys(obj)
        if named:
            return {k: _item(obj[k], out) for k in keys}
        plain: list[Any] = ["D"]
        for k in keys:
            plain.append(_item(k, out))
            plain.append(_item(obj[k], out))
        return plain
    if kind is list:
        return ["L", *(_item(v, out) for v in obj)]
    if kind is tuple:
        return ["U", *(_item(v, out) for v in obj)]
    if kind is Spec:
        return ["T", list(obj.shape), _DTYPE_NAME[obj.dtype]]
    if obj is None or kind is bool or kind is int or kind is float or kind is str:
        return obj
    if isinstance(obj, bool | int | float | str):  # e.g. an enum's value: sent as its base
        return obj
    raise TypeError(f"the state dict holds a {kind.__name__}, which the transfer cannot send")


_PLAIN = frozenset({type(None), bool, int, float, str})


def _item(obj: Any, out: list[torch.Tensor]) -> Any:
    """:func:`_skeleton` of a container's item, its commonest kinds without a call (an
    optimizer's state dict is a few hundred of them: 0.28 -> 0.1 ms at 160 tensors)."""
    kind = type(obj)
    if kind is torch.Tensor:
        out.append(obj)
        return ["T", list(obj.shape), _DTYPE_NAME[obj.dtype]]
    if kind in _PLAIN:
        return obj
    return _skeleton(obj, out)


def _unskeleton(obj: Any, specs: list[Spec]) -> Any:
    """Inverse of :func:`_skeleton`: the data with a :class:`Spec` wherever a tensor stood;
    the specs also go to ``specs`` in stream order."""
    kind = type(obj)
    if kind is dict:
        return {k: _unskeleton(v, specs) for k, v in obj.items()}
    if kind is not list:
        return obj
    tag = obj[0]
    if tag == "T":
        spec = Spec(tuple(obj[1]), _DTYPES[obj[2]])
        specs.append(spec)
        return spec
    if tag == "L":
        return [_unskeleton(v, specs) for v in obj[1:]]
    if tag == "U":
        return tuple(_unskeleton(v, specs) for v in obj[1:])
    assert tag == "D", tag
    it = iter(obj[1:])
    return {_unskeleton(k, specs): _unskeleton(v, specs) for k, v in zip(it, it, strict=True)}


def _fill(skeleton: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """Put the next tensor wherever a :class:`Spec` stands in ``skeleton``."""
    kind = type(skeleton)
    if kind is Spec:
        return next(tensors)
    if kind is dict:
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if kind is list:
        return [_fill(v, tensors) for v in skeleton]
    if kind is tuple:
        return tuple(_fill(v, tensors) for v in skeleton)
    return skeleton


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_DTYPE_NAME = {d: name for name, d in _DTYPES.items()}


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Any, list[torch.Tensor]]:
    """(the state dicts ``{"model": ..., "optim": ...}`` with a :class:`Spec` for each
    tensor, the state's tensors in stream order), without copying a tensor."""
    tensors: list[torch.Tensor] = []
    plain = _skeleton({"model": model.state_dict(), "optim": optimizer.state_dict()}, tensors)
    return _unskeleton(plain, []), tensors


def state_nbytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state the transfer moves (parameters, buffers, optimizer state)."""
    return sum(t.numel() * t.element_size() for t in state_tensors(model, optimizer)[1])


# -- the manifest as JSON -------------------------------------------------------------------
def encode(skeleton: Any) -> bytes:
    """A state dict (with tensors or their :class:`Spec` in their place) as JSON. A dict
    with string keys stays an object; every array is tagged by its first element: ``T`` a
    tensor's spec (shape, dtype), ``L`` a list, ``U`` a tuple, ``D`` a dict with other keys
    (key, value, key, value...). Floats keep every bit (``repr`` round-trips; NaN and
    infinities included). Raises ``TypeError`` naming any other kind of value (a state dict
    holds numbers, strings, None and containers)."""
    return json.dumps(_skeleton(skeleton, []), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """Inverse of :func:`encode` (a :class:`Spec` wherever a tensor stood)."""
    return _unskeleton(json.loads(data), [])
