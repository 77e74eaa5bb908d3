"""``python -m xla_permute bench``: collective matmul against its baselines, measured (a tool).

Six programs, side by side: all-gather-matmul and matmul-reduce-scatter, each as a
unidirectional ring (``uni``), a bidirectional ring (``bi``) and the upstream baseline
(:func:`~xla_permute.matmul.all_gather_then_matmul`,
:func:`~xla_permute.matmul.matmul_then_reduce_scatter`). Per-rank shapes: all-gather-matmul
takes x ``[m, k]`` and w ``[k, f]``; matmul-reduce-scatter takes x ``[N*m, k]`` and w
``[k, f]``; float32.

Every figure names the backend that produced it:

* **trace**, **compile** (``native``): the program that runs on TPU and Neuron, one
  ``collective-permute`` per step, traced and compiled by XLA:CPU on rank 0 but never executed
  (the native permute cannot run on the CPU mesh). Trace = building the lazy graph in Python;
  compile = ``torch_xla._XLAC._xla_warm_up_cache`` (lowering and XLA:CPU compile). Medians over
  ``compile_repeats`` rounds after ``warmup`` discarded rounds; round ``i`` uses ``f + i``
  columns so that every round compiles afresh (XLA caches compiled graphs by their hash).
* **peak memory** (``native``), at ``n`` and at ``scaling_n`` devices (N=4 and N=8 by
  default): "Total bytes used" of XLA's buffer assignment of the compiled
  program (``*memory-usage-report.txt`` written with ``XLA_FLAGS=--xla_dump_to``), one
  compile per program in a launch of its own, matched to its program by the files that compile
  added and checked by the collectives in the dumped module. The ranks' programs differ (the
  order of the output blocks depends on the rank), so every rank compiles its own, one rank
  after the other, and the largest figure is reported.
  Two cases: x a program **input** (a parameter, live for the whole program) and x
  **computed** inside the program (an outer product of two input vectors, so nothing of x's
  size is resident: the best case for a previous layer's output); w is an input in both.
  Each with torch_xla's numeric collective token (the default) and without it
  (``DISABLE_NUMERIC_CC_TOKEN=1``; "For Neuron we set DISABLE_NUMERIC_CC_TOKEN=1",
  https://github.com/pytorch/xla/pull/6077): the token adds a scalar to every collective's
  operand, which makes XLA copy each block before it is sent, and orders all collectives one
  after the other.
* **bytes sent** (``native`` HLO): what each rank sends, from rank 0's traced HLO (the
  collectives, their pairs and shapes, are the same on every rank) with
  :func:`~xla_permute_tools.accounting.account_bytes` (ring algorithms assumed for all-gather and
  reduce-scatter), per collective, per schedule step and in total; and matmul-reduce-scatter
  on bfloat16 inputs with ``reduce_dtype`` None (float32 partial sums) and bfloat16, checked
  against :func:`~xla_permute.reference.accumulation_dtype` and the cost model's charge.
* **run** (``emulated``): wall time of executing the program on the CPU mesh, where the
  permute is emulated by a channel-id all-gather that moves N times the data of a permute.
  Median over ``repeats`` after ``warmup`` runs, slowest rank. It measures the CPU emulation,
  not what collective matmul does on an accelerator.

The launches: one ``N``-device mesh runs the emulated programs on every rank, then times the
native trace and compile on rank 0 alone; two per mesh size (``n`` and ``scaling_n``)
compile the native programs with XLA's dumps on (with and without the token), two of these
launches at a time (they time nothing); one ``scaling_n``-device mesh times trace and compile
again, alone.
Compiles are small and every emulated program is compiled by its warm-up run before any timed
run, so no rank arrives late at a rendezvous.

The modules, one job each: ``programs`` (the programs, their sizes, building one on a
rank), ``measure`` (the rank functions that time and compile them and read XLA's memory
reports), ``run`` (the launches, :func:`run_bench`), ``report`` (ratios, checks,
:func:`format_report`) and ``cli`` (the command line). Bytes and permute chains are read with
:func:`xla_permute_tools.accounting.account_bytes` and
:func:`~xla_permute_tools.accounting.chain_report`.

>>> config = PRESETS["tiny"]
>>> config.n, [p.name for p in PROGRAMS][:3]
(4, ['all_gather_matmul/uni', 'all_gather_matmul/bi', 'all_gather_matmul/baseline'])
"""

from __future__ import annotations

from xla_permute_tools.bench.cli import add_arguments, config_from_args, run_from_args
from xla_permute_tools.bench.programs import PRESETS, PROGRAMS, BenchConfig, BenchProgram
from xla_permute_tools.bench.report import format_report
from xla_permute_tools.bench.run import run_bench

__all__ = [
    "PRESETS",
    "PROGRAMS",
    "BenchConfig",
    "BenchProgram",
    "add_arguments",
    "config_from_args",
    "format_report",
    "run_bench",
    "run_from_args",
]
