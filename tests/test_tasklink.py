"""The agent's link to a task's coordinator (:class:`unicron.control.client.TaskLink`) over a
stand-in for the service: what goes out when."""

from __future__ import annotations

from typing import Any

import httpx

from unicron import messages as M
from unicron.control.client import TaskLink


class _Service:
    """Fails the first request (the coordinator blinked), answers the others."""

    def __init__(self) -> None:
        self.failed, self.sent = False, list[dict[str, Any]]()

    def request(self, method: str, path: str, json: dict[str, Any]) -> dict[str, Any]:
        if not self.failed:
            self.failed = True
            raise httpx.ConnectError("the coordinator blinked")
        self.sent.append(json)
        return M.to_wire(M.Reply())


def test_the_last_round_goes_out_in_a_failed_exchanges_backoff() -> None:
    """The agent's last round (``flush``) sends the step reports the link held, even while the
    backoff after a failed exchange runs (before, they were lost with the link: the last
    steps' ``step_end`` records missing from the event log)."""
    service = _Service()
    link = TaskLink(service, "n0", "i1", "t", lambda: M.Census(ts=0.0))  # type: ignore[arg-type]
    link.exchange(0, [M.Ready(slot=0, ts=0.0)], 100.0)  # fails: a retry in 50 ms
    end = M.Event(ts=100.0, name="step_end", fields={"epoch": 1, "step": 7, "rank": 0})
    link.exchange(0, [end], 100.01, read_until=100.01, flush=True)
    assert len(service.sent) == 1
    kinds = [r["type"] for r in service.sent[0]["reports"]]
    assert kinds[:2] == ["Ready", "Event"] and kinds[-1] == "Census", kinds
