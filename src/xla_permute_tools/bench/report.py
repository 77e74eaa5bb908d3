"""The bench's result as Markdown, and what it derives from the figures: ratios and checks.

:func:`ratios` divides every program's figures by its op's baseline's; :func:`checks` lists the
facts that must hold (bytes sent equal to the baseline's, emulated results equal to the
baseline's); :func:`format_report` prints everything, each column labelled with its backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xla_permute_tools.bench.measure import TOKEN_ENV, TOKEN_VARIANTS
from xla_permute_tools.bench.programs import BASELINES, X_MODES

__all__ = ["checks", "format_report", "ratios"]


def _by_name(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows}


def ratios(
    rows: list[dict[str, Any]],
    scaling: list[dict[str, Any]],
    memory: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Each non-baseline program's figures divided by its op's baseline's; ``memory``: the
    peak-memory ratios (largest rank over largest rank) at each measured mesh size."""
    out: dict[str, Any] = {"n": {}, "scaling_n": {}, "memory": []}
    for size in memory:
        peaks = size["peak_bytes"]
        out["memory"].append(
            {
                "n": size["n"],
                "peak": {
                    name: {
                        v: {
                            m: max(peak[v][m]) / max(peaks[f"{name.split('/')[0]}/baseline"][v][m])
                            for m in X_MODES
                        }
                        for v in TOKEN_VARIANTS
                    }
                    for name, peak in peaks.items()
                    if not name.endswith("/baseline")
                },
            }
        )
    for table, key in ((rows, "n"), (scaling, "scaling_n")):
        named = _by_name(table)
        for r in table:
            if r["method"] == "baseline":
                continue
            base = named[f"{r['op']}/baseline"]
            figures = {
                "trace_plus_compile": (r["trace_s"] + r["compile_s"])
                / (base["trace_s"] + base["compile_s"]),
            }
            if key == "n":
                figures["run"] = r["run_s"] / base["run_s"]
                figures["bytes"] = r["bytes"]["total"] / base["bytes"]["total"]
                figures["peak"] = {
                    v: {m: r["peak_bytes"][v][m] / base["peak_bytes"][v][m] for m in X_MODES}
                    for v in TOKEN_VARIANTS
                }
            out[key][r["name"]] = figures
    return out


#: Rings whose peak memory (token on, x an input) must not exceed their baseline's.
AT_MOST_BASELINE = (
    "matmul_reduce_scatter/uni",
    "matmul_reduce_scatter/bi",
    "all_gather_matmul.backward/uni",
    "all_gather_matmul.backward/bi",
)


def memory_checks(memory: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mesh size (``ratios["memory"]``): each of ``AT_MOST_BASELINE`` at most 1.0x its
    baseline's peak, and the ring with 4 chunks below the unchunked one (token on, x input)."""
    out = []
    for size in memory:
        n, peak = size["n"], size["peak"]
        for name in AT_MOST_BASELINE:
            if name in peak:
                ratio = peak[name]["token"]["input"]
                out.append(
                    {
                        "check": f"{name} at N={n}: peak memory <= 1.0x the baseline's "
                        "(token on, x an input)",
                        "ok": ratio <= 1.0,
                        "detail": f"{ratio:.3f}x",
                    }
                )
        for method in ("uni", "bi"):
            one, four = (peak.get(f"all_gather_matmul/{method}{c}") for c in ("", "/c4"))
            if one is None or four is None:
                continue
            a, b = one["token"]["input"], four["token"]["input"]
            out.append(
                {
                    "check": f"all_gather_matmul/{method} at N={n}: peak memory with chunks=4 "
                    "below chunks=1 (token on, x an input)",
                    "ok": b < a,
                    "detail": f"{b:.3f}x vs {a:.3f}x of the baseline",
                }
            )
    return out


def checks(
    rows: list[dict[str, Any]],
    scaling: list[dict[str, Any]],
    reduce_bytes: Sequence[dict[str, Any]] = (),
    memory: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Facts that must hold (``ok``); a failure makes the command exit 1. ``memory``:
    ``ratios["memory"]`` (:func:`memory_checks`)."""
    out = memory_checks(memory)
    for r in reduce_bytes:
        out.append(
            {
                "check": f"{r['name']}, bf16, reduce_dtype={r['reduce_dtype']}: bytes sent = "
                "accumulation_dtype's = the cost model's",
                "ok": r["sent"] == r["expected"] == r["model"],
                "detail": f"{r['sent']} B sent, {r['expected']} B from accumulation_dtype "
                f"({r['partial_sum_dtype']}), {r['model']} B in the cost model",
            }
        )
    named = _by_name(rows)
    for op in BASELINES:
        base = named.get(f"{op}/baseline")
        for method in ("uni", "bi"):
            r = named.get(f"{op}/{method}")
            if r is None or base is None:
                continue
            sent, base_sent = r["bytes"]["total"], base["bytes"]["total"]
            detail = f"{sent} B vs baseline {base_sent} B"
            ok = sent == base_sent
            if op == "all_gather_matmul":
                n, gathered = r["n"], base["bytes"]["gathered_bytes"]
                expected = (n - 1) * gathered // n
                ok = ok and sent == expected
                detail += f"; (N-1)/N of the gathered operand ({gathered} B) = {expected} B"
            out.append(
                {
                    "check": f"{r['name']}: bytes sent per rank = baseline's",
                    "ok": ok,
                    "detail": detail,
                }
            )
            out.append(
                {
                    "check": f"{r['name']}: emulated result = baseline's (exact)",
                    "ok": bool(r["same_as_baseline"]),
                    "detail": "integer-valued float32 inputs",
                }
            )
    sc = _by_name(scaling)
    for op in BASELINES:
        for method in ("uni", "bi"):
            r, base = sc.get(f"{op}/{method}"), sc.get(f"{op}/baseline")
            if r is None or base is None:
                continue
            out.append(
                {
                    "check": f"{r['name']} at N={r['n']}: bytes sent per rank = baseline's",
                    "ok": r["bytes_total"] == base["bytes_total"],
                    "detail": f"{r['bytes_total']} B vs baseline {base['bytes_total']} B",
                }
            )
    return out


def _fmt_bytes(value: float) -> str:
    """``1.5 MiB``, ``96 B``: binary units, three significant digits.

    >>> _fmt_bytes(96), _fmt_bytes(3 * 2**20), _fmt_bytes(1536)
    ('96 B', '3 MiB', '1.5 KiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def _fmt_ratio(value: float | None) -> str:
    return "1 (baseline)" if value is None else f"{value:.2f}x"


def _chunk_table(size: dict[str, Any], peak: dict[str, Any]) -> list[str]:
    """All-gather-matmul's rings by ``chunks``: permutes and peak memory (token on, x input)."""
    names = [f"all_gather_matmul/{m}{c}" for m in ("uni", "bi") for c in ("", "/c2", "/c4")]
    names = [name for name in names if name in size.get("permutes", {}) and name in peak]
    if not names:
        return []
    lines = [
        "",
        f"all_gather_matmul with each block sent in c chunks, N={size['n']} (native program, "
        "XLA:CPU buffer assignment, token on, x an input):",
        "",
        "| program | chunks | permutes | peak | vs baseline |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        chunks = name.rpartition("/c")[2] if "/c" in name else "1"
        lines.append(
            f"| {name} | {chunks} | {size['permutes'][name]} | "
            f"{_fmt_bytes(max(size['peak_bytes'][name]['token']['input']))} | "
            f"{_fmt_ratio(peak[name]['token']['input'])} |"
        )
    return lines


def format_report(result: dict[str, Any]) -> str:
    """The results as Markdown tables, every column labelled with its backend."""
    cfg, against = result["config"], result["ratios"]
    n = cfg["n"]
    lines = [
        f"Per rank: all_gather_matmul x [{cfg['m']}, {cfg['k']}], matmul_reduce_scatter x "
        f"[N*{cfg['m']}, {cfg['k']}], w [{cfg['k']}, {cfg['f']}], float32. CPU mesh, "
        f"torch_xla {result['environment']['torch_xla']}, {result['environment']['cpu_count']} "
        "cores.",
        "",
        f"Time, N={n} (trace, compile: native program on rank 0, median of "
        f"{cfg['compile_repeats']}; run: EMULATED backend, slowest rank, median of "
        f"{cfg['repeats']}):",
        "",
        "| program | trace ms (native) | compile ms (native) | fusions (native) "
        "| trace + compile vs baseline | run ms (emulated) | run vs baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    if "debug_mode_ratio" in result:
        lines[1:1] = [
            "",
            f"Agreement checks' cost: a permute ring of one x block takes "
            f"{result['debug_mode_ratio']:.2f}x its time without any check with the debug mode "
            f"(XLA_PERMUTE_DEBUG=1, every call checked) and "
            f"{result.get('sampled_check_ratio', float('nan')):.2f}x with the default sampled "
            f"checks (each op's 1st, 2nd, 4th, ... call; steady state) (emulated, slowest "
            f"rank). The mesh turns the debug mode on by default; every other figure here is "
            f"measured with XLA_PERMUTE_DEBUG=none (no checks).",
        ]
    for r in result["programs"]:
        rr = against["n"].get(r["name"], {})
        lines.append(
            f"| {r['name']} | {r['trace_s'] * 1e3:.1f} | {r['compile_s'] * 1e3:.1f} | "
            f"{r['fusions']} | {_fmt_ratio(rr.get('trace_plus_compile'))} | "
            f"{r['run_s'] * 1e3:.1f} | {_fmt_ratio(rr.get('run'))} |"
        )
    if result["scaling"]:
        lines += [
            "",
            f"Trace and compile at N={cfg['scaling_n']} (native program on rank 0, median of "
            f"{cfg['compile_repeats']}):",
            "",
            "| program | trace ms (native) | compile ms (native) | trace + compile vs baseline |",
            "|---|---|---|---|",
        ]
        for r in result["scaling"]:
            rr = against["scaling_n"].get(r["name"], {})
            lines.append(
                f"| {r['name']} | {r['trace_s'] * 1e3:.1f} | {r['compile_s'] * 1e3:.1f} | "
                f"{_fmt_ratio(rr.get('trace_plus_compile'))} |"
            )
    sizes = result.get("memory") or [
        {"n": n, "peak_bytes": {r["name"]: r["peak_bytes_per_rank"] for r in result["programs"]}}
    ]
    size_ratios = {m["n"]: m["peak"] for m in against.get("memory", [])}
    for size in sizes:
        lines += [
            "",
            f"Peak memory per device, N={size['n']} (native program, XLA:CPU buffer assignment, "
            f"'Total bytes used', largest over the ranks; x an input or computed in the program;"
            f" with torch_xla's collective token, then with {TOKEN_ENV}=1):",
        ]
        for v in TOKEN_VARIANTS:  # a table each: nine columns do not fit a page's column
            label = ", no token" if v == "no_token" else ""
            lines += [
                "",
                f"| program | x input{label} | vs baseline | x computed{label} | vs baseline |",
                "|---|---|---|---|---|",
            ]
            for name, per_rank in size["peak_bytes"].items():
                peak = size_ratios.get(size["n"], {}).get(name)
                if peak is None and size["n"] == n:
                    peak = against["n"].get(name, {}).get("peak")
                cells = []
                for mode in X_MODES:
                    cells.append(_fmt_bytes(max(per_rank[v][mode])))
                    cells.append(_fmt_ratio(peak[v][mode] if peak else None))
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += _chunk_table(size, size_ratios.get(size["n"], {}))
    lines += [
        "",
        f"Bytes each rank sends, N={n} (native HLO; ring algorithms assumed for the baselines' "
        "all-gather and reduce-scatter):",
        "",
        "| program | per step | in total | vs baseline |",
        "|---|---|---|---|",
    ]
    for r in result["programs"]:
        rr = against["n"].get(r["name"], {})
        steps = ", ".join(_fmt_bytes(b) for b in r["bytes"]["per_step"])
        lines.append(
            f"| {r['name']} | {steps} | {_fmt_bytes(r['bytes']['total'])} | "
            f"{_fmt_ratio(rr.get('bytes'))} |"
        )
    if result.get("reduce_dtype_bytes"):
        lines += [
            "",
            f"Bytes each rank sends in matmul-reduce-scatter on bfloat16 x and w, N={n}, by "
            "reduce_dtype (native HLO; expected: N-1 partial-sum blocks of "
            "xla_permute.reference.accumulation_dtype; model: the cost model's charge):",
            "",
            "| program | reduce_dtype | partial sums | sent | expected | model |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["reduce_dtype_bytes"]:
            lines.append(
                f"| {r['name']} | {r['reduce_dtype']} | {r['partial_sum_dtype']} | "
                f"{_fmt_bytes(r['sent'])} | {_fmt_bytes(r['expected'])} | "
                f"{_fmt_bytes(r['model'])} |"
            )
    lines += ["", "Order of the permutes in the native HLO:", ""]
    for r in result["programs"]:
        for v, label in (("token", "with the token"), ("no_token", f"{TOKEN_ENV}=1")):
            c = r["chain"][v]
            if not c["permutes"]:
                continue
            text = (
                f"- {r['name']}, {label}: {c['chained']} of {c['permutes'] - 1} consecutive "
                "permutes depend on the previous one"
            )
            if c["same_step"]:
                text += (
                    f"; {c['same_step_chained']} of {c['same_step']} two-direction steps serialised"
                )
            lines.append(text)
    lines += ["", "Checks:", ""]
    for c in result["checks"]:
        lines.append(f"- [{'ok' if c['ok'] else 'FAILED'}] {c['check']} ({c['detail']})")
    lines += ["", f"Total {result['seconds']:.0f} s."]
    return "\n".join(lines)
