"""A checkpoint of one layout read for a shard of another (a layout change): by name.

After a layout change (docs/runtime.md, Layout changes) the newest checkpoint may be another
layout's: another pipeline depth (the entries of a shard are spread over the files of every
stage) or another tensor-parallel degree (each split entry in slices over the files of the
ranks). Called by the worker's fallback (:func:`unicron.runtime.transition._by_name`) when its
own layout has no checkpoint as new; the files themselves are :mod:`unicron.runtime.checkpoint`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from unicron.parallel import split_dims
from unicron.runtime import checkpoint as C
from unicron.runtime.reshard import Slicing, local_spans

__all__ = ["load_by_name", "restore_by_name"]


def load_by_name(root: Path, places: list[int], size: int, step: int) -> dict[str, Any]:
    """The checkpoint of ``step`` of another layout (replicas of ``size`` ranks under
    ``root``) read for a shard of this one: the files of ``places`` (every stage at the
    tensor-parallel ranks holding this rank's slices, in rank order) merged by name, as
    ``{"model": name -> its tensors, "optim": name -> the parameter's optimizer states,
    "train": ...}``, a list per name with one item per file holding it (:func:`restore_by_name`
    joins a split entry's slices). Called by the worker's fallback when its own layout has no
    checkpoint as new."""
    model: dict[str, list[Any]] = {}
    optim: dict[str, list[Any]] = {}
    train: dict[str, Any] = {}
    for c in places:
        path = C.step_dir(C.shard_root(root, c, size), step)
        _, parts = C.load(path)
        for name, t in parts["model"].items():
            model.setdefault(name, []).append(t)
        names = parts["train"].get("params", [])
        for i, state in parts["optim"]["state"].items():
            if i < len(names) and names[i]:
                optim.setdefault(names[i], []).append(state)
        train = parts["train"]
    return {"model": model, "optim": optim, "train": train}


def restore_by_name(
    parts: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    part: tuple[int, int] = (1, 0),
    of: tuple[int, list[int]] = (1, [0]),
) -> int:
    """Load :func:`load_by_name`'s merged parts into this layout's ``model`` and
    ``optimizer`` (every entry by its name; ``CheckpointError`` if one is missing or of
    another shape) and the RNGs; the step. ``of``: the checkpoint's tensor-parallel degree
    and the ranks whose files were read; ``part``: this shard's degree and rank. An entry
    split over tensor-parallel ranks (:func:`unicron.parallel.split_dims`) is joined from the
    ranks' slices and cut to this rank's; any other is taken from the first file."""
    dims = split_dims(model)
    (tp, ranks), (mine_tp, mine) = of, part

    def cut(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        """This rank's slice of entry ``name`` from the files' ``pieces`` (rank by rank)."""
        dim = dims.get(name)
        if dim is None or (tp, ranks) == (mine_tp, [mine]):
            return pieces[0]
        if len(pieces) != len(ranks):
            raise C.CheckpointError(f"{name}: {len(pieces)} of its {len(ranks)} slices read")
        out = []
        for rank, piece in zip(ranks, pieces, strict=True):
            span = local_spans((mine_tp, mine), (tp, rank), split=True)
            if span is not None:  # the overlap, cut as a layout change cuts it
                try:
                    out.append(Slicing((tp, rank), {name: dim}).local(name, piece, span))
                except ValueError as exc:
                    raise C.CheckpointError(str(exc)) from None
        return torch.cat(out, dim) if len(out) > 1 else out[0]

    sd = model.state_dict()
    got = {k: cut(k, parts["model"][k]) for k in sd if k in parts["model"]}
    lacking = [k for k in sd if k not in got or got[k].shape != sd[k].shape]
    if lacking:
        raise C.CheckpointError(f"{len(lacking)} entries missing, e.g. {lacking[0]}")
    model.load_state_dict(got)
    own = optimizer.state_dict()
    order = C.param_names(model, optimizer)
    state = {}
    for i, n in enumerate(order):
        if n not in parts["optim"]:
            continue
        states, piece = parts["optim"][n], parts["model"][n][0].shape
        state[i] = {  # the moments of a split parameter are split alike; a step is not
            k: cut(n, [s[k] for s in states])
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == piece
            else v
            for k, v in states[0].items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": own["param_groups"]})
    C.set_rng_states(parts["train"]["rng"])
    return int(parts["train"]["step"])
