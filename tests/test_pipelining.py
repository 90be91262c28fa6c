"""PyTorch's own pipeline stage driven by Unicron (:mod:`unicron.pipelining`), without
processes: a middle stage over links that receive as a gloo wire does when it is not the
tensor's device (into a staged copy, then ``copy_`` back: CUDA tensors over gloo). Each case
runs in a child interpreter, since a worker's stage and degree are read once per process
from its environment. The healing end to end: ``tests/test_model_parallel_e2e.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

CHILD = textwrap.dedent("""
    import torch
    from torch import nn
    import unicron.pipelining as P

    class Staged:  # the wire is not the tensor's device: a copy, then copy_ back
        def __init__(self):
            self.sent = []
        def recv(self, t):
            wired = torch.arange(t.numel(), dtype=t.dtype).view(t.shape) * 0.01
            t.copy_(wired)
        def send(self, t):
            self.sent.append(t.clone())
        def flush(self):
            pass

    class Step:  # the worker's step: runs the backward pass it is handed
        def backward(self, loss, run=None):
            run()

    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    st = P.Stage(m, loss_fn=None, example_input=torch.zeros(2, 4),
                 example_output=torch.zeros(2, 4))
    prev, nxt = Staged(), Staged()
    st.pp.bind_epoch(prev, nxt, RuntimeError, torch.device("cpu"))
    for attempt in range(3):  # buffers kept across attempts: later ones as the first
        st.begin(2)
        done = [st.forward((None, None)) for _ in range(2)]
        for c in done:
            st.backward(Step(), c)
        assert st.pp.tp.broken is None, st.pp.tp.broken
    grads = [t for t in prev.sent]
    assert len(grads) == 6 and all(torch.equal(g, grads[0]) for g in grads[1::2]), grads
    assert len(nxt.sent) == 6 and all(torch.equal(a, nxt.sent[0]) for a in nxt.sent)
    assert float(done[0][1]) == float(torch.arange(9)[-1] * 0.01)  # the loss came back
    print("ok")
""")


def _child(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )  # fmt: skip


def test_a_middle_stage_computes_every_attempt_over_a_staged_wire() -> None:
    """Found in review: torch marks a stage's receive buffer as requiring a gradient at its
    first use and keeps it per chunk; a receive that writes into it with ``copy_`` (gloo
    carrying CUDA tensors) then failed from the second attempt on, killing the worker. Three
    attempts of two micro-batches each: every one computes, sends the same activations and
    gradients, and the loss comes back with the gradient."""
    r = _child({"UNICRON_PP": "3", "UNICRON_PP_STAGE": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_stage_refuses_a_task_that_changes_its_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch ``PipelineStage`` keeps its index and its pipeline's depth for the process's
    life: a task that may change its depth or its tensor-parallel degree is refused, before
    anything is built (end to end, exit 2: ``tests/test_model_parallel_e2e.py``)."""
    import torch

    import unicron.pipelining as P
    from unicron.errors import UsageError

    monkeypatch.setattr(P, "layouts", lambda: ((2, 2), (2, 1)))
    with pytest.raises(UsageError, match="keeps its index"):
        P.Stage(torch.nn.Linear(2, 2), loss_fn=None, example_input=torch.zeros(1, 2),
                example_output=torch.zeros(1, 2))  # fmt: skip
