"""``bench/startup.py``: a worker forked from the zygote, asked over its own protocol, and a
fresh one both start and report; the digest timing covers each size asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import startup


@pytest.mark.e2e
@pytest.mark.long  # ~7 s: every e2e test starts its workers from a zygote anyway
@pytest.mark.timeout(120)
def test_a_worker_starts_from_the_zygote_and_fresh(tmp_path: Path) -> None:
    got = startup.starts(1, tmp_path)
    assert set(got) == {"zygote", "fresh"}
    (zygote,), (fresh,) = got["zygote"], got["fresh"]
    assert 0 < zygote < fresh  # the fork skips the imports a fresh interpreter pays


def test_digests_time_each_size() -> None:
    got = startup.digests(("5MB",), reps=2)
    assert list(got) == ["5MB"] and len(got["5MB"]) == 2 and all(x > 0 for x in got["5MB"])
