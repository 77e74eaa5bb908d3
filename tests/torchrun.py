"""Start a test script on ``n`` real processes with PyTorch's launcher, bounded in time.

``torchrun --standalone`` (run as ``python -m torch.distributed.run``, so that the venv's
interpreter is used) with one thread per process and the debug mode on. A launch that
outlives ``timeout`` is killed with its process group and fails the test with its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def torchrun(
    script: Path, n: int, *args: str, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str, float]:
    """``(exit code, output (stdout and stderr), seconds)`` of ``script args...`` on ``n``
    processes."""
    path = os.pathsep.join(p for p in (str(script.parent), os.environ.get("PYTHONPATH")) if p)
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "XLA_PERMUTE_DEBUG": "1",
        "PYTHONPATH": path,
        **(env or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        str(script),
        *args,
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun with {n} processes did not end in {timeout} s:\n{output[-3000:]}")
    return proc.returncode, output, time.monotonic() - start
