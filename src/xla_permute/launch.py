"""Run a function on an N-device PyTorch/XLA CPU mesh and collect the per-rank results.

The CPU mesh is what makes collectives testable without an accelerator:
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` gives N XLA devices in one process, one thread per
device. Two settings must be right before torch_xla starts, which is why the mesh always runs
in a fresh child process that this module starts with the right environment:

* ``XLA_THREAD_POOL_SIZE`` must be at least N, or the device threads starve each other at the
  first collective rendezvous and the process aborts;
* the calling process must not have started the XLA runtime itself.

The ranks are threads of one process: the global torch RNG and module-level state are shared
between them, so a rank function should build its data from its rank or from a per-rank
``torch.Generator``.

>>> from xla_permute.launch import run_on_mesh
>>> from xla_permute.examples import world_and_rank
>>> run_on_mesh(world_and_rank, n=2)
[(2, 0), (2, 1)]
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MeshError", "RankError", "mesh_environment", "run_on_mesh"]

#: Seconds after which a mesh run counts as hung (a collective that never completes).
DEFAULT_TIMEOUT = 300.0

_MISMATCH_HINT = (
    "The likely cause is a collective rendezvous that could not complete: the ranks issued "
    "mismatched collectives (a rank skipped one or issued them in another order, with "
    "different shapes, groups or channel ids), or XLA_THREAD_POOL_SIZE is smaller than the "
    "device count."
)


class MeshError(RuntimeError):
    """The mesh run failed as a whole: the device process died, hung or could not start."""


class RankError(MeshError):
    """A rank function raised; ``rank`` names the rank and ``__cause__`` is the original error."""

    def __init__(self, rank: int, message: str, original: BaseException | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.original = original


_CHILD = "import sys; from xla_permute.launch import _child_main; _child_main(*sys.argv[1:])"


@dataclass(frozen=True)
class _Payload:
    module: str
    qualname: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def mesh_environment(n: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the device process for an ``n``-device CPU mesh.

    >>> e = mesh_environment(4)
    >>> e["PJRT_DEVICE"], e["CPU_NUM_DEVICES"], int(e["XLA_THREAD_POOL_SIZE"]) >= 4
    ('CPU', '4', True)
    """
    _check_n(n)
    out = dict(os.environ)
    out.update(
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(n),
        XLA_THREAD_POOL_SIZE=str(max(n, int(out.get("XLA_THREAD_POOL_SIZE") or 0))),
        TF_CPP_MIN_LOG_LEVEL=out.get("TF_CPP_MIN_LOG_LEVEL", "2"),
    )
    # The child must import what the caller can import (tests/, a notebook's directory).
    paths = [p or os.getcwd() for p in sys.path] + [out.get("PYTHONPATH", "")]
    out["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    out.update(env or {})
    return out


def _check_n(n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int number of devices, got {n!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1 devices, got {n}; use n=4 for the default CPU mesh")


def _check_runtime_not_started() -> None:
    torch_xla = sys.modules.get("torch_xla")  # never import it here: that is the child's job
    if torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized():
        raise MeshError(
            "The XLA runtime is already initialised in this process (a tensor was put on an "
            "XLA device here). The mesh needs a process whose runtime starts with its own "
            "device settings: launch before touching an XLA device, or restart the kernel."
        )


def _importable_name(fn: Callable[..., Any]) -> tuple[str, str]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    fix = (
        "Define the function at the top level of a module file the child can import "
        "(for example mypkg/steps.py, or a module in xla_permute.examples), import it, and "
        "pass that."
    )
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    if not module or not qualname or module == "__main__" or "<" in qualname:
        raise TypeError(
            f"fn {qualname or fn!r} (module {module!r}) cannot be imported by the device "
            f"process: functions defined in __main__, a notebook cell, a lambda or a closure "
            f"are not importable. {fix}"
        )
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise TypeError(f"fn {module}.{qualname} cannot be imported ({e}). {fix}") from e
    if obj is not fn:
        raise TypeError(f"{module}.{qualname} names another object than fn. {fix}")
    return module, qualname


def run_on_mesh(
    fn: Callable[..., Any],
    *args: Any,
    n: int = 4,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` once on every device of an ``n``-device CPU mesh.

    Each rank runs in its own device thread of a fresh child process; inside ``fn``,
    ``torch_xla.device()`` is that rank's device and ``torch_xla.runtime.global_ordinal()`` its
    rank. Returns the per-rank return values in rank order; XLA tensors in them (also inside
    lists, tuples and dicts) come back as CPU tensors. Arguments and results must pickle.

    Raises:
        ValueError, TypeError: ``n`` < 1, or ``fn`` is not importable by the child.
        MeshError: the XLA runtime is already running here; the device process died
            (a collective rendezvous abort) or ran over ``timeout`` seconds.
        RankError: a rank raised; the message names the rank and the original error,
            which is also ``__cause__``.
    """
    _check_n(n)
    module, qualname = _importable_name(fn)
    _check_runtime_not_started()
    with tempfile.TemporaryDirectory(prefix="xla_permute_mesh_") as tmp:
        payload_path, result_path = Path(tmp, "payload.pkl"), Path(tmp, "result.pkl")
        payload_path.write_bytes(pickle.dumps(_Payload(module, qualname, args, kwargs)))
        cmd = [sys.executable, "-c", _CHILD, str(payload_path), str(result_path)]
        proc = subprocess.Popen(
            cmd,
            env=mesh_environment(n, env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise MeshError(
                f"The {n}-device mesh running {module}.{qualname} did not finish within "
                f"{timeout:g} s and was killed. {_MISMATCH_HINT}\n--- device process stderr "
                f"(tail) ---\n{_tail(err)}"
            ) from None
        if out:
            sys.stdout.write(out)
        if not result_path.exists():
            how = (
                f"was killed by {signal.Signals(-proc.returncode).name}"
                if proc.returncode < 0
                else f"exited with code {proc.returncode}"
            )
            raise MeshError(
                f"The {n}-device mesh running {module}.{qualname} {how} before returning "
                f"results. {_MISMATCH_HINT}\n--- device process stderr (tail) ---\n{_tail(err)}"
            )
        status, value = pickle.loads(result_path.read_bytes())
    if status == "ok":
        return value
    if status == "rank-error":
        rank, type_name, message, tb, original = value
        raise RankError(
            rank, f"rank {rank} of {n} raised {type_name}: {message}\n{tb}", original
        ) from original
    raise MeshError(f"The {n}-device mesh could not start {module}.{qualname}:\n{value}")


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty)"


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type != "cpu" else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


_result_path: Path | None = None  # set once in the device process, read by its rank threads
_failure_lock = threading.Lock()


def _write_result(status: str, value: Any) -> None:
    assert _result_path is not None
    _result_path.write_bytes(pickle.dumps((status, value)))


def _run_rank(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    import torch_xla.runtime as xr

    rank = xr.global_ordinal()
    try:
        return _to_cpu(fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - every rank failure is reported, with its rank
        with _failure_lock:  # the first failure wins; the other ranks may wait on it forever
            try:
                original = pickle.loads(pickle.dumps(e))
            except Exception:
                original = None
            tb = "".join(traceback.format_exception(e))
            _write_result("rank-error", (rank, type(e).__name__, str(e), tb, original))
            sys.stdout.flush()
            os._exit(1)


def _child_main(payload_path: str, result_path: str) -> None:
    """Entry point of the device process: run the payload once on every device thread."""
    global _result_path
    _result_path = Path(result_path)
    try:
        payload: _Payload = pickle.loads(Path(payload_path).read_bytes())
        fn: Any = importlib.import_module(payload.module)
        for part in payload.qualname.split("."):
            fn = getattr(fn, part)
        from torch_xla._internal import pjrt

        # What xmp.spawn runs in each host process: one thread per device, replication set.
        results = pjrt._run_thread_per_device(
            0,
            1,
            functools.partial(_run_rank, fn, payload.args, payload.kwargs),
            initializer_fn=pjrt.initialize_multiprocess,
        )
        _write_result("ok", [results[r] for r in sorted(results)])
    except BaseException:  # noqa: BLE001
        _write_result("start-error", traceback.format_exc())
    sys.stdout.flush()
    # Skip interpreter teardown: XLA's runtime threads can crash an orderly exit.
    os._exit(0)
