"""The stall check: a transition or a reduce that never ends, with plain data and a fake clock."""

from __future__ import annotations

import pytest

from unicron.detect.stall import Phase, Progress, Stall, find_stall, stall_deadline_s

J, C, R, L, D = Phase.JOIN, Phase.COMPUTE, Phase.REDUCE, Phase.LEFT, Phase.DONE


def _find(progress: dict[int, Progress], now: float = 10.0, epoch: int = 3) -> Stall | None:
    return find_stall(epoch=epoch, members=(0, 1, 2, 3), progress=progress, now=now, deadline_s=5.0)


def test_nothing_before_the_deadline() -> None:
    progress = {m: Progress(3, J, -1, 6.0) for m in (0, 1, 2)}  # 4 s: under the deadline
    assert _find(progress) is None


def test_a_member_still_in_an_older_epoch_is_the_one_behind() -> None:
    """The issue's stall: three members joined epoch 3 and wait; the fourth never arrives."""
    progress = {m: Progress(3, J, -1, 1.0) for m in (0, 1, 3)}
    progress[2] = Progress(2, R, 10, 0.5)  # stuck in epoch 2's vote
    stall = _find(progress)
    assert stall is not None and stall.behind == (2,) and not stall.stuck
    assert "outside epoch 3" in stall.reason


def test_a_member_never_heard_from_is_behind() -> None:
    progress = {m: Progress(3, R, 7, 1.0) for m in (0, 1, 2)}
    stall = _find(progress)
    assert stall is not None and stall.behind == (3,)


def test_every_member_waiting_at_the_same_place_is_a_stuck_collective() -> None:
    progress = {m: Progress(3, R, 7, 1.0 + m / 10) for m in range(4)}
    stall = _find(progress)
    assert stall is not None and stall.stuck
    assert stall.waited_s == pytest.approx(9.0)


def test_a_member_computing_is_the_monitors_to_judge() -> None:
    progress = {m: Progress(3, R, 7, 1.0) for m in (0, 1, 2)}
    progress[3] = Progress(3, C, 7, 1.0)  # a slow step: the hang detector's business
    assert _find(progress) is None


def test_a_member_stuck_in_an_earlier_waiting_phase_is_behind() -> None:
    progress = {m: Progress(3, R, 7, 1.0) for m in (0, 1, 2)}
    progress[3] = Progress(3, J, -1, 0.5)  # never got through the state transfer
    stall = _find(progress)
    assert stall is not None and stall.behind == (3,)


def test_a_member_that_left_is_healed_by_the_in_band_error_path() -> None:
    progress = {m: Progress(3, R, 7, 1.0) for m in (0, 1, 2)}
    progress[3] = Progress(3, L, -1, 1.0)
    assert _find(progress) is None


def test_finished_members_do_not_wait() -> None:
    progress = {m: Progress(3, D, 24, 1.0) for m in range(4)}
    assert _find(progress) is None


def _deadline(pace_s: float | None, state_bytes: int = 0) -> float:
    return stall_deadline_s(
        pace_s=pace_s,
        state_bytes=state_bytes,
        factor=20.0,
        floor_s=5.0,
        cold_s=120.0,
        transfer_bytes_per_s=50e6,
    )


def test_the_deadline_follows_the_pace_and_the_state_size() -> None:
    assert _deadline(None) == 120.0  # the first epoch: cold
    assert _deadline(0.03) == 5.0  # the floor
    assert _deadline(1.0) == 20.0
    assert _deadline(1.0, 10**9) == pytest.approx(40.0)  # + 1 GB at 50 MB/s
