"""Live output of the mesh: every rank's lines, prefixed by its rank, shown as they are written.

In the device process, :func:`install` makes ``sys.stdout`` and ``sys.stderr`` put
``[rank r]`` and a space before each line a rank's thread writes (other threads' lines, and
XLA's own logs written to the file descriptor, pass unchanged). In the calling process,
:func:`relay` copies the device process's output to this process's from the calling thread
(so that a notebook shows it in the running cell) and keeps the tail of stderr, which
:class:`~xla_permute.MeshError` quotes and diagnoses. XLA:CPU's lines about a slow rendezvous
("... may be stuck", then "Thread is unstuck!", common on a loaded machine) go to the tail only.

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

__all__ = ["RankPrefixedStream", "install", "relay", "set_rank"]

_local = threading.local()
_PROGRESS = re.compile(
    r"rendezvous\.cc:\d+\] (\[id=\d+\] This thread has been waiting|Thread is unstuck)"
)


def set_rank(rank: int | None) -> None:
    """Mark the calling thread as rank ``rank``'s (``None``: no rank, no prefix)."""
    _local.rank = rank


class RankPrefixedStream(io.TextIOBase):
    """Writes whole lines to ``target``, each prefixed by its thread's rank; a line waits for
    its newline per thread, so ranks writing at once never interleave inside a line."""

    def __init__(self, target: IO[str]) -> None:
        super().__init__()
        self._target, self._lock, self._pending = target, threading.Lock(), {}

    def write(self, text: str) -> int:
        with self._lock:
            *lines, rest = (self._pending.pop(threading.get_ident(), "") + text).split("\n")
            if rest:
                self._pending[threading.get_ident()] = rest
            rank = getattr(_local, "rank", None)
            prefix = "" if rank is None else f"[rank {rank}] "
            self._target.write("".join(f"{prefix}{line}\n" for line in lines))
            self._target.flush()
        return len(text)

    def close_lines(self) -> None:
        """Write out every thread's unfinished line (at the end of the device process)."""
        with self._lock:
            self._target.write("".join(rest + "\n" for rest in self._pending.values()))
            self._pending.clear()
            self._target.flush()


def install() -> None:
    """In the device process: prefix the lines of ``sys.stdout`` and ``sys.stderr`` by rank."""
    sys.stdout = RankPrefixedStream(sys.stdout)
    sys.stderr = RankPrefixedStream(sys.stderr)


def relay(proc: subprocess.Popen, timeout: float, tail_lines: int = 25) -> tuple[bool, str]:
    """Copy ``proc``'s stdout and stderr (text pipes) to this process's while it runs.

    Returns ``(finished, stderr_tail)``: ``finished`` is False if ``proc`` ran over ``timeout``
    seconds (the caller kills it); ``stderr_tail`` is its last ``tail_lines`` lines of stderr.
    """
    lines: queue.Queue = queue.Queue()

    def read(stream: IO[str]) -> None:
        for line in stream:
            lines.put((stream, line))
        lines.put((stream, None))

    for stream in (proc.stdout, proc.stderr):
        threading.Thread(target=read, args=(stream,), daemon=True).start()
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    deadline, open_streams = time.monotonic() + timeout, 2
    while open_streams:
        try:
            stream, line = lines.get(timeout=0.1)
        except queue.Empty:
            sys.stdout.flush()
            if time.monotonic() > deadline:
                return False, "".join(tail)
            continue
        if line is None:
            open_streams -= 1
        elif stream is proc.stdout:
            sys.stdout.write(line)
        else:
            tail.append(line)
            if not _PROGRESS.search(line):
                sys.stderr.write(line)
    sys.stdout.flush()
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        return False, "".join(tail)
    return True, "".join(tail)
