"""What each rank of the CPU mesh is doing, kept where the launcher can read it after an abort.

XLA:CPU ends the device process with SIGABRT when a collective's ranks arrive more than 15 s
apart; the process's Python state dies with it. So each rank keeps one line about itself in a
file of the launch's own directory: where it is (``sync`` while inside ``torch_xla.sync()``, which
compiles the step's program and dispatches it; ``run`` outside), since when, how long its last
sync took, and the last op of this package it called. :func:`xla_permute.mesh.launch.run_on_mesh`
reads the lines of the ranks that did not arrive and names them in its
:class:`~xla_permute.mesh.launch.MeshError`.

Outside the mesh's device process (:func:`start` not called) every function here does nothing.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     start(d)
...     set_rank(2); note_op("collective_permute"); enter_sync(); leave_sync()
...     read(d)[2]["last_op"], read(d)[2]["state"]
...     start(None)
('collective_permute', 'run')
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

__all__ = ["enter_sync", "leave_sync", "note_op", "read", "set_rank", "start"]

_directory: Path | None = None
_local = threading.local()  # per rank: the ranks of the mesh are threads of one process


def start(directory: str | os.PathLike | None) -> None:
    """Keep the ranks' lines in ``directory`` (called once in the device process); None: stop."""
    global _directory
    _directory = None if directory is None else Path(directory)


def set_rank(rank: int) -> None:
    """Bind this thread to ``rank`` and write its first line."""
    if _directory is None:
        return
    _local.rank, _local.state, _local.since = rank, "run", time.monotonic()
    _local.last_op, _local.calls, _local.sync_s = "", 0, 0.0
    _write()


def note_op(op: str) -> None:
    """Record that this rank called ``op`` (every collective op of the package does)."""
    if _directory is None or not hasattr(_local, "rank"):
        return
    _local.last_op, _local.calls = op, _local.calls + 1
    _write()


def enter_sync() -> None:
    if _directory is None or not hasattr(_local, "rank"):
        return
    _local.state, _local.since = "sync", time.monotonic()
    _write()


def leave_sync() -> None:
    if _directory is None or not hasattr(_local, "rank"):
        return
    now = time.monotonic()
    _local.sync_s, _local.state, _local.since = now - _local.since, "run", now
    _write()


def _write() -> None:
    line = (
        f"{_local.state}\t{_local.since:.3f}\t{_local.sync_s:.3f}\t{_local.calls}\t"
        f"{_local.last_op}\t{time.monotonic():.3f}\n"
    )
    path = _directory / f"rank{_local.rank}.status"  # type: ignore[operator]
    path.write_text(line)


def read(directory: str | os.PathLike) -> dict[int, dict[str, object]]:
    """The last line of every rank in ``directory``: rank -> its fields."""
    out: dict[int, dict[str, object]] = {}
    for path in Path(directory).glob("rank*.status"):
        try:
            fields = path.read_text().rstrip("\n").split("\t")
            state, since, sync_s, calls, last_op, written = fields
        except ValueError:  # a line being written when the process died
            continue
        out[int(path.stem[4:].split(".")[0])] = {
            "state": state,
            "since": float(since),
            "sync_s": float(sync_s),
            "calls": int(calls),
            "last_op": last_op,
            "written": float(written),
        }
    return out
