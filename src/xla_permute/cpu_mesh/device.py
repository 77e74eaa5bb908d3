"""The device process of the CPU mesh: one thread per device runs the call, results go home.

:func:`xla_permute.run_on_mesh` starts ``python -m xla_permute.cpu_mesh.device PAYLOAD RESULT``,
which runs :func:`main`: it guards every rank's ``torch_xla.sync()`` (:func:`guard_syncs`),
records what each rank is doing (:mod:`~xla_permute.cpu_mesh.status`), runs the pickled call
once per device thread, each rank with its own unpickled copy of it, and writes the per-rank
results (or the first rank's error) to the launch's result file, where the caller reads them.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.convert_frame as dynamo_compile
import torch._functorch._aot_autograd.runtime_wrappers as aot_runtime
import torch.fx._symbolic_trace as fx_trace
import torch_xla
import torch_xla._dynamo.dynamo_bridge as dynamo_bridge
import torch_xla.core.dynamo_bridge as core_bridge
import torch_xla.runtime as xr
from torch_xla._internal import pjrt

from xla_permute.cpu_mesh import rank_output
from xla_permute.cpu_mesh import status as mesh_status
from xla_permute.cpu_mesh.barrier import BARRIER_ENV
from xla_permute.cpu_mesh.barrier import install as install_barrier
from xla_permute.debug import on_op

__all__ = ["SYNC_GUARD_ENV", "fit_torch_compile", "guard_syncs", "main"]

#: ``XLA_PERMUTE_SYNC_GUARD=0`` in a launch's environment turns the sync guard off
#: (:func:`guard_syncs`), and with it the compile barrier, to see torch_xla's own behaviour.
SYNC_GUARD_ENV = "XLA_PERMUTE_SYNC_GUARD"


def _on(variable: str) -> bool:
    return os.environ.get(variable, "1").strip() != "0"


class _ResultPickler(pickle.Pickler):
    """Pickles results with every tensor on a device as a detached CPU tensor."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        return NotImplemented


def _result_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    _ResultPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(value)
    return buf.getvalue()


_result_path: Path | None = None  # set once in the device process, read by its rank threads
_failure_lock = threading.Lock()


def _write_result(status: str, value: Any) -> None:
    _result_path.write_bytes(_result_bytes((status, value)))


def _fail(rank: int, e: BaseException) -> None:
    """Report rank ``rank``'s failure and end the device process at once."""
    with _failure_lock:  # the first failure wins; the other ranks may wait on it forever
        try:
            original = pickle.loads(pickle.dumps(e))
        except Exception:
            original = None
        tb = "".join(traceback.format_exception(e))
        _write_result("rank-error", (rank, type(e).__name__, str(e), tb, original))
        sys.stdout.flush()
        os._exit(1)


def _run_rank(payload: bytes) -> Any:
    """Run the call on this rank with a copy of its own (unpickled here, on the rank's thread):
    a module or tensor in the arguments or globals is never shared with another rank."""
    rank = xr.global_ordinal()
    rank_output.set_rank(rank)
    mesh_status.set_rank(rank)
    try:
        fn, args, kwargs = pickle.loads(payload)
        value = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - every rank failure is reported, with its rank
        _fail(rank, e)
    try:  # results go home as CPU data: convert (and check) here, on the rank's own thread
        return pickle.loads(_result_bytes(value))
    except Exception as e:  # noqa: BLE001
        _fail(rank, TypeError(f"the result of rank {rank} cannot be sent back: {e}; return "
                              f"tensors, numbers, strings and containers of them"))  # fmt: skip


def guard_syncs(barrier: Callable[[torch.device], None] | None) -> None:
    """Guard every rank's ``torch_xla.sync()``: the compile barrier first, when given
    (:mod:`xla_permute.cpu_mesh.barrier`), then the step marker with a pending scalar on the
    rank's own device; the rank's time in it recorded (:mod:`xla_permute.cpu_mesh.status`).

    torch_xla 2.9 waits, in a sync with nothing to run, for the lock of ``CPU:0``, rank 0's
    device, which rank 0 holds while it executes a collective: the rank never reaches that
    collective and XLA:CPU aborts after 15 s (caveat ``empty-sync-device-lock``; the
    reproducer is in tests/test_mesh_programs.py). With the scalar, the sync locks the rank's
    own device only.
    """
    step_marker = torch_xla._XLAC._xla_step_marker

    def guarded(*args: Any, **kwargs: Any) -> Any:
        entered, device = time.monotonic(), torch_xla.device()
        mesh_status.enter("sync")
        try:
            if barrier is not None:
                barrier(device)
            pending = torch.zeros((), device=device)  # noqa: F841 - held in the sync
            mesh_status.enter("sync")
            return step_marker(*args, **kwargs)
        finally:
            mesh_status.leave_sync(entered)

    torch_xla._XLAC._xla_step_marker = guarded


class _OwnDeviceWait:
    """torch_xla's ``xla_model`` for its dynamo bridge, whose ``wait_device_ops()`` with no
    device list waits for the calling rank's device only."""

    def __init__(self, xm: Any) -> None:
        self._xm = xm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._xm, name)

    def wait_device_ops(self, devices: list[str] | None = None) -> None:
        self._xm.wait_device_ops(devices or self._xm.xla_real_devices([torch_xla.device()]))


def fit_torch_compile() -> None:
    """Let ``torch.compile`` (backend ``openxla``) compile and run a rank's local math, forward
    and backward, on the mesh of rank threads.

    torch_xla 2.9's dynamo bridge waits by ``xm.wait_device_ops()`` for every device of the
    process, another rank's inside a collective that waits for this rank too (XLA:CPU aborts
    after 15 s): here, for the rank's own device. torch's compiler keeps process-global state
    that ranks compiling at once corrupted: the node metadata being traced and the compile
    metrics (the bridge's extraction, after the rank's sync, and AOT autograd's lazy compile of
    a backward take Dynamo's ``compile_lock``, as Dynamo's own compile does), and the FX
    tracing flag that a compiled function's call reads (it counts for the lock's holder only).
    """
    dynamo_bridge.xm = _OwnDeviceWait(dynamo_bridge.xm)
    extract, lock = core_bridge.extract_compiled_graph, dynamo_compile.compile_lock

    def extract_compiled_graph(*args: Any, **kwargs: Any) -> Any:
        torch_xla.sync()  # before the lock: a rank that holds it never waits at the barrier
        mesh_status.enter("torch.compile")
        try:
            with lock:
                return extract(*args, **kwargs)
        finally:
            mesh_status.enter("run")

    core_bridge.extract_compiled_graph = extract_compiled_graph
    metrics = aot_runtime.get_metrics_context  # entered by the lazy compile of a backward
    aot_runtime.get_metrics_context = lambda: _locked(metrics())
    tracing = fx_trace.is_fx_symbolic_tracing  # read by the calls that torch.compile wraps
    fx_trace.is_fx_symbolic_tracing = lambda: lock._is_owned() and tracing()


@contextlib.contextmanager
def _locked(context: Any) -> Iterator[Any]:
    """``context`` entered with Dynamo's compile lock held (one rank at a time)."""
    with dynamo_compile.compile_lock, context as entered:
        yield entered


def main(payload_path: str, result_path: str) -> None:
    """Entry point of the device process: run the payload once on every device thread."""
    global _result_path
    _result_path = Path(result_path)
    mesh_status.start(_result_path.parent)
    on_op(mesh_status.note_op)
    rank_output.install()
    try:
        fit_torch_compile()  # before the payload's modules are imported: they may compile
        payload = Path(payload_path).read_bytes()
        pickle.loads(payload)  # a call that cannot be unpickled here is a start error

        if _on(SYNC_GUARD_ENV):
            n = int(os.environ["CPU_NUM_DEVICES"])
            guard_syncs(install_barrier(n) if n > 1 and _on(BARRIER_ENV) else None)
        # What xmp.spawn runs in each host process: one thread per device, replication set.
        results = pjrt._run_thread_per_device(
            0,
            1,
            lambda: _run_rank(payload),
            initializer_fn=pjrt.initialize_multiprocess,
        )
        _write_result("ok", [results[r] for r in sorted(results)])
    except BaseException:  # noqa: BLE001
        _write_result("start-error", traceback.format_exc())
    for stream in (sys.stdout, sys.stderr):
        stream.close_lines()
    # Skip interpreter teardown: XLA's runtime threads can crash an orderly exit.
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
