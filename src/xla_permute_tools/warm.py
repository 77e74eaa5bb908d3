"""A warm process for the CPU mesh: torch imported once, forked for every launch.

A new device process spends about 4 s on a 2-core machine before its first rank runs, almost
all of it importing torch and the parts of torch that torch_xla imports (``torch._dynamo``,
``torch._inductor``, ``torch.export``, ...); the suite and the tutorials launch about a
hundred meshes. :func:`start_process` is a starter for :func:`xla_permute.run_on_mesh`::

    XLA_PERMUTE_LAUNCHER=xla_permute_tools.warm:start_process

(the root ``conftest.py`` sets it for the tests and the tutorials, the Makefile for the docs).
It asks a *zygote*, a child process that has imported those torch modules, but never
torch_xla and never a device, to fork: the fork starts with torch in memory, takes the
launch's environment, working directory and output pipes, and runs what ``python -m MODULE
ARGS`` runs (the mesh's device process), which imports torch_xla (about 0.2 s) and creates the
PJRT client with the launch's settings.

What a fork cannot change is what was read while importing: the zygote imported torch with
its own environment. So a launch whose environment differs from the zygote's in any variable
other than :data:`LAUNCH_VARIABLES` (read by torch_xla, XLA and xla_permute, none of them
imported in the zygote) gets a new zygote. The zygote imports nothing of xla_permute (it runs
this file by path), so its modules are imported fresh in every fork. A command other than
``[sys.executable, "-m", ...]``, a zygote that cannot start, or one busy with another
thread's launch gets a fresh interpreter (:class:`subprocess.Popen`) instead. To start one
launch fresh, unset the variable for it: ``run_on_mesh(..., env={"XLA_PERMUTE_LAUNCHER": ""})``.

This file imports only the standard library at the top: the zygote runs it by path.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Any

__all__ = ["EXTRA_ENV", "LAUNCH_VARIABLES", "PRELOAD", "ForkedProcess", "start_process"]

#: The modules the zygote imports (torch and what torch_xla's import pulls in from it).
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch._inductor.lowering",
    "torch._functorch.aot_autograd",
    "functorch.compile",
    "torch.export",
    "numpy",
    "cloudpickle",
)
#: The variables a launch may set differently from the zygote's environment, because no
#: import of the :data:`PRELOAD` modules reads them (torch_xla, XLA and xla_permute do;
#: importing torch_xla sets ``GRPC_VERBOSITY``, ``PJRT_DYNAMIC_PLUGINS``, ``XLA_FLAGS`` and
#: ``TF_CPP_MIN_LOG_LEVEL`` in the importing process). A caller adds its own in
#: :data:`EXTRA_ENV` (a test runner that changes a variable per test names it there).
LAUNCH_VARIABLES = frozenset(
    {
        "PJRT_DEVICE",
        "PJRT_DYNAMIC_PLUGINS",
        "GRPC_VERBOSITY",
        "CPU_NUM_DEVICES",
        "XLA_THREAD_POOL_SIZE",
        "TF_CPP_MIN_LOG_LEVEL",
        "XLA_FLAGS",
        "XLA_PERMUTE_DEBUG",
        "XLA_ENABLE_PARAM_ALIASING",
        "DISABLE_NUMERIC_CC_TOKEN",
        "XLA_PERMUTE_LAUNCHER",
        "XLA_PERMUTE_SYNC_GUARD",
        "XLA_PERMUTE_LAUNCH_VARIABLES",
    }
)
#: Comma-separated names of further launch variables, read from the launch's environment.
EXTRA_ENV = "XLA_PERMUTE_LAUNCH_VARIABLES"
_READY_TIMEOUT = 300.0  # seconds for the zygote's imports, on a loaded machine


def _key(env: dict[str, str]) -> frozenset[tuple[str, str]]:
    extra = {name.strip() for name in env.get(EXTRA_ENV, "").split(",")}
    return frozenset((k, v) for k, v in env.items() if k not in LAUNCH_VARIABLES and k not in extra)


class ForkedProcess:
    """The part of :class:`subprocess.Popen` that ``run_on_mesh`` uses, for a zygote's fork:
    ``pid``, text ``stdout``/``stderr`` pipes, ``wait``, ``returncode`` (negative: the
    signal that ended it), and ``with`` (closes the pipes and waits, as Popen does)."""

    def __init__(self, zygote: Any, pid: int, stdout: IO[str], stderr: IO[str]) -> None:
        self._zygote, self.pid, self.stdout, self.stderr = zygote, pid, stdout, stderr
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._zygote.receive(timeout)["returncode"]
            except TimeoutError:
                raise subprocess.TimeoutExpired("forked device process", timeout) from None
            except ConnectionError:  # the zygote died (killed): its fork went with it
                self.returncode = -signal.SIGKILL
            self._zygote.lock.release()
        return self.returncode

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stdout.close()
        self.stderr.close()
        self.wait()


class _Zygote:
    """The parent's end: one zygote process and the socket to it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.key = _key(env)
        self.lock = threading.Lock()  # one launch at a time
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        code = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__zygote__')"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, __file__, str(theirs.fileno())],
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        try:
            self.receive(_READY_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def receive(self, timeout: float | None) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        message = self.sock.recv(1 << 16)
        if not message:
            raise ConnectionError("the zygote exited")
        return json.loads(message)

    def fork(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """Fork a process running ``python -m argv[0] argv[1:]`` (lock held)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            request = {"argv": argv, "env": env, "cwd": os.getcwd()}
            socket.send_fds(self.sock, [json.dumps(request).encode()], [out_w, err_w])
            pid = self.receive(_READY_TIMEOUT)["pid"]
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return ForkedProcess(
            self, pid, open(out_r, errors="replace"), open(err_r, errors="replace")
        )

    def close(self) -> None:
        self.sock.close()  # the zygote exits when its socket closes
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


@atexit.register
def _close_zygote() -> None:
    global _zygote
    with _zygote_lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None


def start_process(command: list[str], env: dict[str, str]) -> ForkedProcess | subprocess.Popen:
    """Start ``command`` in environment ``env``, as :func:`xla_permute.run_on_mesh`'s
    ``XLA_PERMUTE_LAUNCHER`` would: ``[sys.executable, "-m", module, *args]`` in a fork of the
    zygote (started, or replaced, when needed), anything else, or when the zygote cannot start
    or is busy with another launch, in a fresh interpreter.

    Either way the process leads a session of its own (``os.killpg(proc.pid, ...)`` ends it)
    and has text pipes as ``stdout`` and ``stderr``.
    """
    global _zygote
    if command[:2] == [sys.executable, "-m"] and hasattr(socket, "send_fds"):
        key = _key(env)
        with _zygote_lock:
            stale = _zygote is not None and (_zygote.key != key or _zygote.proc.poll() is not None)
            if stale and _zygote.lock.acquire(blocking=False):  # replaced only while idle
                _zygote.close()
                _zygote = None
            try:
                if _zygote is None:
                    _zygote = _Zygote(env)
            except (OSError, TimeoutError, ValueError):
                _zygote = None
            zygote = _zygote if _zygote is not None and _zygote.key == key else None
        if zygote is not None and zygote.lock.acquire(blocking=False):
            try:
                return zygote.fork(command[2:], env)
            except (OSError, TimeoutError, ValueError):
                zygote.lock.release()
                with _zygote_lock:
                    if _zygote is zygote:
                        zygote.close()
                        _zygote = None
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


# --------------------------------------------------------------------------- the zygote


def _zygote_main(fd: int) -> None:
    """The zygote: import :data:`PRELOAD`, then fork once per request until the parent
    closes the socket; report each fork's pid, then its exit status."""
    import contextlib
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # another torch: the fork imports it if used
            importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    sock.send(b'{"ready": true}')
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        except OSError:
            break
        if not message:
            break
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            _run_fork(request, fds)
        for f in fds:
            os.close(f)
        sock.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        sock.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())


def _run_fork(request: dict[str, Any], fds: list[int]) -> None:
    """In the fork: become what ``python -m module *args`` would be, and run it. Never
    returns."""
    code = 1
    try:
        os.setsid()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in fds:
            os.close(f)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        import random
        import runpy

        random.seed()  # a fresh interpreter's generators differ from launch to launch
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__zygote__":
    _zygote_main(int(sys.argv[2]))
