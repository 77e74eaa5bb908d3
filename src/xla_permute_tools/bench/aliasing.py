"""``python -m xla_permute bench --aliasing``: what the mesh's aliasing default costs.

:func:`~xla_permute.run_on_mesh` turns torch_xla's parameter aliasing off
(``XLA_ENABLE_PARAM_ALIASING=0``), because with it on a training loop on a mesh of device
threads can deadlock (:func:`~xla_permute.cpu_mesh.mesh_environment`).
Aliasing lets a step's program write the updated parameters and optimizer states into the
buffers of the old ones; without it they get new buffers. This bench measures the price, side
by side in two launches of the same training step (a sequence-parallel MLP on collective
matmul, AdamW, float32) on the CPU mesh:

* **off**: the mesh's default;
* **on**: torch_xla's default, with the collective token reset before every sync
  (``torch_xla._XLAC._set_all_reduce_token(device, None)``), which removes the deadlock's
  path (the token dropped with the GIL held after the step is dispatched; tutorial 14). If
  the launch still aborts (a rank compiling long after another on a loaded machine aborts
  either launch), the report says so; the memory figure comes from compiling, before
  anything runs, so it is measured either way.

Figures, each from the CPU mesh (emulated permutes): the step program's memory as torch_xla
accounts it after compiling (``PT_XLA_DEBUG_LEVEL=1``'s "Post Compilation Analysis": graph
inputs + outputs - aliased inputs + intermediates, in torch_xla's GB with six decimals; the
largest program of the launch, the training step) and the wall time per step (slowest rank,
median over the timed steps).
"""

from __future__ import annotations

import contextlib
import io
import statistics
from typing import Any

__all__ = ["aliasing_rank", "format_aliasing_report", "program_bytes", "run_aliasing_bench"]

#: Sizes of the measured step: hidden, ffn, local sequence, batch; warm-up and timed steps.
DEFAULT = {"hidden": 256, "ffn": 1024, "seq": 128, "batch": 2, "warmup": 2, "steps": 5}


def aliasing_rank(
    cfg: dict[str, int], state: dict[str, Any], reset_token: bool, losses: list | None = None
) -> list[float]:
    """Rank function: ``warmup + steps`` AdamW steps; the wall time of each timed step (and
    each step's loss appended to ``losses``, if given)."""
    import time

    import torch
    import torch_xla
    import torch_xla.runtime as xr
    from torch import nn

    import xla_permute as xp

    device, rank, n = torch_xla.device(), xr.global_ordinal(), xr.world_size()
    fc1, fc2 = nn.Linear(cfg["hidden"], cfg["ffn"]), nn.Linear(cfg["ffn"], cfg["hidden"])
    fc1.load_state_dict(state["fc1"])
    fc2.load_state_dict(state["fc2"])
    mlp = xp.SequenceParallelMLP.from_mlp(fc1, fc2).to(device)
    x = state["x"].chunk(n, dim=1)[rank].to(device)
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    times = []
    for _ in range(cfg["warmup"] + cfg["steps"]):
        start = time.perf_counter()
        opt.zero_grad()
        loss = mlp(x).square().mean()
        loss.backward()
        opt.step()
        if reset_token:  # the deadlock's workaround that keeps aliasing on
            torch_xla._XLAC._set_all_reduce_token(str(device), None)
        torch_xla.sync()
        value = loss.cpu()  # waits for this rank's step
        times.append(time.perf_counter() - start)
        if losses is not None:
            losses.append(float(value.detach()))
    return times[cfg["warmup"] :]


_ANALYSIS = "Post Compilation Analysis: "
_SIZES = {
    "Graph input size": 1,
    "Graph output size": 1,
    "Aliased Input size": -1,
    "Intermediate tensor size": 1,
}


def program_bytes(log: str) -> list[int]:
    """Per compiled program in a ``PT_XLA_DEBUG_LEVEL=1`` log: inputs + outputs - aliased +
    intermediates, in bytes.

    >>> log = "\\n".join(_ANALYSIS + line for line in [
    ...     "=====", "Graph input size: 0.000004 GB", "Graph output size: 0.000002 GB",
    ...     "Aliased Input size: 0.000001 GB", "Intermediate tensor size: 0.000003 GB"])
    >>> program_bytes(log)
    [8000]
    """
    programs: list[int] = []
    for line in log.splitlines():
        if not line.startswith(_ANALYSIS):
            continue
        text = line[len(_ANALYSIS) :]
        if text.startswith("====="):
            programs.append(0)
        for name, sign in _SIZES.items():
            if text.startswith(name + ":") and programs:
                programs[-1] += sign * round(float(text.split(":")[1].split()[0]) * 1e9)
    return [p for p in programs if p]


def run_aliasing_bench(n: int = 4, cfg: dict[str, int] | None = None) -> dict[str, Any]:
    """Both launches; ``{"config", "off", "on"}`` with ``step_s`` (None if the launch
    aborted) and ``peak_bytes`` each."""
    import torch
    from torch import nn

    from xla_permute import MeshError, run_on_mesh

    cfg = {**DEFAULT, **(cfg or {})}
    g = torch.Generator().manual_seed(0)
    fc1, fc2 = nn.Linear(cfg["hidden"], cfg["ffn"]), nn.Linear(cfg["ffn"], cfg["hidden"])
    x = torch.randn(cfg["batch"], n * cfg["seq"], cfg["hidden"], generator=g)
    state = {"fc1": fc1.state_dict(), "fc2": fc2.state_dict(), "x": x}
    result: dict[str, Any] = {"config": {**cfg, "n": n}}
    for name, aliasing in (("off", "0"), ("on", "1")):
        env = {
            "XLA_ENABLE_PARAM_ALIASING": aliasing,
            "XLA_PERMUTE_DEBUG": "none",  # a timed run of a correct program: no checks
            "PT_XLA_DEBUG_LEVEL": "1",  # torch_xla's account of each compiled program
        }
        log, step_s = io.StringIO(), None
        try:
            with contextlib.redirect_stderr(log):  # the mesh relays the device's stderr
                per_rank = run_on_mesh(aliasing_rank, cfg, state, aliasing == "1", n=n, env=env)
            step_s = statistics.median(max(step) for step in zip(*per_rank, strict=True))
        except MeshError:
            if aliasing == "0":  # the mesh's default must run
                raise
        result[name] = {
            "step_s": step_s,
            "peak_bytes": max(program_bytes(log.getvalue()), default=0),
        }
    return result


def format_aliasing_report(result: dict[str, Any]) -> str:
    """The two launches side by side, with the ratio off / on.

    >>> r = {"config": {"n": 4}, "off": {"step_s": 0.2, "peak_bytes": 3 * 2**20},
    ...      "on": {"step_s": None, "peak_bytes": 2 * 2**20}}
    >>> print(format_aliasing_report(r))
    parameter aliasing, training step on the 4-device CPU mesh (emulated permutes)
      aliasing   peak memory   step time
      on            2.00 MiB     aborted
      off           3.00 MiB    200.0 ms
      off / on         1.500           -
    """
    on, off = result["on"], result["off"]
    rows = [
        f"parameter aliasing, training step on the {result['config']['n']}-device CPU mesh "
        "(emulated permutes)",
        f"  {'aliasing':<8} {'peak memory':>13} {'step time':>11}",
    ]
    for name, r in (("on", on), ("off", off)):
        step = "aborted" if r["step_s"] is None else f"{r['step_s'] * 1e3:.1f} ms"
        rows.append(f"  {name:<8} {r['peak_bytes'] / 2**20:>9.2f} MiB {step:>11}")
    time_ratio = "-" if on["step_s"] is None else f"{off['step_s'] / on['step_s']:.3f}"
    rows.append(f"  {'off / on':<8} {off['peak_bytes'] / on['peak_bytes']:>13.3f} {time_ratio:>11}")
    return "\n".join(rows)
