"""``python -m xla_permute bench`` on tiny sizes: one smoke run at N=4 (three mesh launches),
the N=8 parts of the command line's default run (trace and compile; the memory of the
programs the checks judge), and its parts without a mesh. No timing is asserted; memory and
bytes are deterministic and are."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math

import pytest

from xla_permute import RankError, run_on_mesh
from xla_permute.debug import ENV as DEBUG_ENV
from xla_permute_tools import bench
from xla_permute_tools.__main__ import main
from xla_permute_tools.bench import PRESETS, PROGRAMS, BenchConfig, BenchProgram
from xla_permute_tools.bench.measure import bench_rank, memory_rank, read_memory_report
from xla_permute_tools.bench.programs import MEMORY_PROGRAMS
from xla_permute_tools.bench.run import NO_GUARD, account, memory_flags

TINY = PRESETS["tiny"]
SMOKE = BenchConfig(**{**vars(TINY), "scaling_n": 0})  # N=8 below, on the programs judged
F32 = 4


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["bench", "--preset", "tiny", "--scaling-n", "0", "--json", str(path)])
    return code, json.loads(path.read_text()), out.getvalue(), err.getvalue()


def rows_by_name(result, key="programs"):
    return {r["name"]: r for r in result[key]}


def test_smoke_runs_the_whole_pipeline(smoke):
    code, result, out, err = smoke
    assert code == 0, out
    assert result["config"] == vars_of(SMOKE)
    rows = rows_by_name(result)
    assert sorted(rows) == sorted(p.name for p in PROGRAMS)
    for r in rows.values():
        assert r["trace_s"] > 0 and r["compile_s"] > 0 and r["run_s"] > 0
        assert r["fusions"] >= 1
    assert result["scaling"] == [] and [size["n"] for size in result["memory"]] == [4]
    # bytes per reduce_dtype (3 programs x 2), bytes and emulated results of the 4 rings,
    # the memory floor at N=4 (3)
    assert all(c["ok"] for c in result["checks"]) and len(result["checks"]) == 6 + 8 + 3
    # Every figure names its backend, in the JSON and in the printed tables.
    assert result["backends"]["run_s"].startswith("emulated")
    for key in ("trace_s", "compile_s", "peak_bytes", "bytes"):
        assert result["backends"][key].startswith("native")
    assert "run ms (emulated)" in out and "compile ms (native)" in out
    assert "Targets" not in out  # the project's goals are not the tool's business
    assert "[bench]" in err and "4-device CPU mesh" in err  # progress goes to stderr


def vars_of(config: BenchConfig) -> dict[str, int]:
    return {k: getattr(config, k) for k in BenchConfig.__dataclass_fields__}


def test_all_gather_matmul_sends_what_the_baseline_sends(smoke):
    _, result, _, _ = smoke
    rows, n, (m, k) = rows_by_name(result), TINY.n, (TINY.m, TINY.k)
    block = m * k * F32  # one x shard
    base = rows["all_gather_matmul/baseline"]["bytes"]
    assert base["gathered_bytes"] == n * block
    assert base["total"] == (n - 1) * block  # (N-1)/N of the gathered operand
    uni = rows["all_gather_matmul/uni"]["bytes"]
    bi = rows["all_gather_matmul/bi"]["bytes"]
    assert uni["total"] == bi["total"] == base["total"]
    assert uni["per_step"] == [block] * (n - 1) + [0]  # one block per step, none at the last
    assert bi["per_step"] == [2 * block, block, 0]  # both ways, then the last one way (N=4)
    assert [kind for kind, _ in uni["per_collective"]] == ["collective-permute"] * (n - 1)


def test_matmul_reduce_scatter_sends_what_the_baseline_sends(smoke):
    _, result, _, _ = smoke
    rows, n = rows_by_name(result), TINY.n
    partial = TINY.m * TINY.f * F32  # one float32 partial-sum block
    for method in ("uni", "bi", "baseline"):
        assert rows[f"matmul_reduce_scatter/{method}"]["bytes"]["total"] == (n - 1) * partial


def test_memory_comes_from_the_right_compiled_program(smoke):
    _, result, _, _ = smoke
    rows, n, (m, k, f) = rows_by_name(result), TINY.n, (TINY.m, TINY.k, TINY.f)
    gathered, w = n * m * k * F32, k * f * F32
    for variant in ("token", "no_token"):
        base = rows["all_gather_matmul/baseline"]["peak_bytes"][variant]
        for mode in ("input", "computed"):
            assert base[mode] >= gathered + w  # the baseline holds the gathered x
            for method in ("uni", "bi"):
                # the ring never holds the gathered x: below the baseline
                peak = rows[f"all_gather_matmul/{method}"]["peak_bytes"][variant][mode]
                assert peak < base[mode]
        uni = rows["all_gather_matmul/uni"]["peak_bytes"][variant]
        assert uni["input"] >= m * k * F32 + w  # x and w are resident inputs
        ratio = result["ratios"]["n"]["all_gather_matmul/uni"]["peak"][variant]["input"]
        assert ratio == pytest.approx(uni["input"] / base["input"])
    for r in rows.values():  # every rank compiled its own program; the largest is reported
        for variant, modes in r["peak_bytes_per_rank"].items():
            for mode, per_rank in modes.items():
                assert len(per_rank) == n and r["peak_bytes"][variant][mode] == max(per_rank)


def test_memory_is_measured_per_rank(smoke):
    _, result, _, _ = smoke
    m, k, w = TINY.m, TINY.k, TINY.k * TINY.f * F32
    at = {r["n"]: r for r in result["ratios"]["memory"]}
    for size in result["memory"]:
        n, peaks = size["n"], size["peak_bytes"]
        assert sorted(peaks) == sorted(p.name for p in PROGRAMS + MEMORY_PROGRAMS)
        for variant in ("token", "no_token"):
            base = peaks["all_gather_matmul/baseline"][variant]
            for mode in ("input", "computed"):
                assert len(base[mode]) == n and max(base[mode]) >= n * m * k * F32 + w
                for method in ("uni", "bi"):
                    name = f"all_gather_matmul/{method}"
                    ratio = at[n]["peak"][name][variant][mode]
                    assert ratio == max(peaks[name][variant][mode]) / max(base[mode]) < 1
    # the N=4 figures are the main table's
    rows = rows_by_name(result)
    for name, per_rank in result["memory"][0]["peak_bytes"].items():
        if name in rows:  # the memory-only programs have no row
            assert per_rank == rows[name]["peak_bytes_per_rank"]


def test_rings_at_their_memory_floor(smoke):
    """Matmul-reduce-scatter at most the baseline's peak (token on, x an input), the chunked
    all-gather-matmul ring below the unchunked, with c (N-1) permutes (N=4; N=8 below)."""
    _, result, _, _ = smoke
    checks = {c["check"]: c for c in result["checks"]}
    at = {r["n"]: r["peak"] for r in result["ratios"]["memory"]}
    for size in result["memory"]:
        n, peaks, permutes = size["n"], size["peak_bytes"], size["permutes"]
        for name in ("matmul_reduce_scatter/uni", "matmul_reduce_scatter/bi"):
            ratio = at[n][name]["token"]["input"]
            base = peaks[name.split("/")[0] + "/baseline"]["token"]["input"]
            assert ratio == max(peaks[name]["token"]["input"]) / max(base) <= 1.0
            assert checks[
                f"{name} at N={n}: peak memory <= 1.0x the baseline's (token on, x an input)"
            ]["ok"]
        ring = "all_gather_matmul/uni"
        want = [n - 1, 2 * (n - 1), 4 * (n - 1)]
        assert [permutes[ring + c] for c in ("", "/c2", "/c4")] == want
        assert at[n][ring + "/c4"]["token"]["input"] < at[n][ring]["token"]["input"]
        assert permutes["all_gather_matmul/baseline"] == 0


N8_PROGRAMS = [
    *(BenchProgram("matmul_reduce_scatter", m) for m in ("uni", "bi", "baseline")),
    *(BenchProgram("all_gather_matmul", "uni", chunks=c) for c in (1, 4)),
    BenchProgram("all_gather_matmul", "baseline"),
]


def test_rings_at_their_memory_floor_on_8_devices(tmp_path):
    """What the bench's default run checks at N=8, on the programs those checks judge: the
    same compile (memory_rank, token on), the same figure (largest rank over largest rank),
    for x a program input (what they judge)."""
    per_rank = run_on_mesh(
        memory_rank,
        N8_PROGRAMS,
        vars_of(TINY),
        str(tmp_path),
        ("input",),
        n=8,
        env={"XLA_FLAGS": memory_flags(str(tmp_path)), DEBUG_ENV: "none", **NO_GUARD},
    )
    assert all(key.endswith("|input") for key in per_rank[0]["memory"])
    memory = [r["memory"] for r in per_rank]
    peak = {p.name: max(m[f"{p.name}|input"]["bytes"] for m in memory) for p in N8_PROGRAMS}
    permutes = {p.name: memory[0][f"{p.name}|input"]["permutes"] for p in N8_PROGRAMS}
    for method in ("uni", "bi"):
        name = f"matmul_reduce_scatter/{method}"
        assert peak[name] <= peak["matmul_reduce_scatter/baseline"], (name, peak)
    ring = "all_gather_matmul/uni"
    assert [permutes[ring], permutes[ring + "/c4"]] == [7, 28]
    assert peak[ring + "/c4"] < peak[ring] < peak["all_gather_matmul/baseline"]


def test_memory_rank_refuses_an_unknown_x_mode(tmp_path):
    with pytest.raises(RankError, match=r"modes: \['output'\] are not x modes"):
        run_on_mesh(
            memory_rank,
            N8_PROGRAMS,
            vars_of(TINY),
            str(tmp_path),
            ("output",),
            n=2,
            env={"XLA_FLAGS": memory_flags(str(tmp_path)), DEBUG_ENV: "none", **NO_GUARD},
        )


def test_memory_does_not_depend_on_llvm_optimisation(tmp_path, monkeypatch):
    """The memory launches turn LLVM's optimizer off (memory_flags): the peaks are those of
    XLA's default level, rank by rank."""
    programs = [
        BenchProgram("matmul_reduce_scatter", "uni"),
        BenchProgram("all_gather_matmul", "bi"),
        BenchProgram("all_gather_matmul", "uni", chunks=2),
    ]
    peaks = []
    for level in ("", "--xla_backend_optimization_level=3"):  # 3: XLA's default
        monkeypatch.setenv("XLA_FLAGS", level)
        dump = tmp_path / f"level{len(peaks)}"
        dump.mkdir()
        flags = memory_flags(str(dump)) if level == "" else f"{level} --xla_dump_to={dump}"
        out = run_on_mesh(
            memory_rank,
            programs,
            vars_of(TINY),
            str(dump),
            n=2,
            env={"XLA_FLAGS": flags, DEBUG_ENV: "none", **NO_GUARD},
        )
        peaks.append([{k: v["bytes"] for k, v in r["memory"].items()} for r in out])
    assert peaks[0] == peaks[1] and len(peaks[0][0]) == 2 * len(programs)


def test_trace_and_compile_at_a_second_mesh_size():
    """The bench's second mesh size (``scaling_n``, 8 by default): rank 0 traces and compiles
    the native programs; each sends what its baseline sends, N-1 blocks."""
    out = run_on_mesh(
        bench_rank, PROGRAMS, vars_of(TINY), run=False, native=True, n=8, env={DEBUG_ENV: "0"}
    )[0]
    block = {
        "all_gather_matmul": TINY.m * TINY.k * F32,
        "matmul_reduce_scatter": TINY.m * TINY.f * F32,
    }
    for p in PROGRAMS:
        assert min(out["trace_s"][p.name]) > 0 and min(out["compile_s"][p.name]) > 0
        assert account(p, out["hlo"][p.name], 8).total == 7 * block[p.op], p.name


def test_partial_sum_bytes_follow_reduce_dtype(smoke):
    # bfloat16 inputs: float32 partial sums by default, half of that with reduce_dtype=bf16;
    # the traced HLO, accumulation_dtype and the cost model agree (one source of truth).
    _, result, _, _ = smoke
    got = {(r["name"], r["reduce_dtype"]): r for r in result["reduce_dtype_bytes"]}
    block = TINY.m * TINY.f
    for method in ("uni", "bi", "baseline"):
        name = f"matmul_reduce_scatter/{method}"
        default, half = got[name, "default"], got[name, "bfloat16"]
        assert default["partial_sum_dtype"] == "float32" and half["partial_sum_dtype"] == "bfloat16"
        assert default["sent"] == default["model"] == (TINY.n - 1) * block * 4
        assert half["sent"] == half["model"] == (TINY.n - 1) * block * 2


def test_the_token_serialises_the_two_directions_of_a_bidirectional_step(smoke):
    _, result, _, _ = smoke
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        token, no_token = rows_by_name(result)[f"{op}/bi"]["chain"].values()
        assert token["permutes"] == no_token["permutes"] == TINY.n - 1
        assert token["same_step"] == no_token["same_step"] == 1
        # torch_xla's numeric token orders every permute after the previous one ...
        assert token["same_step_chained"] == 1 and token["chained"] == token["permutes"] - 1
        # ... and without it the two directions of a step are independent
        assert no_token["same_step_chained"] == 0
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        uni = rows_by_name(result)[f"{op}/uni"]["chain"]["no_token"]
        assert uni["chained"] == uni["permutes"] - 1  # a one-way ring is a chain through its data


def test_emulated_results_equal_the_baseline(smoke):
    _, result, _, _ = smoke
    for r in result["programs"]:
        assert r["same_as_baseline"] is (None if r["method"] == "baseline" else True)


# ---------------------------------------------------------------- without a mesh


def test_config_options_override_the_preset():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "-k", "64", "--scaling-n", "0"])
    assert bench.config_from_args(args) == BenchConfig(
        m=16, k=64, f=16, scaling_n=0, repeats=1, warmup=1, compile_repeats=1
    )
    assert bench.config_from_args(parser.parse_args([])) == PRESETS["default"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"m": 0}, "m must be an int >= 1, got 0"),
        ({"k": 2.5}, "k must be an int >= 1, got 2.5"),
        ({"n": 1}, "at least 2 devices"),
        ({"scaling_n": 1}, "scaling_n=0 skips"),
        ({"warmup": -1}, "warmup must be an int >= 0"),
    ],
)
def test_bad_config_is_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        BenchConfig(**kwargs)


def test_bad_option_exits_2_before_any_launch(capsys):
    assert main(["bench", "-n", "1"]) == 2
    assert "at least 2 devices" in capsys.readouterr().err


def test_memory_report_parsing(tmp_path):
    good = tmp_path / "a-memory-usage-report.txt"
    good.write_text("Total bytes used: 109051916 (104.00MiB)\n\nAllocations sorted by size:\n")
    assert read_memory_report(good) == 104 * 2**20 + 12
    bad = tmp_path / "b-memory-usage-report.txt"
    bad.write_text("Allocations sorted by size:\n")
    with pytest.raises(ValueError, match="expected 'Total bytes used:'"):
        read_memory_report(bad)


def test_programs_know_their_schedule_and_baseline():
    uni, bi = BenchProgram("matmul_reduce_scatter", "uni"), BenchProgram("all_gather_matmul", "bi")
    assert [s.sends for s in uni.schedule(4)] == [(1,), (1,), (1,), ()]
    assert [s.sends for s in bi.schedule(4)] == [(1, -1), (1,), ()]
    assert (
        uni.baseline.schedule(4) is None and uni.baseline.function == "matmul_then_reduce_scatter"
    )
    with pytest.raises(ValueError, match="method must be one of"):
        BenchProgram("all_gather_matmul", "ring")
    with pytest.raises(ValueError, match="chunks=2 is an option of the all_gather_matmul"):
        BenchProgram("matmul_reduce_scatter", "uni", chunks=2)
    backward = BenchProgram("all_gather_matmul", "uni", backward=True)
    assert backward.name == "all_gather_matmul.backward/uni"
    assert backward.baseline == BenchProgram("all_gather_matmul", "baseline", backward=True)


def test_report_labels_ratios(smoke):
    _, result, _, _ = smoke
    text = bench.format_report(result)
    # per op: time (trace+compile, run), memory at N=4 (four columns), bytes
    assert text.count("1 (baseline)") == 2 * (2 + 4 + 1)
    assert "| all_gather_matmul/uni/c4 | 4 | 12 |" in text  # chunks, permutes at N=4
    assert "Peak memory per device, N=4" in text and "Trace and compile at" not in text
    assert "| matmul_reduce_scatter/uni | bfloat16 | bfloat16 |" in text
    assert "x computed, no token" in text and "two-direction steps serialised" in text
    assert "targets" not in result
    for name, r in result["ratios"]["n"].items():
        assert math.isfinite(r["trace_plus_compile"]) and math.isfinite(r["run"])
        assert f"| {name} |" in text
