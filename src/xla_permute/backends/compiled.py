"""The ops refuse ``torch.compile``: :func:`check_not_compiling`, before anything else they do.

Imports only the lowest floor (pairs), so every floor (the backends, the agreement checks) can
call it.
"""

from __future__ import annotations

import sys

from xla_permute.pairs import see

__all__ = ["CompileError", "check_not_compiling"]


class CompileError(RuntimeError):
    """An op of this package was called inside ``torch.compile`` (raised on every rank)."""


def _in_compiled_frame() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name.startswith("torch_dynamo_resume_in_") or any(
            name.startswith("__compiled_fn") for name in code.co_names
        ):
            return True
        frame = frame.f_back
    return False


def check_not_compiling(op: str | None = None) -> None:
    """Raise :class:`CompileError` under ``torch.compile``, on every rank before any collective.

    The ops keep per-rank state on the host (channel ids, the collective token, the agreement
    checks, the c10d handles in flight) that Dynamo cannot trace: under
    ``torch.compile(backend="openxla")`` the mesh aborted or every rank failed with "Failed to
    get computation by hash", also with the op under ``torch.compiler.disable``. Dynamo either
    traces the call (``torch.compiler.is_compiling()``) or, after a graph break, runs it from
    rewritten bytecode whose frames name ``__compiled_fn_*`` or ``torch_dynamo_resume_in_*``.
    """
    import torch

    if torch.compiler.is_compiling() or _in_compiled_frame():
        frame, outer = sys._getframe(1), None
        while frame is not None:  # the user's call: the package's outermost frame
            name = frame.f_globals.get("__name__", "")
            public = not frame.f_code.co_name.startswith("_")
            if name.startswith("xla_permute.") and public and ".cpu_mesh." not in name:
                outer = frame.f_code.co_qualname
            frame = frame.f_back
        op = outer or op
        raise CompileError(
            f"{op} was called inside torch.compile, which this package does not support: its "
            f"collectives keep per-rank state that Dynamo cannot trace. Call it outside the "
            f"compiled function (compile only the math around it), or run without "
            f"torch.compile: torch_xla's lazy tensors already compile each step into one XLA "
            f"program at torch_xla.sync(){see('compile')}"
        )
