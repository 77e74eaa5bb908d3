"""What a ring hides, measured: its compute alone, its transfers alone, and the machine's own
overlap, for the c10d bench (:mod:`xla_permute_tools.bench.c10d`).

For a ring program (a ring op on the ``c10d`` backend), in the same launch as the ring itself:

* **compute alone**: the same op with every permute a loopback (the backend's ``send`` hands
  its own tensor back at once): the same matmuls or attention blocks, no transfer;
* **transfers alone**: the ring's own sends, recorded (shape, dtype, pairs, in order) from one
  run and replayed one after another with nothing between them;
* from the three: the **floor** ``max(t_compute, t_transfer)`` (no ring is faster) and the
  **hidden fraction** ``(t_compute + t_transfer - t_ring) / min(t_compute, t_transfer)``: 1
  when the ring hid all it could, 0 when it hid nothing (below 0: it lost time).

The **probe** asks the same of the machine: one ``[m, k] @ [k, f]`` matmul while one transfer
of ``x [m, k]`` to the next rank runs, against each alone. gloo moves bytes on the same cores
as the matmuls; on two cores shared by N processes little can overlap, and the probe says how
much.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["hidden_fraction", "loopback", "probe_programs", "recorded", "replay"]


class _Back:
    """The handle of a loopback send: ``wait()`` is the sent tensor itself."""

    def __init__(self, x: Any) -> None:
        self.x = x

    def wait(self) -> Any:
        return self.x


@contextmanager
def _sending(backend: Any, send: Callable[..., Any]) -> Iterator[None]:
    """``backend.send`` replaced by ``send`` inside the block; whatever was there after it
    (another wrapper's, or the backend's own)."""
    before = backend.__dict__.get("send")
    backend.send = send
    try:
        yield
    finally:
        if before is None:
            del backend.send
        else:
            backend.send = before


def loopback(backend: Any) -> Any:
    """Every ``send`` of ``backend`` returns its own tensor, with no transfer (compute alone)."""
    return _sending(backend, lambda x, pairs, tag=0: _Back(x))


def recorded(backend: Any, sends: list) -> Any:
    """Record every ``send`` of ``backend`` (``(shape, dtype, pairs, tag)``) into ``sends``."""
    inner = backend.send

    def send(x: Any, pairs: Any, tag: int = 0) -> Any:
        sends.append((tuple(x.shape), x.dtype, tuple(map(tuple, pairs)), tag))
        return inner(x, pairs, tag)

    return _sending(backend, send)


def replay(backend: Any, sends: list) -> Callable[[], None]:
    """The transfers alone: ``sends`` posted and waited one after another, as a ring's hops."""
    import torch

    buffers = [(torch.ones(shape, dtype=dtype), pairs, tag) for shape, dtype, pairs, tag in sends]

    def run() -> None:
        for x, pairs, tag in buffers:
            backend.send(x, pairs, tag).wait()

    return run


def probe_programs(backend: Any, m: int, k: int, f: int, rank: int, n: int) -> dict[str, Callable]:
    """The machine's overlap probe: a matmul, a transfer to the next rank, and both at once."""
    import torch

    g = torch.Generator().manual_seed(rank)
    x, w = torch.randn(m, k, generator=g), torch.randn(k, f, generator=g)
    pairs = [(r, (r + 1) % n) for r in range(n)]

    def both() -> None:
        handle = backend.send(x, pairs)
        x @ w
        handle.wait()

    return {
        "matmul": lambda: x @ w,
        "transfer": lambda: backend.send(x, pairs).wait(),
        "both": both,
    }


def hidden_fraction(compute: float, transfer: float, together: float) -> float:
    """``(compute + transfer - together) / min(compute, transfer)`` (module docstring).

    >>> hidden_fraction(10.0, 4.0, 10.0), hidden_fraction(10.0, 4.0, 14.0)
    (1.0, 0.0)
    """
    return (compute + transfer - together) / max(min(compute, transfer), 1e-12)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
