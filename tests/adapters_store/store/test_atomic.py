"""adapters_store/store/atomic.py on its own: parent directories, the failure path, the JSON bytes,
the sweep's bounds."""

from __future__ import annotations

import os
import pathlib
import time

import pytest

from adapters_store.store import atomic


def test_write_creates_missing_parent_directories(tmp_path):
    path = tmp_path / "a" / "b" / "c.bin"
    atomic.atomic_write_bytes(path, b"x")
    assert path.read_bytes() == b"x"


def test_a_write_that_fails_before_its_temp_file_exists_raises_its_own_error(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("builtins.open", full)
    with pytest.raises(OSError, match="disk full"):
        atomic.atomic_write_bytes(tmp_path / "f.bin", b"x")


def test_json_is_written_sorted_indented_with_a_final_newline(tmp_path):
    """Stable bytes: the same object always gives the same file (diffable, bit-identical rewrites)."""
    path = tmp_path / "o.json"
    atomic.atomic_write_json(path, {"b": 1, "a": [1]})
    assert path.read_bytes() == b'{\n  "a": [\n    1\n  ],\n  "b": 1\n}\n'


def test_sweep_counts_every_file_it_removes_keeps_one_exactly_at_the_grace_and_goes_on_past_a_vanished_one(
        tmp_path, monkeypatch):
    names = [f"{atomic.TMP_PREFIX}{i}" for i in range(4)]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    mtime = (tmp_path / names[0]).stat().st_mtime
    for name in names:
        os.utime(tmp_path / name, (mtime, mtime))
    assert atomic.sweep_temp_files(tmp_path, grace_seconds=100, now=mtime + 100) == 0  # not older than the grace
    real_stat = pathlib.Path.stat
    vanished: list[pathlib.Path] = []

    def stat(self, *args, **kwargs):
        if self.name.startswith(atomic.TMP_PREFIX) and not vanished:  # the first one the sweep looks at
            vanished.append(self)
            raise FileNotFoundError(self)  # renamed by its writer meanwhile
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    assert atomic.sweep_temp_files(tmp_path, grace_seconds=100, now=time.time() + 1000) == 3
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == [vanished[0].name]
