"""The self-test table of ``python -m xla_permute demo`` and ``python -m xla_permute doctor``.

A :class:`Check` pairs a rank function (run on every device of the mesh) with a verifier (run
here, on the per-rank results, against the pure-torch :mod:`xla_permute.reference`). Inputs are
integer-valued, so every comparison is exact (ring attention, whose softmax is not, is
checked within 1e-5 of SDPA in float64). All checks run in ONE launch of an N-device CPU
mesh; each row reports the check, the backend that produced its result, ok or the failure, and
the slowest rank's wall time. The native programs (what TPU and Neuron run) cannot execute on
the CPU mesh: those rows trace them and read their HLO.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xla_permute import reference
from xla_permute.pairs import ring_pairs

__all__ = ["CHECKS", "Check", "Row", "format_table", "main", "run_checks"]


@dataclass(frozen=True)
class Check:
    """One row of the table: ``run()`` on every rank, then ``verify(per_rank_results)``."""

    name: str
    backend: str
    run: Callable[[], Any]
    verify: Callable[[list[Any]], None]


@dataclass(frozen=True)
class Row:
    check: str
    backend: str
    ok: bool
    detail: str
    seconds: float


def _ints(seed: int, *shape: int) -> torch.Tensor:
    """Integer-valued float32 data in [-3, 3] (exact in every sum and product below)."""
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def _rank() -> tuple[int, int, Any]:
    import torch_xla
    import torch_xla.runtime as xr

    return xr.global_ordinal(), xr.world_size(), torch_xla.device()


def _sync() -> None:
    import torch_xla

    torch_xla.sync()


# --- the mesh and a channel-id all-gather ---------------------------------------------------


def _mesh() -> tuple[str, int, int]:
    import torch_xla.runtime as xr

    return xr.device_type(), xr.world_size(), xr.global_ordinal()


def _verify_mesh(results: list[tuple[str, int, int]]) -> None:
    n = len(results)
    _expect(results == [("CPU", n, r) for r in range(n)], f"ranks report {results}")


def _all_gather() -> torch.Tensor:
    import xla_permute as xp

    rank, n, device = _rank()
    y = xp.all_gather(_ints(1, n, 2, 3)[rank].to(device), dim=0)
    _sync()
    return y


def _verify_all_gather(results: list[torch.Tensor]) -> None:
    want = reference.all_gather(_ints(1, len(results), 2, 3), dim=0)
    for rank, got in enumerate(results):
        _expect(torch.equal(got, want[rank]), f"rank {rank}: differs from reference.all_gather")


# --- collective_permute: a ring and an open chain, forward and backward ---------------------


def _permute_cases(n: int) -> dict[str, list[tuple[int, int]]]:
    return {"ring": ring_pairs(n), "open chain": [(r, r + 1) for r in range(n - 1)]}


def _permute() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    import xla_permute as xp

    rank, n, device = _rank()
    xs, gs = _ints(2, n, 2, 3), _ints(3, n, 2, 3)
    out = {}
    for name, pairs in _permute_cases(n).items():
        x = xs[rank].to(device).requires_grad_()
        y = xp.collective_permute(x, pairs, backend="emulated")
        (y * gs[rank].to(device)).sum().backward()
        out[name] = (y, x.grad)
    _sync()
    return out


def _verify_permute(results: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
    n = len(results)
    for name, pairs in _permute_cases(n).items():
        xs = _ints(2, n, 2, 3).requires_grad_()
        y = reference.permute(xs, pairs)
        (y * _ints(3, n, 2, 3)).sum().backward()
        for rank, out in enumerate(results):
            _expect(torch.equal(out[name][0], y[rank]), f"rank {rank}: {name} forward differs")
            _expect(torch.equal(out[name][1], xs.grad[rank]), f"rank {rank}: {name} grad differs")


# --- collective matmul, uni- and bidirectional, forward and backward ------------------------

#: op -> (the baseline, the reference, per-rank x rows for N ranks)
_MATMUL = {
    "all_gather_matmul": ("all_gather_then_matmul", reference.all_gather_matmul, lambda n: 2),
    "matmul_reduce_scatter": (
        "matmul_then_reduce_scatter",
        reference.matmul_reduce_scatter,
        lambda n: 2 * n,
    ),
}


def _matmul_data(op: str, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[n, 2, rows, 4]`` (sequence dim 1), w ``[n, 4, 3]``, upstream gradient of y."""
    xs, ws = _ints(4, n, 2, _MATMUL[op][2](n), 4), _ints(5, n, 4, 3)
    return xs, ws, _ints(6, *_MATMUL[op][1](xs, ws, dim=1).shape)


def _matmul(op: str) -> dict[str, tuple[torch.Tensor, ...]]:
    import xla_permute as xp

    rank, n, device = _rank()
    xs, ws, gs = _matmul_data(op, n)
    variants = {
        "baseline": lambda x, w: getattr(xp, _MATMUL[op][0])(x, w, dim=1),
        "uni": lambda x, w: getattr(xp, op)(x, w, dim=1, backend="emulated"),
        "bi": lambda x, w: getattr(xp, op)(x, w, dim=1, bidirectional=True, backend="emulated"),
    }
    out = {}
    for name, fn in variants.items():
        x, w = xs[rank].to(device).requires_grad_(), ws[rank].to(device).requires_grad_()
        y = fn(x, w)
        (y * gs[rank].to(device)).sum().backward()
        out[name] = (y, x.grad, w.grad)
    _sync()
    return out


def _verify_matmul(op: str, results: list[dict[str, tuple[torch.Tensor, ...]]]) -> None:
    xs, ws, gs = _matmul_data(op, len(results))
    xs.requires_grad_(), ws.requires_grad_()
    y = _MATMUL[op][1](xs, ws, dim=1)
    (y * gs).sum().backward()
    for rank, out in enumerate(results):
        for variant, got in out.items():
            for what, a, b in zip(("y", "dx", "dw"), got, (y, xs.grad, ws.grad), strict=True):
                _expect(torch.equal(a, b[rank]), f"rank {rank}: {variant} {what} differs")


# --- a one-step GPipe pipeline: one stage per rank, vs the same model on one device ----------


def _pipeline_data(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage weights ``[n, 4, 4]`` in {-1, 0, 1}, 3 micro-batches ``[3, 2, 4]``, targets."""
    ws = torch.randint(-1, 2, (n, 4, 4), generator=torch.Generator().manual_seed(7)).float()
    return ws, _ints(8, 3, 2, 4), _ints(9, 3, 2, 4)


def _pipeline() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import xla_permute as xp

    rank, n, device = _rank()
    ws, inputs, targets = _pipeline_data(n)
    w = ws[rank].to(device).requires_grad_()
    outputs = xp.pipeline_forward(lambda x: torch.relu(x @ w), inputs.to(device))
    loss = (outputs * targets.to(device)).sum()  # zero except on the last stage
    loss.backward()
    _sync()
    return loss, outputs, w.grad


def _verify_pipeline(results: list[tuple[torch.Tensor, ...]]) -> None:
    ws, h, targets = _pipeline_data(len(results))
    ws.requires_grad_()
    for w in ws:  # the single-device model: every stage in a row
        h = torch.relu(h @ w)
    loss = (h * targets).sum()
    loss.backward()
    _expect(torch.equal(sum(r[0] for r in results), loss), "loss differs from single device")
    _expect(torch.equal(results[-1][1], h), "the last stage's outputs differ")
    for rank, r in enumerate(results):
        _expect(torch.equal(r[2], ws.grad[rank]), f"rank {rank}: stage weight grad differs")


# --- the native programs, traced (not run) -------------------------------------------------


def _matmul_hlo() -> list[str]:
    import xla_permute as xp

    rank, n, device = _rank()
    texts = []
    for op, rows in (("all_gather_matmul", 4), ("matmul_reduce_scatter", 4 * n)):
        for bidirectional in (False, True):
            x, w = torch.ones(rows, 8, device=device), torch.ones(8, 6, device=device)
            with xp.hlo.tracing():  # native: traced on the CPU mesh, never run
                y = getattr(xp, op)(x, w, dim=0, bidirectional=bidirectional, backend="native")
                texts.append(xp.hlo.trace(y))
    return texts


def _verify_matmul_hlo(results: list[list[str]]) -> None:
    from xla_permute import hlo

    n = len(results)
    for rank, texts in enumerate(results):
        for text in texts:
            program = hlo.parse(text)
            kinds = [c.kind for c in program.collectives()]
            _expect(kinds == ["collective-permute"] * (n - 1), f"rank {rank}: collectives {kinds}")
            for c in program.collectives():
                _expect(bool(program.independent_of(c.name)), f"rank {rank}: {c.name} has no dot")


def _permute_hlo() -> str:
    import xla_permute as xp

    rank, n, device = _rank()
    x = torch.ones(2, 3, device=device)
    with xp.hlo.tracing():  # native: traced on the CPU mesh, never run
        return xp.hlo.trace(xp.collective_permute(x, ring_pairs(n), backend="native"))


def _verify_permute_hlo(results: list[str]) -> None:
    from xla_permute import hlo

    ring = set(ring_pairs(len(results)))
    for rank, text in enumerate(results):
        found = [(c.kind, set(c.pairs)) for c in hlo.parse(text).collectives()]
        _expect(found == [("collective-permute", ring)], f"rank {rank}: got {found}")


# --- ring attention (causal, zigzag) against SDPA on the whole sequence ------------------------


def _attention_data(n: int) -> tuple[torch.Tensor, ...]:
    """q [1, 2, S, 8] (two query heads), k, v [1, 1, S, 8] (one K/V head), dout; S = 4n."""
    g = torch.Generator().manual_seed(5)
    shapes = ((1, 2, 4 * n, 8), (1, 1, 4 * n, 8), (1, 1, 4 * n, 8), (1, 2, 4 * n, 8))
    return tuple(torch.randn(*shape, generator=g) for shape in shapes)


def _attention() -> tuple[torch.Tensor, ...]:
    from xla_permute import ring_attention, shard_sequence

    r, n, device = _rank()
    q, k, v, dout = (
        shard_sequence(t, dim=2, n=n, layout="zigzag")[r].to(device) for t in _attention_data(n)
    )
    for t in (q, k, v):
        t.requires_grad_()
    out = ring_attention(q, k, v, causal=True, layout="zigzag")
    (out * dout).sum().backward()
    _sync()
    return out, q.grad, k.grad, v.grad


def _verify_attention(results: list[tuple[torch.Tensor, ...]]) -> None:
    from torch.nn.functional import scaled_dot_product_attention

    from xla_permute import unshard_sequence

    q, k, v, dout = (t.double().requires_grad_() for t in _attention_data(len(results)))
    want = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (want * dout).sum().backward()
    refs = (want, q.grad, k.grad, v.grad)
    for i, (name, ref) in enumerate(zip(("out", "dq", "dk", "dv"), refs, strict=True)):
        got = unshard_sequence([r[i] for r in results], dim=2, layout="zigzag").double()
        error = ((got - ref.detach()).abs().max() / ref.detach().abs().max()).item()
        _expect(error < 1e-5, f"{name}: relative error {error:.1e} against SDPA (float64)")


CHECKS: list[Check] = [
    Check("mesh: N CPU devices, one per rank", "PJRT CPU", _mesh, _verify_mesh),
    Check("all-gather with a channel id", "xp.all_gather", _all_gather, _verify_all_gather),
    Check("permute ring + open chain, fwd+bwd", "emulated", _permute, _verify_permute),
    Check(
        "all_gather_matmul uni+bi+baseline, fwd+bwd",
        "emulated",
        lambda: _matmul("all_gather_matmul"),
        lambda results: _verify_matmul("all_gather_matmul", results),
    ),
    Check(
        "matmul_reduce_scatter uni+bi+baseline, fwd+bwd",
        "emulated",
        lambda: _matmul("matmul_reduce_scatter"),
        lambda results: _verify_matmul("matmul_reduce_scatter", results),
    ),
    Check("GPipe step (a stage per rank) vs one device", "emulated", _pipeline, _verify_pipeline),
    Check(
        "ring attention causal zigzag, fwd+bwd vs SDPA",
        "emulated",
        _attention,
        _verify_attention,
    ),
    Check(
        "collective matmul HLO: N-1 permutes, free dots",
        "native (traced, not run)",
        _matmul_hlo,
        _verify_matmul_hlo,
    ),
    Check(
        "permute HLO: one collective-permute, ring pairs",
        "native (traced, not run)",
        _permute_hlo,
        _verify_permute_hlo,
    ),
]


def _run_on_rank(names: list[str]) -> dict[str, tuple[bool, Any, float]]:
    """Rank function: every named check, one program each, timed; an error becomes a row."""
    by_name = {c.name: c for c in CHECKS}
    out = {}
    for name in names:
        start = time.perf_counter()
        try:
            value: tuple[bool, Any] = (True, by_name[name].run())
        except Exception as e:  # a failing check is a row of the table, not a crash
            value = (False, f"{type(e).__name__}: {e}")
        out[name] = (*value, time.perf_counter() - start)
    return out


def run_checks(n: int = 4, names: Sequence[str] | None = None) -> list[Row]:
    """Run the named checks (default: all) in one launch of an ``n``-device CPU mesh."""
    from xla_permute import run_on_mesh

    checks = [c for c in CHECKS if names is None or c.name in names]
    per_rank = run_on_mesh(_run_on_rank, [c.name for c in checks], n=n)
    rows = []
    for check in checks:
        results = [r[check.name] for r in per_rank]
        seconds = max(r[2] for r in results)
        failed = [(rank, r[1]) for rank, r in enumerate(results) if not r[0]]
        if failed:
            detail = f"rank {failed[0][0]}: {failed[0][1]}"
        else:
            try:
                check.verify([r[1] for r in results])
                detail = "ok"
            except AssertionError as e:
                detail = str(e)
        rows.append(Row(check.name, check.backend, detail == "ok", detail, seconds))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """A plain-text table: check, backend, result, time."""
    header = ("check", "backend", "result", "time")
    body = [(r.check, r.backend, r.detail, f"{r.seconds * 1e3:.0f} ms") for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    return "\n".join(
        "  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
        for line in [header, tuple("-" * w for w in widths), *body]
    )


def main(n: int = 4) -> int:
    """Print the table of one ``n``-device launch; return 0 when every check passed, else 1."""
    from xla_permute import MeshError

    print(
        f"self-test: {n}-device CPU mesh (PJRT_DEVICE=CPU), one launch, vs the reference "
        f"(exact on integer data)"
    )
    start = time.perf_counter()
    try:
        rows = run_checks(n)
    except MeshError as e:
        print(f"self-test could not run: {type(e).__name__}: {e}")
        return 1
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    seconds = time.perf_counter() - start
    print(f"{len(rows) - len(failed)} of {len(rows)} checks ok ({seconds:.1f} s)")
    return 1 if failed else 0
