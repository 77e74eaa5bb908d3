"""The TPU compiler's collective-matmul recipe as data, and the XLA dumps that show its effect.

:func:`tpu_collective_matmul_setup` returns the environment variables and collective keyword
arguments of the recipe (see the caveats ``tpu-collective-matmul-flag`` and
``tpu-libtpu-overlap-flags``); :func:`read_dump` reads an XLA dump directory and says, per
compiled module, whether the all-gathers feeding matmuls were rewritten into permutes;
:func:`warn_recipe_incomplete` is the warning of the layers' ``strategy="xla"`` on a TPU whose
environment lacks the recipe.
"""

from __future__ import annotations

import glob
import os
import re
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xla_permute as xp
from xla_permute.hardware import HardwareWarning
from xla_permute.pairs import check_int

__all__ = [
    "DumpReport",
    "TpuCollectiveMatmulSetup",
    "read_dump",
    "recipe_problems",
    "tpu_collective_matmul_setup",
    "warn_recipe_incomplete",
]


_ENABLE_CM = "ENABLE_COLLECTIVE_MATMUL_IN_MP"
_OVERLAP_FLAGS = (
    "--xla_enable_async_collective_permute=true",
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
)


def _merge_flags(existing: str, new: Iterable[str]) -> str:
    """Append ``--name=value`` flags to a flag string, keeping flags already set there."""
    tokens = existing.split()
    names = {t.lstrip("-").split("=")[0] for t in tokens}
    tokens += [f for f in new if f.lstrip("-").split("=")[0] not in names]
    return " ".join(tokens)


def _compiled_in_this_process() -> bool:
    if "torch_xla" not in sys.modules:
        return False
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return bool(data and data[0])


@dataclass(frozen=True)
class TpuCollectiveMatmulSetup:
    """The TPU compiler's collective-matmul recipe, as data.

    ``env``: environment variables to set before torch_xla compiles anything
    (``LIBTPU_INIT_ARGS`` and ``XLA_FLAGS`` are merged into existing values by :meth:`apply`);
    ``collective_kwargs``: the keyword arguments every ``xm.all_gather`` /
    ``xm.reduce_scatter`` next to a matmul needs, completed per call by :meth:`kwargs`;
    ``dump_dir``: where XLA writes the HLO dumps that :func:`read_dump` reads. Made by
    :func:`tpu_collective_matmul_setup`.
    """

    env: dict[str, str]
    collective_kwargs: dict[str, Any]
    dump_dir: str | None = None

    def kwargs(self, channel_id: int, groups: list[list[int]]) -> dict[str, Any]:
        """Keyword arguments for one collective: these plus its channel id and groups.

        >>> tpu_collective_matmul_setup().kwargs(3, [[0, 1]])
        {'pin_layout': False, 'use_global_device_ids': True, 'channel_id': 3, 'groups': [[0, 1]]}
        """
        fix = (
            "the same on every rank and distinct per collective in a program "
            "(xla_permute.backends.channels.next_channel_id())"
        )
        check_int(channel_id, "channel_id", 1, fix=fix)
        return {**self.collective_kwargs, "channel_id": channel_id, "groups": groups}

    def problems(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Why this recipe would not take effect in ``environ`` (default: this process).

        Checks the device type, the variables and whether this process already compiled.
        """
        environ = os.environ if environ is None else environ
        out = []
        device = (environ.get("PJRT_DEVICE") or "").split("_")[0].upper() or "unset"
        if device != "TPU":
            out.append(
                f"PJRT_DEVICE is {device}, not TPU: {_ENABLE_CM} passes TPU-only compile "
                f"options, and other backends fail every compile with 'No such compile option'"
            )
        for key, value in self.env.items():
            have = environ.get(key, "")
            if key in ("LIBTPU_INIT_ARGS", "XLA_FLAGS"):
                missing = [f for f in value.split() if f not in have.split()]
                if missing:
                    out.append(f"{key} lacks {' '.join(missing)}")
            elif have != value:
                out.append(f"{key} is {have or 'unset'}, needs {value}")
        if _compiled_in_this_process():
            out.append(
                f"this process has compiled already: torch_xla read {_ENABLE_CM} at its first "
                f"compile, so set it before that (in the launcher's environment)"
            )
        return out

    def apply(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Set the variables in ``environ`` (default: ``os.environ``), merging flag strings.

        Raises RuntimeError when this process has already compiled an XLA program (the flag
        would be ignored) and ``environ`` is this process's environment.
        """
        target = os.environ if environ is None else environ
        if target is os.environ and _compiled_in_this_process():
            raise RuntimeError(
                f"torch_xla has compiled in this process already and read {_ENABLE_CM} then; "
                f"set the variables before the first compile, e.g. in the environment of the "
                f"process that launches training"
            )
        for key, value in self.env.items():
            if key in ("LIBTPU_INIT_ARGS", "XLA_FLAGS"):
                target[key] = _merge_flags(target.get(key, ""), value.split())
            else:
                target[key] = value


def tpu_collective_matmul_setup(
    *,
    overlap: bool = True,
    dump_dir: str | Path | None = None,
    windowed_einsum_threshold_mib: int | None = None,
) -> TpuCollectiveMatmulSetup:
    """The environment and collective arguments for the TPU compiler's collective matmul.

    Args:
        overlap: add the async collective-permute and continuation-fusion flags to
            ``LIBTPU_INIT_ARGS`` (see the caveat ``tpu-libtpu-overlap-flags``).
        dump_dir: also set ``XLA_FLAGS=--xla_dump_to=<dir> --xla_dump_hlo_as_text``, so that
            :func:`read_dump` can show whether the rewrite happened.
        windowed_einsum_threshold_mib: add ``--xla_jf_spmd_threshold_for_windowed_einsum_mib``
            (0: always; its effect on the ``ENABLE_COLLECTIVE_MATMUL_IN_MP`` path is not
            documented).

    Raises:
        TypeError: ``overlap`` is not a bool, the threshold not an int, ``dump_dir`` not a path.
        ValueError: a negative threshold, a blank ``dump_dir`` or one with whitespace.

    >>> setup = tpu_collective_matmul_setup(overlap=False)
    >>> setup.env, setup.collective_kwargs
    ({'ENABLE_COLLECTIVE_MATMUL_IN_MP': '1'}, {'pin_layout': False, 'use_global_device_ids': True})
    """
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    threshold = _threshold(windowed_einsum_threshold_mib)
    directory = None if dump_dir is None else _directory(dump_dir, "dump_dir")
    env = {_ENABLE_CM: "1"}
    flags = list(_OVERLAP_FLAGS) if overlap else []
    if threshold is not None:
        flags.append(f"--xla_jf_spmd_threshold_for_windowed_einsum_mib={threshold}")
    if flags:
        env["LIBTPU_INIT_ARGS"] = " ".join(flags)
    if directory is not None:
        env["XLA_FLAGS"] = f"--xla_dump_to={directory} --xla_dump_hlo_as_text"
    return TpuCollectiveMatmulSetup(
        env=env,
        collective_kwargs={"pin_layout": False, "use_global_device_ids": True},
        dump_dir=directory,
    )


_WARNED: list[bool] = []  # the recipe warning was given (once per process)
_WARNED_LOCK = threading.Lock()


def recipe_problems(device_type: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Why the layers' ``strategy="xla"`` would not get the TPU compiler's collective matmul:
    the recipe's variables missing from ``environ`` (default: this process) on a TPU; none on
    other devices (``"xla"`` is the baseline there)."""
    if device_type != "TPU":
        return []
    env = {**(os.environ if environ is None else environ), "PJRT_DEVICE": "TPU"}
    # Compiling already is expected by the first forward; only the variables matter here.
    problems = tpu_collective_matmul_setup().problems(env)
    return [p for p in problems if not p.startswith("this process has compiled")]


def warn_recipe_incomplete(device_type: str, environ: Mapping[str, str] | None = None) -> None:
    """Warn once per process (:class:`~xla_permute.hardware.HardwareWarning`) when the
    ``"xla"`` strategy's environment recipe is incomplete
    (:func:`~xla_permute_tools.tpu.recipe_problems`)."""
    problems = recipe_problems(device_type, environ)
    with _WARNED_LOCK:
        if not problems or _WARNED:
            return
        _WARNED.append(True)
    warnings.warn(
        "strategy='xla' issues the collectives in the TPU compiler's collective-matmul form, "
        f"but the rewrite will not fire here: {'; '.join(problems)}. Set "
        "xla_permute_tools.tpu.tpu_collective_matmul_setup().env in the environment that launches "
        "training (before torch_xla's first compile); until then 'xla' runs the baseline",
        HardwareWarning,
        stacklevel=4,
    )


def _threshold(value: object) -> int | None:
    if value is None:
        return None
    return check_int(value, "windowed_einsum_threshold_mib", 0)


def _directory(value: object, name: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be a directory path (str or pathlib.Path), got {value!r} of type "
            f"{type(value).__name__}"
        )
    path = os.fspath(value)
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{name} must be a non-empty directory path (str), got {value!r}")
    if any(c.isspace() for c in path):  # XLA_FLAGS is split at whitespace
        raise ValueError(
            f"{name} {path!r} contains whitespace, which XLA_FLAGS cannot hold; use a path "
            f"without spaces"
        )
    return path


@dataclass(frozen=True)
class DumpReport:
    """One compiled module of an XLA dump: op counts before and after optimization.

    ``rewritten`` is True when the optimizer replaced the all-gathers (or reduce-scatters)
    that fed matmuls by collective-permutes: the sign of the TPU collective-matmul rewrite.
    ``decomposed`` lists instruction names containing "decomposed" (the rewrite's loops, per
    the pytorch/xla PR 8855 discussion).
    """

    module: str
    before: Counter[str]
    after: Counter[str]
    decomposed: tuple[str, ...]

    @property
    def rewritten(self) -> bool:
        gathers = ("all-gather", "reduce-scatter")
        had = sum(self.before[k] for k in gathers)
        left = sum(self.after[k] for k in gathers)
        return had > 0 and left < had and self.after["collective-permute"] > 0


_COUNTED = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "dot", "while")


def _counts(text: str) -> Counter[str]:
    ops = Counter(i.opcode.removesuffix("-start") for i in xp.hlo.parse(text).instructions.values())
    return Counter({k: ops[k] for k in _COUNTED})


def read_dump(dump_dir: str | Path) -> list[DumpReport]:
    """Read an XLA dump directory (``--xla_dump_to`` with ``--xla_dump_hlo_as_text``).

    Pairs each module's ``*before_optimizations.txt`` with its ``*after_optimizations.txt``
    (XLA:CPU writes ``cpu_after_optimizations.txt``) and counts collectives, dots and loops.

    Raises:
        TypeError: ``dump_dir`` is not a path.
        FileNotFoundError: it is not a directory.
    """
    if not isinstance(dump_dir, (str, os.PathLike)):
        raise TypeError(
            f"dump_dir must be a directory path (str or pathlib.Path), got {dump_dir!r} of type "
            f"{type(dump_dir).__name__}"
        )
    root = Path(dump_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"dump_dir {os.fspath(dump_dir)!r} is not a directory: XLA writes it when a program "
            f"compiles with XLA_FLAGS=--xla_dump_to=<dir> set before the process starts"
        )
    reports = []
    for before in sorted(root.glob("*before_optimizations.txt")):
        stem = before.name.removesuffix("before_optimizations.txt")
        afters = sorted(root.glob(f"{glob.escape(stem)}*after_optimizations.txt"))
        if not afters:
            continue
        after_text = afters[0].read_text()
        decomposed = tuple(sorted(set(re.findall(r"%?([\w.\-]*decomposed[\w.\-]*)", after_text))))
        reports.append(
            DumpReport(
                module=stem.rstrip("."),
                before=_counts(before.read_text()),
                after=_counts(after_text),
                decomposed=decomposed,
            )
        )
    return reports
