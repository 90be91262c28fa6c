"""The digest the bitwise claims compare: :func:`params_sha256`, one name and one formula.

Two runs are bitwise identical when they end with the same model state byte for byte: the
parameters and the persistent buffers, the state dict a checkpoint saves and a state
transfer sends. "params" in the name means that trained state, as the ``task_end`` event's
``params_sha256`` field (docs/runtime.md) always has. The worker computes it when it ends
(and at step 0 to tell replicas built from different seeds apart); the benchmark baselines
(``bench/baselines``) call the same function, so a baseline's digest and Unicron's mean the
same thing. Pure: no I/O.
"""

from __future__ import annotations

import hashlib

import torch


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of ``model``'s state dict: each entry's name, then its tensor's bytes
    (on the CPU, contiguous, flattened), in ``state_dict`` order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        flat = t.detach().cpu().contiguous().reshape(-1)  # a 0-d tensor has no byte view
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
