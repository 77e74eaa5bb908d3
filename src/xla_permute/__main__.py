"""Command line: ``python -m xla_permute demo | doctor | bench``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from xla_permute.demo import format_table, run_checks

    print(f"xla-permute demo: checks on a {args.n}-device CPU mesh (PJRT_DEVICE=CPU)")
    rows = run_checks(n=args.n)
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks ok")
    return 1 if failed else 0


def _doctor(args: argparse.Namespace) -> int:
    from xla_permute.doctor import main as doctor

    return doctor(n=args.n, device_type=args.device_type, self_test=not args.no_self_test)


def _bench(args: argparse.Namespace) -> int:
    from xla_permute.bench import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m xla_permute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the verification table on a CPU mesh")
    demo.add_argument("-n", type=int, default=4, help="number of CPU devices (default 4)")
    demo.set_defaults(func=_demo)
    doctor = sub.add_parser(
        "doctor", help="print the environment, the caveats that apply, and a CPU-mesh self-test"
    )
    doctor.add_argument("-n", type=int, default=4, help="CPU devices of the self-test mesh")
    doctor.add_argument(
        "--device-type", help="show the caveats of this device type (default: detected)"
    )
    doctor.add_argument("--no-self-test", action="store_true", help="skip the mesh self-test")
    doctor.set_defaults(func=_doctor)
    from xla_permute.bench import add_arguments as add_bench_arguments

    bench = sub.add_parser(
        "bench", help="time, memory and bytes of collective matmul vs its baselines (CPU mesh)"
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
