"""``python -m xla_permute bench``: its options, and running it from them.

>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_arguments(parser)
>>> config_from_args(parser.parse_args(["--preset", "tiny", "-n", "2"])).n
2
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from xla_permute_tools.bench.programs import PRESETS, BenchConfig
from xla_permute_tools.bench.report import format_report
from xla_permute_tools.bench.run import print_progress, run_bench

__all__ = ["add_arguments", "config_from_args", "run_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m xla_permute bench`` (each overrides the preset)."""
    d = PRESETS["default"]
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="sizes and repeats to start from ('tiny' is the smoke test)",
    )
    parser.add_argument("-m", type=int, help=f"rows of this rank's x block (default {d.m})")
    parser.add_argument("-k", type=int, help=f"contracted dimension (default {d.k})")
    parser.add_argument("-f", type=int, help=f"columns of w (default {d.f})")
    parser.add_argument("-n", type=int, help=f"CPU devices of the main mesh (default {d.n})")
    parser.add_argument(
        "--scaling-n",
        type=int,
        help=f"CPU devices of the trace+compile mesh; 0 skips it (default {d.scaling_n})",
    )
    parser.add_argument("--repeats", type=int, help=f"timed runs (default {d.repeats})")
    parser.add_argument("--warmup", type=int, help=f"discarded runs/rounds (default {d.warmup})")
    parser.add_argument(
        "--compile-repeats",
        type=int,
        help=f"timed trace+compile rounds (default {d.compile_repeats})",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument(
        "--attention",
        action="store_true",
        help="instead: ring attention vs all-gather K/V, bytes and peak memory at N=4 and 8",
    )
    parser.add_argument(
        "--aliasing",
        action="store_true",
        help="instead: a training step with parameter aliasing off (the mesh's default) and on",
    )
    parser.add_argument(
        "--barrier",
        action="store_true",
        help="instead: a training loop and a tensor-parallel Llama with the mesh's compile "
        "barrier on (the default) and off",
    )
    parser.add_argument(
        "--pipeline", action="store_true",
        help="instead: step time of every pipeline schedule side by side on -n gloo processes",
    )  # fmt: skip
    parser.add_argument(
        "--backend",
        choices=("xla", "c10d"),
        default="xla",
        help="xla: the CPU mesh (default); c10d: real processes on torch.distributed (gloo), "
        "ring vs baseline wall time at --processes",
    )
    parser.add_argument(
        "--processes",
        type=int,
        nargs="+",
        help="with --backend c10d: process counts, one torchrun launch each (default 2 4)",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The preset, with every option that was given replacing its value."""
    overrides = {
        name: getattr(args, name)
        for name in ("m", "k", "f", "n", "scaling_n", "repeats", "warmup", "compile_repeats")
        if getattr(args, name, None) is not None
    }
    return replace(PRESETS[args.preset], **overrides)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark, print the report, write ``--json``; exit 1 if a check failed."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.json and not Path(args.json).resolve().parent.is_dir():
        print(
            f"bench: --json {args.json}: the directory {Path(args.json).parent} does not exist; "
            f"create it first",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "pipeline", False):
        return _run_pipeline(args)
    if getattr(args, "backend", "xla") == "c10d":
        return _run_c10d(args)
    if getattr(args, "aliasing", False):
        from xla_permute_tools.bench.aliasing import format_aliasing_report, run_aliasing_bench

        result = run_aliasing_bench(config.n)
        print(format_aliasing_report(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    if getattr(args, "barrier", False):
        from xla_permute_tools.bench.barrier import format_barrier_report, run_barrier_bench

        result = run_barrier_bench(config.n)
        print(format_barrier_report(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return int(any(p["losses_equal"] is False for p in result["programs"].values()))
    if getattr(args, "attention", False):
        from xla_permute_tools.bench.attention import format_attention_report, run_attention_bench

        result = run_attention_bench()
        print(format_attention_report(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        return 0
    print_progress(f"config {asdict(config)}")
    result = run_bench(config)
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print_progress(f"wrote {args.json}")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


def _run_pipeline(args: argparse.Namespace) -> int:
    """``bench --pipeline``: every schedule on torch.distributed (tools/bench/pipeline.py)."""
    from xla_permute_tools.bench.pipeline import (
        config_with,
        format_pipeline_report,
        run_pipeline_bench,
    )

    try:
        preset = "tiny" if args.preset == "tiny" else "default"
        config = config_with(preset, n=args.n, repeats=args.repeats)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    result = run_pipeline_bench(config)
    print(format_pipeline_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


def _run_c10d(args: argparse.Namespace) -> int:
    """``bench --backend c10d``: the rings on torch.distributed (tools/bench/c10d.py)."""
    from xla_permute_tools.bench.c10d import config_with, format_c10d_report, run_c10d_bench

    processes = tuple(args.processes) if args.processes else None
    try:
        config = config_with(
            "tiny" if args.preset == "tiny" else "default",
            m=args.m,
            k=args.k,
            f=args.f,
            repeats=args.repeats,
            warmup=args.warmup,
            processes=processes,
        )
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    result = run_c10d_bench(config)
    print(format_c10d_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(c["ok"] for c in result["checks"] if "allclose" in c["name"]) else 1
