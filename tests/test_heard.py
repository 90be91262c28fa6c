"""The cluster's count of each agent's reports (:class:`unicron.control.screen.Heard`): a batch
sent again after its answer was lost is handed to the coordinator once."""

from __future__ import annotations

from unicron import messages as M
from unicron.control.screen import Heard


def _began(step: int) -> M.StepBegan:
    return M.StepBegan(slot=0, ts=float(step), step=step, epoch=1)


def test_reports_sent_again_are_heard_once_and_a_new_instance_counts_anew() -> None:
    h = Heard()
    a, b, c = _began(1), _began(2), _began(3)
    fresh, upto = h.unheard("u", "n0", "i1", 0, [a, b])
    assert fresh == [a, b] and upto == 2
    h.note("u", "n0", "i1", upto)
    census = M.Census(ts=3.0, alive=(0,))
    # the answer was lost: the same two again, one more, and the census after a failure
    fresh, upto = h.unheard("u", "n0", "i1", 0, [a, b, c, census])
    assert fresh == [c, census] and upto == 3
    h.note("u", "n0", "i1", upto)
    # the next batch starts where the last one noted ended: heard whole
    assert h.unheard("u", "n0", "i1", 3, [a])[0] == [a]
    # another task, or the agent's next instance, counts from 0
    assert h.unheard("v", "n0", "i1", 0, [a])[0] == [a]
    assert h.unheard("u", "n0", "i2", 0, [a])[0] == [a]
    # an exchange without indices (an agent of an earlier release): everything, nothing noted
    assert h.unheard("u", "n0", "i1", None, [a, b]) == ([a, b], None)
