"""Run a function on an N-device PyTorch/XLA CPU mesh and collect the per-rank results.

The CPU mesh is what makes collectives testable without an accelerator:
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` gives N XLA devices in one process, one thread per
device. Two settings must be right before torch_xla starts, which is why the mesh always runs
in a child process of its own (``python -m xla_permute.cpu_mesh.device``, or what
``XLA_PERMUTE_LAUNCHER`` names: :data:`LAUNCHER_ENV`), started with the right environment:

* ``XLA_THREAD_POOL_SIZE`` must be at least N, or the device threads starve each other at the
  first collective rendezvous and the process aborts;
* the calling process must not have started the XLA runtime itself.

The ranks are threads of one process: the global torch RNG and module-level state are shared
between them, so a rank function should build its data from its rank or from a per-rank
``torch.Generator``.

>>> import xla_permute as xp
>>> def world_and_rank():
...     import torch_xla.runtime as xr
...     return xr.world_size(), xr.global_ordinal()
>>> xp.run_on_mesh(world_and_rank, n=2)
[(2, 0), (2, 1)]
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import cloudpickle

from xla_permute.backends.xla import need_torch_xla
from xla_permute.cpu_mesh import rank_output
from xla_permute.cpu_mesh import status as mesh_status
from xla_permute.cpu_mesh.barrier import BARRIER_ENV, WAIT_S
from xla_permute.debug import ENV as DEBUG_ENV
from xla_permute.pairs import check_int, see

__all__ = ["LAUNCHER_ENV", "MeshError", "RankError", "mesh_environment", "run_on_mesh"]

#: Names the function that starts the device process, ``"module:function"``, called as
#: ``function(command, env)`` instead of ``Popen(command, env=env, stdout=PIPE, stderr=PIPE,
#: text=True, start_new_session=True)`` and returning what Popen would. Unset or empty (the
#: default): Popen. Read from the launch's environment (``env={LAUNCHER_ENV: ""}``: Popen).
LAUNCHER_ENV = "XLA_PERMUTE_LAUNCHER"

#: Seconds after which a mesh run counts as hung (a collective that never completes).
DEFAULT_TIMEOUT = 300.0

_MISMATCH_HINT = (
    "XLA:CPU aborts a collective whose ranks arrive more than 15 s apart. Other causes, when "
    "the diagnosis names none: the ranks issuing mismatched collectives (torch_xla's own, with "
    "other shapes, groups or channel ids; this package's are checked, XLA_PERMUTE_DEBUG=1 "
    "checks every call); a rank compiling its program much later than another (caveat "
    "compile-skew-rendezvous); XLA_THREAD_POOL_SIZE below the device count; a bare "
    "xm.wait_device_ops(), which waits for every device: use "
    "xm.wait_device_ops(xm.xla_real_devices([torch_xla.device()])); "
    "XLA_ENABLE_PARAM_ALIASING=1 in a training loop (caveat param-aliasing-deadlock): leave "
    "it unset or set XLA_ENABLE_PARAM_ALIASING=0."
)


class MeshError(RuntimeError):
    """The mesh run failed as a whole: the device process died, hung or could not start."""


class RankError(MeshError):
    """A rank function raised; ``rank`` names the rank and ``__cause__`` is the original error."""

    def __init__(self, rank: int, message: str, original: BaseException | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.original = original


def _check_env(n: int, env: object) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise TypeError(f"env must be a dict of environment variables, got {type(env).__name__}")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"env[{key!r}] = {value!r}: environment names and values must be str, e.g. "
                f"env={{{str(key)!r}: {str(value)!r}}}"
            )
    for key, wanted in {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(n)}.items():
        if env.get(key, wanted) != wanted:
            raise ValueError(
                f"env sets {key}={env[key]!r}, but the mesh needs {key}={wanted!r}; "
                f"choose the device count with n= and leave {key} out of env"
            )
    pool = env.get("XLA_THREAD_POOL_SIZE")
    if pool is not None and (not pool.strip().isdigit() or int(pool) < n):
        raise ValueError(
            f"env sets XLA_THREAD_POOL_SIZE={pool!r}, below the {n} devices: the collectives "
            f"would hang and abort; leave it out (the mesh sets it to at least n)"
        )
    return dict(env)


def mesh_environment(n: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the device process for an ``n``-device CPU mesh.

    This process's environment, then the mesh's settings, then ``env``. Unless this process's
    environment or ``env`` sets them, the mesh sets: ``XLA_PERMUTE_DEBUG=1`` (every collective
    of this package first checks that the ranks agree, :mod:`xla_permute.debug`; ``"0"`` turns
    it off, e.g. for timed runs of a correct program); ``XLA_ENABLE_PARAM_ALIASING=0`` (with
    aliasing on, a training loop on a mesh of device threads can deadlock: caveat
    ``param-aliasing-deadlock``; each step's updated tensors then get new buffers); and
    ``--xla_backend_optimization_level=0`` in ``XLA_FLAGS`` (LLVM's optimizer is most of a
    compile on XLA:CPU: caveat ``compile-skew-rendezvous``).

    >>> e = mesh_environment(4)
    >>> e["PJRT_DEVICE"], e["CPU_NUM_DEVICES"], int(e["XLA_THREAD_POOL_SIZE"]) >= 4
    ('CPU', '4', True)
    >>> e["XLA_ENABLE_PARAM_ALIASING"], "--xla_backend_optimization_level=0" in e["XLA_FLAGS"]
    ('0', True)
    >>> off = {"XLA_PERMUTE_DEBUG": "0"}
    >>> mesh_environment(2)["XLA_PERMUTE_DEBUG"], mesh_environment(2, off)["XLA_PERMUTE_DEBUG"]
    ('1', '0')
    """
    check_int(n, "n", 1, fix="the number of devices; n=4 is the default CPU mesh")
    extra = _check_env(n, env)
    out = dict(os.environ)
    out.update(
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(n),
        XLA_THREAD_POOL_SIZE=str(max(n, int(out.get("XLA_THREAD_POOL_SIZE") or 0))),
        TF_CPP_MIN_LOG_LEVEL=out.get("TF_CPP_MIN_LOG_LEVEL", "2"),
    )
    if not out.get(DEBUG_ENV, "").strip():
        out[DEBUG_ENV] = "1"
    if not out.get("XLA_ENABLE_PARAM_ALIASING", "").strip():
        out["XLA_ENABLE_PARAM_ALIASING"] = "0"
    # The child must import what the caller can import (tests/, a notebook's directory).
    paths = [p or os.getcwd() for p in sys.path] + [out.get("PYTHONPATH", "")]
    out["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    out.update(extra)
    flag = "--xla_backend_optimization_level"
    if flag not in out.get("XLA_FLAGS", ""):
        out["XLA_FLAGS"] = f"{out.get('XLA_FLAGS', '')} {flag}=0".strip()
    return out


def _check_runtime_not_started() -> None:
    torch_xla = sys.modules.get("torch_xla")  # never import it here: that is the child's job
    if torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized():
        raise MeshError(
            "The XLA runtime is already initialised in this process (a tensor was put on an "
            "XLA device here). The mesh needs a process whose runtime starts with its own "
            "device settings: launch before touching an XLA device, or restart the kernel."
        )


# --------------------------------------------------------------------------- serialisation


class _DeviceTensor(Exception):
    def __init__(self, device: object) -> None:
        super().__init__(str(device))
        self.device = device


class _CallerPickler(cloudpickle.CloudPickler):
    """cloudpickle that refuses tensors on a device (the device process has its own devices)
    and keeps the file name of code sent by value, so a rank's traceback names the script."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            raise _DeviceTensor(obj.device)
        if isinstance(obj, types.CodeType):  # cloudpickle writes "<dynamic-code>" instead
            make, fields = cloudpickle.cloudpickle._code_reduce(obj)
            return make, tuple(obj.co_filename if f == "<dynamic-code>" else f for f in fields)
        return super().reducer_override(obj)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _CallerPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


def _used_names(fn: types.FunctionType) -> dict[str, Any]:
    """The globals and closure variables ``fn``'s code refers to (nested code included)."""
    names: set[str] = set()
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    used = {k: fn.__globals__[k] for k in sorted(names) if k in fn.__globals__}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            used[name] = cell.cell_contents
        except ValueError:  # an empty cell: not yet assigned
            continue
    return used


def _why_not(value: Any) -> str | None:
    """None when ``value`` serialises, else why not."""
    try:
        _dumps(value)
    except _DeviceTensor as e:
        return (
            f"a tensor on device {e.device}, which exists only in this process (the device "
            f"process has its own devices): pass a CPU copy (t.cpu()) as an argument and "
            f"move it inside the function with t.to(torch_xla.device())"
        )
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported with its cause
        return (
            f"it cannot be serialised ({type(e).__name__}: {e}); create it inside the "
            f"function, or pass what it is built from as an argument"
        )
    return None


def _serialise_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """cloudpickle ``(fn, args, kwargs)``; a TypeError names what cannot travel, and the fix."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    try:
        return _dumps((fn, args, kwargs))
    except Exception as error:  # noqa: BLE001 - diagnosed below, then re-raised as TypeError
        cause = error
    name = getattr(fn, "__qualname__", repr(fn))
    used = _used_names(fn) if isinstance(fn, types.FunctionType) else {}
    suspects = [
        *((f"fn {name} uses {k!r} ({type(v).__name__}) from its globals or closure, which", v)
          for k, v in used.items()),
        (f"fn {name}", fn),
        *((f"args[{i}] ({type(v).__name__})", v) for i, v in enumerate(args)),
        *((f"kwargs[{k!r}] ({type(v).__name__})", v) for k, v in kwargs.items()),
    ]  # fmt: skip
    for what, value in suspects:
        why = _why_not(value)
        if why is not None:
            raise TypeError(
                f"{what} cannot be sent to the device process: {why}{see('cannot-send')}"
            ) from cause
    raise TypeError(
        f"the call of {name} cannot be sent to the device process: {cause}{see('cannot-send')}"
    ) from cause


# --------------------------------------------------------------------------- the launch


def run_on_mesh(
    fn: Callable[..., Any],
    *args: Any,
    n: int = 4,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` once on every device of an ``n``-device CPU mesh.

    Each rank runs in its own device thread of a new child process; inside ``fn``,
    ``torch_xla.device()`` is that rank's device and ``torch_xla.runtime.global_ordinal()`` its
    rank. ``fn`` may be any function: one defined in a module goes by reference, one defined
    in a notebook cell, a script's ``__main__``, a closure or a lambda goes by value (with
    ``cloudpickle``), with the globals it uses. Arguments travel the same way; they and the
    function's globals must be CPU data (tensors on the CPU, numbers, lists, ...). Each rank
    unpickles the call itself, so every rank gets its own copy of ``fn``'s by-value globals
    and of the arguments (a module passed in may be moved to the rank's device in place); the
    modules ``fn`` imports, and their globals, are shared by the rank threads as usual.

    The device process guards every rank's ``torch_xla.sync()``
    (:func:`~xla_permute.cpu_mesh.device.guard_syncs`), with the debug mode on
    (:func:`mesh_environment`). What the ranks print appears here as they run, each line
    prefixed by its rank (``[rank 2] ...``; :mod:`xla_permute.cpu_mesh.rank_output`).

    Returns the per-rank return values in rank order. Tensors on an XLA device in them, in
    any container (lists, dicts, named tuples, dataclasses, ...), come back as CPU tensors
    (detached).

    Raises:
        TypeError: ``n``, ``timeout`` or ``env`` has the wrong type; ``fn`` is not callable;
            ``fn``'s globals or closure, or an argument, cannot be sent (the message names
            it, e.g. a tensor on an XLA device of this process).
        ValueError: ``n`` < 1, ``timeout`` <= 0, or ``env`` contradicts the mesh
            (``PJRT_DEVICE``, ``CPU_NUM_DEVICES`` other than ``n``, a thread pool below ``n``).
        MeshError: the XLA runtime is already running here; the device process died
            (a collective rendezvous abort) or ran over ``timeout`` seconds. For an abort the
            message names the collective, the ranks that waited at it, and for each rank that
            did not arrive whether it was in ``torch_xla.sync()`` (compiling) or in Python, and
            the last op of this package it called (:mod:`xla_permute.cpu_mesh.status`).
        RankError: a rank raised; the message names the rank and the original error,
            which is also ``__cause__``.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    environment = mesh_environment(n, env)
    payload = _serialise_call(fn, args, kwargs)
    need_torch_xla("run_on_mesh (the CPU mesh)")  # after the checks of the arguments
    _check_runtime_not_started()
    name = getattr(fn, "__qualname__", None) or repr(fn)
    with tempfile.TemporaryDirectory(prefix="xla_permute_mesh_") as tmp:
        payload_path, result_path = Path(tmp, "payload.pkl"), Path(tmp, "result.pkl")
        payload_path.write_bytes(payload)
        command = [sys.executable, "-m", "xla_permute.cpu_mesh.device"]
        with _start(command + [str(payload_path), str(result_path)], environment) as proc:
            finished, err = rank_output.relay(proc, timeout)
            if not finished:
                os.killpg(proc.pid, signal.SIGKILL)
        if not finished or not result_path.exists():
            how = f"exited with code {proc.returncode}"
            if not finished:
                how = f"did not finish within {timeout:g} s and was killed"
            elif proc.returncode < 0:
                how = f"was killed by {signal.Signals(-proc.returncode).name}"
            how += " before returning results" if finished else ""
            tail = "\n".join(err.strip().splitlines()[-25:]) or "(empty)"
            raise MeshError(
                f"The {n}-device mesh running {name} {how}. {_diagnose(err, tmp, n)}"
                f"{_MISMATCH_HINT}{see('mesh-abort')}\n--- device process stderr (tail) ---\n{tail}"
            ) from None
        status, value = pickle.loads(result_path.read_bytes())
    if status == "ok":
        return value
    if status == "rank-error":
        rank, type_name, message, tb, original = value
        raise RankError(
            rank,
            f"rank {rank} of {n} raised {type_name}: {message}"
            f"{'' if '#error-' in message else see('rank-error')}\n{tb}",
            original,
        ) from original
    raise MeshError(f"The {n}-device mesh could not start {name}:\n{value}")


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start the device process: Popen, or the function :data:`LAUNCHER_ENV` names."""
    name, pipe = env.get(LAUNCHER_ENV, "").strip(), subprocess.PIPE
    if not name:
        return subprocess.Popen(
            command, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
        )
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)(command, env)


_STUCK = re.compile(
    r"\[id=(\d+)\] This thread has been waiting for `(.+?) RendezvousKey\{.*?op_id=(\d+)\}"
)
_TERMINATED = re.compile(
    r"Termination timeout for `(.+?) RendezvousKey\{.*?op_id=(\d+)\}`.*?Expected (\d+) threads"
    r".*?only (\d+) of them arrived"
)


def _diagnose(err: str, directory: str, n: int) -> str:
    """What the abort says and what the ranks were doing: which collective, who waited at it,
    who never came and where that rank was (:mod:`xla_permute.cpu_mesh.status`)."""
    found, status, now = _TERMINATED.search(err), mesh_status.read(directory), time.monotonic()
    if found is None:  # a hang, or a death without XLA's message: where was every rank?
        ranks = "; ".join(f"rank {r} " + _describe(status.get(r), now) for r in range(n))
        return f"Diagnosis: {ranks}. " if status else ""
    kind, channel, expected, arrived = found.groups()
    waiting = sorted({int(i) for i, k, c in _STUCK.findall(err) if (k, c) == (kind, channel)})
    text = (
        f"Diagnosis: XLA:CPU aborted an {kind} (channel id {channel}) that {arrived} of "
        f"{expected} participants reached in time"
    )
    if waiting and int(expected) == n:
        missing = [r for r in range(n) if r not in waiting]
        text += f": {_plural('rank', waiting)} waited for {_plural('rank', missing)}"
        for r in missing:
            text += f". Rank {r} " + _describe(status.get(r), now)
        others = [status[r]["sync_s"] for r in waiting if r in status and status[r]["sync_s"]]
        if others:
            text += f"; the waiting ranks' last syncs took {min(others):.1f}-{max(others):.1f} s"
    compiles = [f"{r}: {status[r]['compile_s']:.1f} s" for r in sorted(status)]
    if any(status[r].get("compile_s") for r in status):
        text += f". Each rank's last compile for the compile barrier took ({'; '.join(compiles)})"
    for r in sorted(status):
        if status[r].get("alone"):
            text += (
                f". Rank {r} ran its step without {_plural('rank', status[r]['alone'])}, "
                f"which had not reached the compile barrier after {WAIT_S:g} s"
            )
    return text + ". "


_STATES = {
    "sync": "was inside torch_xla.sync(), compiling its program",
    "compile": "was compiling its step (before the compile barrier)",
    "barrier": "was waiting at the compile barrier for the other ranks",
    "torch.compile": "was inside torch.compile (its XLA bridge, compiling the graph)",
    "run": "was running Python code",
}


def _describe(line: dict[str, Any] | None, now: float) -> str:
    if line is None:
        return "had not started its rank function"
    op = f" (its last op of this package: {line['last_op']}, call {line['calls']})"
    if not line["last_op"]:
        op = " (it had called no op of this package)"
    since = "since its last sync" if line["state"] == "run" else "by then"
    text = f"{_STATES[line['state']]} for {now - line['since']:.1f} s {since}{op}"
    if line["state"] == "sync":
        text += (
            ": a compile far slower than the other ranks' (a large program on a loaded machine) "
            f"with the compile barrier off ({BARRIER_ENV}=0), or a sync the others did not make"
        )
    return text


def _plural(word: str, ranks: list[int]) -> str:
    return f"{word}{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
