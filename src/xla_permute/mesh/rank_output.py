"""Live output of the mesh: every rank's lines, prefixed by its rank, shown as they are written.

The ranks of the CPU mesh are threads of one device process (:mod:`xla_permute.mesh.launch`). In
that process :func:`install` replaces ``sys.stdout`` and ``sys.stderr`` with streams that put
``[rank r] `` before each line a rank's thread writes (Python warnings included: they go to
``sys.stderr``); lines from other threads (the autograd engine's, XLA's own logs written to
the file descriptor) pass unchanged. In the calling process :func:`relay` copies the device
process's stdout and stderr to this process's, line by line while it runs, from the calling
thread (so a notebook shows them in the running cell), and keeps the tail of stderr for the
error message of a mesh that fails. XLA:CPU's rendezvous progress lines ("This thread has been
waiting ... and may be stuck", then "Thread is unstuck!") go to that tail only: on a loaded
machine a rank often waits over 5 s at a collective and then goes on, and those two lines
would end up on every page and in every log; when the wait ends in an abort, the tail holds
them and :class:`~xla_permute.mesh.launch.MeshError`'s diagnosis reads them.

>>> import io
>>> out = io.StringIO()
>>> stream = RankPrefixedStream(out)
>>> set_rank(2)
>>> _ = stream.write("loss 0.5\\nstep ")
>>> _ = stream.write("done\\n")
>>> set_rank(None)
>>> _ = stream.write("no rank\\n")
>>> print(out.getvalue(), end="")
[rank 2] loss 0.5
[rank 2] step done
no rank
"""

from __future__ import annotations

import collections
import io
import queue
import re
import subprocess
import sys
import threading
import time
from typing import IO

__all__ = ["RENDEZVOUS_PROGRESS", "RankPrefixedStream", "install", "relay", "set_rank"]

_local = threading.local()


def set_rank(rank: int | None) -> None:
    """Mark the calling thread as rank ``rank``'s (``None``: no rank, no prefix)."""
    _local.rank = rank


class RankPrefixedStream(io.TextIOBase):
    """A text stream that writes whole lines to ``target``, each prefixed by its thread's rank.

    A line is buffered per thread until its newline, so that ranks writing at the same time
    never interleave inside a line.
    """

    def __init__(self, target: IO[str]) -> None:
        super().__init__()
        self._target = target
        self._lock = threading.Lock()
        self._pending: dict[int, str] = {}

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        key = threading.get_ident()
        with self._lock:
            *lines, rest = (self._pending.pop(key, "") + text).split("\n")
            if rest:
                self._pending[key] = rest
            if lines:
                rank = getattr(_local, "rank", None)
                prefix = "" if rank is None else f"[rank {rank}] "
                self._target.write("".join(f"{prefix}{line}\n" for line in lines))
                self._target.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._target.flush()

    def close_lines(self) -> None:
        """Write out every thread's unfinished line (at the end of the device process)."""
        with self._lock:
            for rest in self._pending.values():
                self._target.write(rest + "\n")
            self._pending.clear()
            self._target.flush()


def install() -> None:
    """In the device process: prefix the lines of ``sys.stdout`` and ``sys.stderr`` by rank."""
    sys.stdout = RankPrefixedStream(sys.stdout)
    sys.stderr = RankPrefixedStream(sys.stderr)


def _read_lines(stream: IO[str], kind: str, lines: queue.Queue) -> None:
    for line in stream:
        lines.put((kind, line))
    lines.put((kind, None))


#: The lines XLA's CPU runtime writes about a rendezvous slow to fill (rendezvous.cc).
RENDEZVOUS_PROGRESS = re.compile(
    r"rendezvous\.cc:\d+\] (\[id=\d+\] This thread has been waiting|Thread is unstuck)"
)


def relay(proc: subprocess.Popen, timeout: float, tail_lines: int = 25) -> tuple[bool, str]:
    """Copy ``proc``'s stdout and stderr (text pipes) to this process's while it runs.

    Returns ``(finished, stderr_tail)``: ``finished`` is False if ``proc`` ran over
    ``timeout`` seconds (the caller kills it); ``stderr_tail`` holds its last ``tail_lines``
    lines of stderr. Lines matching :data:`RENDEZVOUS_PROGRESS` go to the tail only.
    """
    lines: queue.Queue = queue.Queue()
    for stream, kind in ((proc.stdout, "out"), (proc.stderr, "err")):
        threading.Thread(target=_read_lines, args=(stream, kind, lines), daemon=True).start()
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    deadline, open_streams = time.monotonic() + timeout, 2
    while open_streams:
        try:
            kind, line = lines.get(timeout=0.1)
        except queue.Empty:
            sys.stdout.flush()
            if time.monotonic() > deadline:
                return False, "".join(tail)
            continue
        if line is None:
            open_streams -= 1
        elif kind == "out":
            sys.stdout.write(line)
        else:
            if not RENDEZVOUS_PROGRESS.search(line):
                sys.stderr.write(line)
            tail.append(line)
    sys.stdout.flush()
    remaining = max(deadline - time.monotonic(), 0.1)
    try:
        proc.wait(timeout=remaining)
    except subprocess.TimeoutExpired:
        return False, "".join(tail)
    return True, "".join(tail)
