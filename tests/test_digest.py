"""``params_sha256``: the one digest the bitwise claims compare (worker and baselines)."""

from __future__ import annotations

import torch
from torch import nn

from bench.baselines import train_ckpt
from unicron.runtime import boundary
from unicron.runtime.digest import params_sha256


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)  # running statistics: persistent buffers
        self.register_buffer("scratch", torch.zeros(4), persistent=False)


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def test_equal_state_equal_digest_and_every_byte_of_the_state_counts() -> None:
    a, b = _net(), _net()
    assert params_sha256(a) == params_sha256(b)
    with torch.no_grad():
        w = b.lin.weight.view(-1)
        w[0] = torch.nextafter(w[0], torch.tensor(1.0))  # one ulp of one parameter
    assert params_sha256(a) != params_sha256(b)
    c = _net()
    c.norm.running_mean += 1.0  # a trained buffer is state too
    assert params_sha256(a) != params_sha256(c)
    d = _net()
    d.scratch += 1.0  # a non-persistent buffer is not saved, sent nor compared
    assert params_sha256(a) == params_sha256(d)


def test_the_worker_and_the_baselines_share_the_function() -> None:
    assert boundary.params_sha256 is params_sha256  # the worker's final report
    assert train_ckpt.params_sha256 is params_sha256
