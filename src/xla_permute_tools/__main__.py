"""Command line: ``python -m xla_permute_tools demo | doctor | bench`` (also reached as
``python -m xla_permute ...`` and the ``xla-permute`` script)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from xla_permute_tools import doctor, selftest
from xla_permute_tools.bench import add_arguments as add_bench_arguments
from xla_permute_tools.bench import run_from_args
from xla_permute_tools.catalog import caveats


def _demo(args: argparse.Namespace) -> int:
    print("xla-permute demo")
    return selftest.main(n=args.n)


def _doctor(args: argparse.Namespace) -> int:
    return doctor.main(
        n=args.n,
        device_type=args.device_type,
        self_test=not args.no_self_test,
        details=args.details,
    )


def _bench(args: argparse.Namespace) -> int:
    return run_from_args(args)


def _device_type(value: str) -> str:
    """argparse type of ``--device-type``: a device type the caveats know, else exit 2."""
    try:
        caveats(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _devices(value: str) -> int:
    """argparse type of ``-n``: a positive number of CPU devices, else exit 2."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a number of CPU devices >= 1, got {value!r}")
    return n


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit status 2 (no usage block, no traceback)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m xla_permute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the verification table on a CPU mesh")
    demo.add_argument("-n", type=_devices, default=4, help="number of CPU devices (default 4)")
    demo.set_defaults(func=_demo)
    doctor = sub.add_parser(
        "doctor", help="print the environment, the caveats that apply, and a CPU-mesh self-test"
    )
    doctor.add_argument("-n", type=_devices, default=4, help="CPU devices of the self-test mesh")
    doctor.add_argument(
        "--device-type",
        type=_device_type,
        help="show the caveats of this device type (default: detected)",
    )
    doctor.add_argument("--no-self-test", action="store_true", help="skip the mesh self-test")
    doctor.add_argument(
        "--details", action="store_true", help="each caveat's whole text, not one line"
    )
    doctor.set_defaults(func=_doctor)
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
