"""The cases of tests/test_distributed.py: every op on torch.distributed (c10d, gloo, CPU).

Run by ``torchrun`` (``python -m torch.distributed.run``), one process per rank:
``dist_cases.py OUT_DIR [ROUTE]`` runs every case on this rank, its permutes sent by ``ROUTE``
(:func:`xla_permute.backends.c10d.permute_route`), and saves ``OUT_DIR/rank{r}.pt``;
at 2 processes it ends with a hang: rank 1 never joins one more op, and rank 0 must fail
within the process group's timeout (shortened to 2 s for it) and write ``OUT_DIR/hang.txt``.
The test module computes the expected values from the same data with
:mod:`xla_permute.reference` (or one-device torch) and compares.

A case is ``inputs(n) -> {name: rank-stacked tensor}`` (the same on every process: seeded),
``op(mine, rank, n) -> outputs`` on a rank, and ``ref(stacked, n) -> rank-stacked outputs``.
Every rank's loss is ``sum_i (out_i * g_i).sum()`` with integer ``g``: the backward is checked
against autograd through the reference.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import permute_cases as pc
import torch
import torch.nn.functional as F

import xla_permute as xp
from xla_permute import reference as ref
from xla_permute.backends.c10d import permute_route, route_of

Tensors = dict[str, torch.Tensor]
TIMEOUT = timedelta(seconds=30)  # a peer that never comes: an error after this, not a hang


def ints(*shape: int, seed: int, dtype: torch.dtype = torch.float32, lo: int = -3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, -lo + 1, shape, generator=g).to(dtype)


def randn(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def upstream(name: str, i: int, r: int, like: torch.Tensor) -> torch.Tensor:
    """The integer upstream gradient of output ``i`` on rank ``r`` (the same in both runs)."""
    seed = zlib.crc32(f"{name}/{i}/{r}".encode())
    return ints(*like.shape, seed=seed, dtype=like.dtype, lo=-2)


@dataclass(frozen=True)
class Case:
    inputs: Callable[[int], Tensors]
    op: Callable[[Tensors, int, int], tuple[torch.Tensor, ...]]
    ref: Callable[[Tensors, int], tuple[torch.Tensor, ...]]
    exact: bool = True
    min_n: int = 2
    grads: bool = True


CASES: dict[str, Case] = {}


def case(name: str, **kw: Any) -> Callable[[Callable], Callable]:
    def register(fns: Callable) -> Callable:
        inputs, op, ref_ = fns()
        CASES[name] = Case(inputs, op, ref_, **kw)
        return fns

    return register


def groups_for(n: int) -> list[list[int]]:
    """Two groups listed out of order (their rings run in the listed order)."""
    return [[1, 0], [3, 2]] if n == 4 else [[1, 0]]


def per_group(fn: Callable[..., torch.Tensor], groups: list[list[int]], *xs: torch.Tensor):
    """A reference op applied inside each group (rank-stacked in, rank-stacked out)."""
    outs: list[Any] = [None] * xs[0].shape[0]
    for g in groups:
        got = fn(*(x[g] for x in xs))
        for j, r in enumerate(g):
            outs[r] = got[j]
    return torch.stack(outs)


# --- collective_permute, stage_shift --------------------------------------------------------


def _permute_case(name: str, pairs_of: Callable[[int], list], groups_of=None, use_async=False):
    @case(name)
    def _():
        def inputs(n):
            return {"x": ints(n, 3, 4, seed=1)}

        def op(m, r, n):
            groups = groups_of(n) if groups_of else None
            if use_async:
                work = xp.collective_permute(m["x"], pairs_of(n), groups=groups, async_op=True)
                return (work.wait(),)
            return (xp.collective_permute(m["x"], pairs_of(n), groups=groups),)

        def ref_(s, n):
            return (ref.permute(s["x"], pairs_of(n), groups_of(n) if groups_of else None),)

        return inputs, op, ref_


_permute_case("permute ring +1", lambda n: xp.ring_pairs(n))
_permute_case("permute ring -1", lambda n: xp.ring_pairs(n, -1))
_permute_case("permute open chain", lambda n: [(r, r + 1) for r in range(n - 1)])
_permute_case("permute async", lambda n: xp.ring_pairs(n), use_async=True)
_permute_case("permute self and swap", lambda n: [(0, 1), (1, 0)] + [(r, r) for r in range(2, n)])
_permute_case("permute in groups", lambda n: [(0, 1)], groups_of=groups_for)


@case("permute empty tensor")
def _():
    def inputs(n):
        return {"x": torch.ones(n, 0, 3)}

    def op(m, r, n):
        return (xp.collective_permute(m["x"], xp.ring_pairs(n)),)

    return inputs, op, lambda s, n: (ref.permute(s["x"], xp.ring_pairs(n)),)


def _mesh_permute_case(name: str, c: dict[str, Any]) -> None:
    """A case of the mesh's permute tests (tests/permute_cases.py, 4 ranks), on the processes."""
    pairs, groups = [tuple(p) for p in c["pairs"]], c["groups"]

    @case(f"permute {name}", min_n=4, grads=c["xs"].dtype.is_floating_point)
    def _():
        def op(m, r, n):
            return (xp.collective_permute(m["x"], pairs, groups=groups),)

        return (lambda n: {"x": c["xs"]}), op, lambda s, n: (ref.permute(s["x"], pairs, groups),)


for _name, _c in {**pc.classic_cases(), **dict(enumerate(pc.generated_cases()))}.items():
    _mesh_permute_case(str(_name), _c)


def _shift_case(offset: int, wrap: bool, grouped: bool = False):
    @case(f"stage_shift {offset:+d} wrap={wrap}" + (" groups" if grouped else ""))
    def _():
        def inputs(n):
            return {"x": ints(n, 2, 3, seed=2)}

        def groups(n):
            return [[0, 1], [2, 3]] if grouped and n == 4 else None

        def op(m, r, n):
            return (xp.stage_shift(m["x"], offset=offset, wrap=wrap, groups=groups(n)),)

        def ref_(s, n):
            return (ref.stage_shift(s["x"], offset, wrap=wrap, groups=groups(n)),)

        return inputs, op, ref_


for _offset, _wrap in [(1, False), (-1, False), (1, True)]:
    _shift_case(_offset, _wrap)
_shift_case(1, False, grouped=True)


def _pipeline_case(stages: int | None):
    @case(f"pipeline_forward stages={stages}", min_n=2 if stages is None else 4)
    def _():
        def inputs(n):
            return {"x": ints(n, 3, 2, 3, seed=15)}  # 3 micro-batches of [2, 3]

        def op(m, r, n):
            position = r % (stages or n)
            return (xp.pipeline_forward(lambda x: x * (position + 2) + 1, m["x"], stages=stages),)

        def chain(x):  # rank-stacked: the last stage gets every stage applied to x[0]
            y = x[0]
            for position in range(x.shape[0]):
                y = y * (position + 2) + 1
            return torch.stack([x[r] * 0 for r in range(x.shape[0] - 1)] + [y])

        def ref_(s, n):
            return (per_group(chain, [[0, 1], [2, 3]], s["x"]) if stages else chain(s["x"]),)

        return inputs, op, ref_


_pipeline_case(None)
_pipeline_case(2)


# --- all_gather, reduce_scatter, sum_gradients ----------------------------------------------


def _collective_case(kind: str, dim: int, grouped: bool):
    @case(f"{kind} dim={dim}" + (" groups" if grouped else ""))
    def _():
        def inputs(n):
            rows = 4 if kind == "all_gather" else 4 * n
            return {"x": ints(n, rows, 4, seed=3).movedim(1, 1 + dim)}

        def op(m, r, n):
            groups = groups_for(n) if grouped else None
            return (getattr(xp, kind)(m["x"], dim, groups=groups),)

        def ref_(s, n):
            fn = getattr(ref, kind)
            if not grouped:
                return (fn(s["x"], dim),)
            return (per_group(lambda x: fn(x, dim), groups_for(n), s["x"]),)

        return inputs, op, ref_


for _kind in ("all_gather", "reduce_scatter"):
    for _dim in (0, 1):
        _collective_case(_kind, _dim, False)
    _collective_case(_kind, 0, True)


@case("sum_gradients")
def _():
    def inputs(n):
        return {"b": ints(n, 5, seed=4)}

    def op(m, r, n):
        return (xp.sum_gradients(m["b"]),)

    def ref_(s, n):  # forward: the identity; backward: every rank gets the sum of the grads
        total = s["b"].sum(0, keepdim=True)
        return (total.expand_as(s["b"]) - total.detach() + s["b"].detach(),)

    return inputs, op, ref_


# --- collective matmul ----------------------------------------------------------------------


def _agm_case(bi: bool, shape: tuple[int, ...], dim: int, weights: int, grouped: bool, base: bool):
    label = "base" if base else ("bi" if bi else "uni")
    name = f"all_gather_matmul {label} x{shape} dim={dim} w*{weights}"
    name += " groups" if grouped else ""

    @case(name)
    def _():
        def inputs(n):
            out = {"x": ints(n, *shape, seed=5)}
            for i in range(weights):
                out[f"w{i}"] = ints(n, shape[-1], 3 + i, seed=6 + i)
            return out

        def op(m, r, n):
            ws = [m[f"w{i}"] for i in range(weights)]
            w = ws[0] if weights == 1 else ws
            groups = groups_for(n) if grouped else None
            if base:
                ys = xp.all_gather_then_matmul(m["x"], w, dim=dim, groups=groups)
            else:
                ys = xp.all_gather_matmul(m["x"], w, dim=dim, bidirectional=bi, groups=groups)
            return (ys,) if weights == 1 else tuple(ys)

        def ref_(s, n):
            outs = []
            for i in range(weights):

                def fn(x, w):
                    return ref.all_gather_matmul(x, w, dim)

                if grouped:
                    outs.append(per_group(fn, groups_for(n), s["x"], s[f"w{i}"]))
                else:
                    outs.append(fn(s["x"], s[f"w{i}"]))
            return tuple(outs)

        return inputs, op, ref_


for _bi in (False, True):
    _agm_case(_bi, (3, 4), 0, 1, False, False)
    _agm_case(_bi, (2, 3, 4), 1, 2, False, False)
    _agm_case(_bi, (3, 4), 0, 1, True, False)
_agm_case(False, (3, 4), 0, 2, False, True)


def _mrs_case(bi: bool, dtype: torch.dtype, reduce_dtype, grouped: bool, base: bool):
    label = "base" if base else ("bi" if bi else "uni")
    name = f"matmul_reduce_scatter {label} {dtype} reduce={reduce_dtype}"
    name += " groups" if grouped else ""

    @case(name)
    def _():
        def inputs(n):
            return {
                "x": ints(n, 2, 2 * n, 6, seed=8, dtype=dtype),
                "w": ints(n, 6, 5, seed=9, dtype=dtype),
            }

        def op(m, r, n):
            groups = groups_for(n) if grouped else None
            kw = dict(dim=1, reduce_dtype=reduce_dtype, groups=groups)
            if base:
                return (xp.matmul_then_reduce_scatter(m["x"], m["w"], **kw),)
            return (xp.matmul_reduce_scatter(m["x"], m["w"], bidirectional=bi, **kw),)

        def ref_(s, n):
            def fn(x, w):
                return ref.matmul_reduce_scatter(x, w, 1)

            if grouped:
                return (per_group(fn, groups_for(n), s["x"], s["w"]),)
            return (fn(s["x"], s["w"]),)

        return inputs, op, ref_


for _bi in (False, True):
    _mrs_case(_bi, torch.float32, None, False, False)
    _mrs_case(_bi, torch.bfloat16, None, False, False)
_mrs_case(False, torch.bfloat16, torch.bfloat16, False, False)
_mrs_case(True, torch.float32, None, True, False)
_mrs_case(False, torch.float32, None, False, True)
_mrs_case(False, torch.bfloat16, None, False, True)


# --- ring attention -------------------------------------------------------------------------


def _sdpa_sharded(q, k, v, n, causal, layout):
    """The reference: SDPA on the whole sequence, sharded back (rank-stacked in and out)."""
    full = [xp.unshard_sequence(t, dim=2, layout=layout) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
    return xp.shard_sequence(out, dim=2, n=n, layout=layout)


def _attention_case(causal: bool, layout: str, grouped: bool = False, base: bool = False):
    name = f"{'all_gather' if base else 'ring'}_attention causal={causal} {layout}"
    name += " groups" if grouped else ""

    @case(name, exact=False, min_n=4 if grouped else 2)
    def _():
        def inputs(n):
            s = 4 * n
            full = {
                "q": randn(2, 4, s, 8, seed=10),
                "k": randn(2, 2, s, 8, seed=11),
                "v": randn(2, 2, s, 8, seed=12),
            }
            if grouped:  # each group its own sequence: two halves of a batch of 4
                return {
                    t: torch.cat([xp.shard_sequence(x, dim=2, n=2, layout=layout)] * (n // 2))
                    for t, x in full.items()
                }
            return {t: xp.shard_sequence(x, dim=2, n=n, layout=layout) for t, x in full.items()}

        def op(m, r, n):
            kw = dict(causal=causal, layout=layout)
            if base:
                return (xp.all_gather_attention(m["q"], m["k"], m["v"], **kw),)
            groups = [[0, 1], [2, 3]] if grouped else None
            return (xp.ring_attention(m["q"], m["k"], m["v"], groups=groups, **kw),)

        def ref_(s, n):
            if grouped:
                return (
                    per_group(
                        lambda q, k, v: _sdpa_sharded(q, k, v, 2, causal, layout),
                        [[0, 1], [2, 3]],
                        s["q"],
                        s["k"],
                        s["v"],
                    ),
                )
            return (_sdpa_sharded(s["q"], s["k"], s["v"], n, causal, layout),)

        return inputs, op, ref_


for _causal in (False, True):
    _attention_case(_causal, "contiguous")
_attention_case(True, "zigzag")
_attention_case(True, "contiguous", base=True)
_attention_case(True, "zigzag", grouped=True)


# --- the layers ------------------------------------------------------------------------------


def _linear(i: int, o: int, seed: int, dtype=torch.float64) -> torch.nn.Linear:
    lin = torch.nn.Linear(i, o, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(ints(o, i, seed=seed, dtype=dtype))
        lin.bias.copy_(ints(o, seed=seed + 1, dtype=dtype))
    return lin


LR = 2.0**-10  # SGD's step: float64 sums of ints stay exact in the first step
LAYER_KINDS = ("ColumnParallelLinear", "RowParallelLinear", "SequenceParallelMLP", "GatedMLP")


def layer_run(kind: str, strategy: str, r: int, n: int, steps: int = 1) -> Tensors:
    """This rank's layer (built inside the rank from the full layers, no world_size given: it
    asks the backend), forward, backward; ``steps`` SGD steps; outputs and its gradients."""
    h, f = 4, 8
    fc1, fc2, fc3 = _linear(h, f, 20), _linear(f, h, 22), _linear(h, f, 24)
    kw = dict(strategy=strategy, dtype=torch.float64)
    if kind == "SequenceParallelMLP":
        layer = xp.SequenceParallelMLP.from_mlp(fc1, fc2, torch.relu, **kw)
    elif kind == "GatedMLP":
        layer = xp.GatedMLP.from_mlp(fc1, fc3, fc2, xp.relu_product, **kw)
    elif kind == "ColumnParallelLinear":
        layer = xp.ColumnParallelLinear.from_linear(fc1, **kw)
    else:
        layer = xp.RowParallelLinear.from_linear(fc2, **kw)
    xs = layer_inputs(kind, n)
    opt = torch.optim.SGD(layer.parameters(), lr=LR)
    out: Tensors = {}
    for step in range(steps):
        opt.zero_grad()
        y = layer(xs[r])
        (y * upstream(kind, step, r, y)).sum().backward()
        out[f"y{step}"] = y.detach()
        if step == 0:
            out.update({f"grad {k}": p.grad.clone() for k, p in layer.named_parameters()})
        opt.step()
    out.update({f"param {k}": p.detach().clone() for k, p in layer.named_parameters()})
    return out


def layer_inputs(kind: str, n: int) -> torch.Tensor:
    """Rank-stacked layer inputs: ``[B, S/N, H]`` shards, or for the row-parallel layer
    ``[B, S, F/N]`` (all rows, this rank's input columns)."""
    if kind == "RowParallelLinear":
        return ints(n, 2, 3 * n, 8 // n, seed=14, dtype=torch.float64)
    return ints(n, 2, 3, 4, seed=13, dtype=torch.float64)


# --- errors: the same bad call on every rank ------------------------------------------------


def bad_calls(r: int, n: int) -> dict[str, Callable[[], Any]]:
    x, w = torch.ones(3, 4), torch.ones(4, 2)
    q = torch.ones(1, 2, 4, 8)
    return {
        "permute duplicate target": lambda: xp.collective_permute(x, [(0, 1), (1, 1)]),
        "permute not a tensor": lambda: xp.collective_permute([1.0], xp.ring_pairs(n)),
        "permute native on a CPU tensor": lambda: xp.collective_permute(
            x, xp.ring_pairs(n), backend="native"
        ),
        "agm dtypes differ": lambda: xp.all_gather_matmul(x, w.double(), dim=0),
        "mrs rows not divisible": lambda: xp.matmul_reduce_scatter(
            torch.ones(2 * n + 1, 4), w, dim=0
        ),
        "attention bad layout": lambda: xp.ring_attention(q, q, q, layout="spiral"),
        "shift offset too large": lambda: xp.stage_shift(x, offset=n),
        "reduce_scatter not divisible": lambda: xp.reduce_scatter(torch.ones(2 * n + 1), 0),
        # in debug mode: the ranks disagree (raised on every rank)
        "permute shapes disagree": lambda: xp.collective_permute(
            torch.ones(3 + (r == 1), 4), xp.ring_pairs(n)
        ),
        "agm options disagree": lambda: xp.all_gather_matmul(x, w, dim=0, bidirectional=r == 0),
    }


# --- the rank's side ------------------------------------------------------------------------


def run_case(name: str, c: Case, r: int, n: int) -> Tensors:
    data = c.inputs(n)
    mine = {k: v[r].clone().requires_grad_(c.grads) for k, v in data.items()}
    outs = c.op(mine, r, n)
    result = {f"y{i}": y.detach() for i, y in enumerate(outs)}
    if c.grads:
        loss = sum((y.float() * upstream(name, i, r, y).float()).sum() for i, y in enumerate(outs))
        loss.backward()
        for k, t in mine.items():
            result[f"d{k}"] = t.grad if t.grad is not None else torch.zeros_like(t)
    return result


def expect_case(name: str, c: Case, n: int) -> list[Tensors]:
    """Rank by rank, the outputs and gradients the reference gives."""
    data = {k: v.clone().requires_grad_(c.grads) for k, v in c.inputs(n).items()}
    outs = c.ref(data, n)
    per_rank: list[Tensors] = [{} for _ in range(n)]
    for i, y in enumerate(outs):
        for r in range(n):
            per_rank[r][f"y{i}"] = y[r].detach()
    if c.grads:
        loss = sum(
            (y[r].float() * upstream(name, i, r, y[r]).float()).sum()
            for i, y in enumerate(outs)
            for r in range(n)
        )
        loss.backward()
        for k, t in data.items():
            for r in range(n):
                per_rank[r][f"d{k}"] = t.grad[r]
    return per_rank


def main(out_dir: str, route: str = "auto") -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=TIMEOUT)
    torch.set_num_threads(1)
    with permute_route(route):
        run_all(out_dir, route)


def run_all(out_dir: str, route: str) -> None:
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {"cases": {}, "errors": {}, "layers": {}, "seconds": {}}
    results["route"] = route_of(dist.get_backend())  # the permutes' route on this group
    for name, c in CASES.items():
        if n >= c.min_n:
            start = time.perf_counter()
            results["cases"][name] = run_case(name, c, r, n)
            results["seconds"][name] = time.perf_counter() - start
    for kind in LAYER_KINDS:
        for strategy in ("ring", "baseline"):
            steps = 3 if kind == "GatedMLP" else 1
            results["layers"][kind, strategy] = layer_run(kind, strategy, r, n, steps)
    for name, call in bad_calls(r, n).items():
        try:
            call()
            results["errors"][name] = "no error"
        except (TypeError, ValueError) as e:
            results["errors"][name] = f"{type(e).__name__}: {e}"
    results["compile"] = compiled_ring()
    dist.barrier()  # every rank is past its errors: none left a peer waiting
    torch.save(results, Path(out_dir) / f"rank{r}.pt")
    if n == 2:
        hang(r, Path(out_dir))
    dist.destroy_process_group()


def compiled_ring() -> str:
    """A ring under ``torch.compile`` (Inductor, PyTorch's default): refused at once, before any
    collective, on every rank (``CompileError: <op> was called inside torch.compile ...``)."""

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(xp.all_gather_matmul(x, w, dim=0)).sum()

    try:
        torch.compile(step)(torch.ones(2, 4), torch.ones(4, 3))
        return "no error"
    except xp.CompileError as e:
        return f"CompileError: {e}"


def hang(r: int, out: Path) -> None:
    """Rank 1 never joins the next op (it sleeps, then leaves); rank 0 must fail within the
    process group's timeout, shortened here to 2 s, and says how long it waited."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=2), dist.group.WORLD)
    if r == 1:
        time.sleep(6)
        os._exit(0)
    start = time.monotonic()
    try:
        xp.all_gather_matmul(torch.ones(2, 4), torch.ones(4, 2), dim=0)
        message = "no error"
    except RuntimeError as e:
        message = f"{type(e).__name__}: {e}"
    (out / "hang.txt").write_text(f"{time.monotonic() - start:.1f}\n{message}\n")
    os._exit(0)


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
