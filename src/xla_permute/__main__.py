"""Command line: ``python -m xla_permute demo``."""

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m xla_permute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the verification table on a CPU mesh")
    demo.add_argument("-n", type=int, default=4, help="number of CPU devices (default 4)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
