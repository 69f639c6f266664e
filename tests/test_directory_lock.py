"""The artifact directory's writer lock names its holder while held and leaves no pid behind."""

from __future__ import annotations

import os

import pytest

from neuron_buckets.compile.directory_lock import HOLDER_FILE, DirectoryLocked, directory_lock


def test_the_holder_pid_is_there_while_held_and_gone_after(tmp_path):
    out = tmp_path / "art"
    with directory_lock(out):
        assert (out / HOLDER_FILE).read_text() == str(os.getpid())
    assert not (out / HOLDER_FILE).exists()
    with directory_lock(out):  # taken again at once: nothing stale stands in the way
        pass
    assert not (out / HOLDER_FILE).exists()


def test_a_failed_writer_leaves_no_pid_either(tmp_path):
    out = tmp_path / "art"
    with pytest.raises(RuntimeError, match="boom"), directory_lock(out):
        raise RuntimeError("boom")
    assert not (out / HOLDER_FILE).exists()
    with directory_lock(out), pytest.raises(DirectoryLocked, match=f"pid {os.getpid()}"), directory_lock(out):
        pass
