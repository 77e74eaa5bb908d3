"""What each rank of the CPU mesh is doing, kept where the launcher can read it after an abort.

XLA:CPU ends the device process with SIGABRT when a collective's ranks arrive more than 15 s
apart, Python state and all. So each rank keeps one line about itself in a file of the
launch's directory: its state (:data:`STATES`), since when, how long its last sync and its last
compile took, the ranks it ran without at the compile barrier (``alone``), and the last op of
this package it called (:func:`note_op`, registered with :func:`xla_permute.debug.on_op`).
After an abort, :func:`~xla_permute.run_on_mesh` names in its :class:`~xla_permute.MeshError`
where the ranks that did not arrive were. Before :func:`start` (outside the device process)
nothing is kept.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     start(d)
...     set_rank(2); note_op("collective_permute"); enter("sync"); leave_sync(0.0)
...     read(d)[2]["last_op"], read(d)[2]["state"]
...     start(None)
('collective_permute', 'run')
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["STATES", "enter", "leave_sync", "note_op", "read", "set_rank", "start"]

#: The states of a rank, in order (in Python; inside ``torch_xla.sync()``, compiling and
#: dispatching; compiling its step for the compile barrier; waiting there for the other
#: ranks; inside torch.compile's XLA bridge), see xla_permute.cpu_mesh.barrier.
STATES = ("run", "sync", "compile", "barrier", "torch.compile")

_directory: Path | None = None
_local = threading.local()  # per rank: the ranks of the mesh are threads of one process


def start(directory: str | os.PathLike | None) -> None:
    """Keep the ranks' lines in ``directory`` (called once in the device process); None: stop."""
    global _directory
    _directory = None if directory is None else Path(directory)


def _write(**changes: Any) -> None:
    line = getattr(_local, "line", None)
    if _directory is None or line is None:
        return
    line.update(changes)
    (_directory / f"rank{line['rank']}.json").write_text(json.dumps(line))


def set_rank(rank: int) -> None:
    """Bind this thread to ``rank`` and write its first line."""
    _local.line = {"rank": rank, "state": "run", "since": time.monotonic(), "sync_s": 0.0}
    _write(last_op="", calls=0, compile_s=0.0, alone=[])


def note_op(op: str) -> None:
    """Record that this rank called ``op``."""
    line = getattr(_local, "line", None)
    _write(last_op=op, calls=line["calls"] + 1 if line else 0)


def enter(state: str, **fields: Any) -> None:
    """Record that this rank entered ``state`` (one of :data:`STATES`) now, with ``fields``."""
    _write(state=state, since=time.monotonic(), **fields)


def leave_sync(entered: float) -> None:
    """Record that this rank left the sync it entered at ``entered`` (``time.monotonic()``)."""
    now = time.monotonic()
    _write(state="run", since=now, sync_s=now - entered)


def read(directory: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """The last line of every rank in ``directory``: rank -> its fields."""
    out = {}
    for path in Path(directory).glob("rank*.json"):
        try:
            line = json.loads(path.read_text())
        except ValueError:  # a line being written when the process died
            continue
        out[line["rank"]] = line
    return out
