"""The final state's directory, checked by every worker as it starts
(:func:`unicron.runtime.context.check_out`): made if missing, refused with the system's
reason where nothing can be written before the task has trained (the run then stops with
exit 2: ``test_an_output_directory_nobody_can_write_is_one_line_and_exit_2`` in
``tests/test_faults_e2e.py``), only logged once it has."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from unicron.errors import UsageError
from unicron.runtime.context import check_out, unwritable


def test_a_missing_directory_is_made_and_left_empty(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "gpt"
    assert unwritable(out) is None
    assert out.is_dir() and not any(out.iterdir())  # the probe file is gone


def test_a_directory_under_a_file_is_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "out"
    assert unwritable(out) == f"the output directory {out} cannot be written: Not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "ro"
    out.mkdir(mode=0o555)
    try:
        assert "Permission denied" in (unwritable(out) or "")
    finally:
        out.chmod(0o755)


def test_before_the_task_trained_it_is_the_users_mistake_after_it_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker started once the task has trained (a restart, a slot added) may be on a node
    whose mount is gone, or meet a passing error: that must not end a run that trained."""
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "out"
    check_out(None, trained=False)  # the script writes no final files
    check_out(tmp_path / "fine", trained=False)
    with pytest.raises(UsageError, match="cannot be written: Not a directory"):
        check_out(out, trained=False)
    check_out(out, trained=True)
    assert "cannot be written: Not a directory" in caplog.text and "it goes on" in caplog.text
