"""Hardware caveats as code: what each backend does to a collective, and what this package does.

The caveats users of ``torch_xla`` collectives hit are spread over issue threads. Here they are
data: :func:`caveats` lists them per device type, each with what goes wrong, the upstream
source, and what this package does about it; :func:`check_pairs` refuses (or warns about)
permutes a backend cannot run as XLA's semantics promise, and
:func:`~xla_permute.permute.collective_permute` calls it on the native backend;
:func:`tpu_collective_matmul_setup` is the TPU compiler's collective-matmul recipe as data a
user applies; :func:`detect` says which of all this applies here.

Which checks raise and which warn:

* :class:`ValueError` (the permute cannot run, the message has the fix): on Neuron, pairs that
  do not form complete rings (an open chain such as a pipeline's ``0 -> 1 -> 2``).
* :class:`HardwareWarning` (it runs, but may not mean what XLA says): on Neuron, ranks that
  are in no pair (XLA gives them zeros; Neuron leaves them inactive) and 64-bit dtypes.

Facts this project could not confirm in a public source say so in their caveat
(``Caveat.evidence``) instead of citing one.

>>> requires_complete_rings("NEURON"), requires_complete_rings("TPU")
(True, False)
>>> check_pairs("TPU", [(0, 1), (1, 2)], 4)      # an open chain: fine on TPU
>>> check_pairs("NEURON", [(0, 1), (1, 2)], 4)
Traceback (most recent call last):
...
ValueError: pairs [(0, 1), (1, 2)] form an open chain 0 -> 1 -> 2: NEURON runs only ...
>>> sorted(c.id for c in caveats("CPU"))
['collective-token', 'cpu-channel-ids', 'cpu-thread-pool', 'pin-layout']
"""

from __future__ import annotations

import glob
import importlib.metadata
import logging
import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xla_permute import pairs as _pairs

__all__ = [
    "Caveat",
    "CollectiveSignature",
    "DumpReport",
    "Environment",
    "HardwareWarning",
    "SEVERITIES",
    "TpuCollectiveMatmulSetup",
    "caveats",
    "check_pairs",
    "collective_signatures",
    "compile_with_flag",
    "detect",
    "flag_read_once",
    "pin_layout_hlo",
    "read_dump",
    "requires_complete_rings",
    "tpu_collective_matmul_setup",
]


class HardwareWarning(UserWarning):
    """A collective that runs on this backend but may not do what XLA's semantics say."""


#: The severities of a caveat, most severe first. ``error``: the program fails, hangs or is
#: refused; ``silent``: wrong or unexpected results without an error; ``performance``;
#: ``info``: status and practice.
SEVERITIES = ("error", "silent", "performance", "info")

_PT_XLA = "https://github.com/pytorch/xla"
_MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext/blob/main"
_NEURON_DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest"


@dataclass(frozen=True)
class Caveat:
    """One hardware caveat.

    ``applies_to`` lists device types (``"*"``: all); ``sources`` are upstream URLs;
    ``evidence`` says what this project checked itself (installed source, a run on the CPU
    mesh, a tutorial) or that a fact is not confirmed by a public source.
    """

    id: str
    applies_to: tuple[str, ...]
    severity: str
    summary: str
    what_goes_wrong: str
    library_action: str
    sources: tuple[str, ...]
    evidence: str

    def format(self, width: int = 100) -> str:
        """A plain-text block, wrapped at ``width`` (for ``python -m xla_permute doctor``)."""
        import textwrap

        lines = [f"[{self.severity}] {self.id}: {self.summary}"]
        for label, text in (
            ("what goes wrong", self.what_goes_wrong),
            ("this package", self.library_action),
            ("evidence", self.evidence),
        ):
            lines += textwrap.wrap(
                text,
                width,
                initial_indent=f"  {label}: ",
                subsequent_indent="    ",
                break_on_hyphens=False,
            )
        lines += [f"  source: {url}" for url in self.sources]
        return "\n".join(lines)


_CAVEATS: tuple[Caveat, ...] = (
    Caveat(
        id="tpu-collective-matmul-flag",
        applies_to=("TPU",),
        severity="performance",
        summary="ENABLE_COLLECTIVE_MATMUL_IN_MP=1 turns on the TPU compiler's collective matmul",
        what_goes_wrong=(
            "torch_xla reads ENABLE_COLLECTIVE_MATMUL_IN_MP once, at the first compile of the "
            "process (a function-static in PjRtComputationClient::Compile); setting it later "
            "does nothing. When set, every program is compiled with SPMD partitioning and the "
            "TPU options xla_tpu_decompose_all_gather_einsum and "
            "xla_tpu_decompose_einsum_reduce_scatter, which let the TPU compiler rewrite an "
            "all-gather (reduce-scatter) next to an einsum into a loop of collective-permutes "
            "overlapped with partial matmuls. The rewrite only matches collectives issued with "
            "pin_layout=False, a channel_id and use_global_device_ids=True (PR 8855 added the "
            "last two to xm.all_gather and xm.reduce_scatter for this); xm.all_gather's default "
            "pin_layout=True lowers it as an all-reduce, which never matches (see pin-layout). "
            "The rewrite happens inside the TPU compiler: the HLO torch_xla traces "
            "(_get_xla_tensors_hlo) shows the all-gather either way; only post-optimization "
            "dumps show the result. The options exist only in the TPU compiler."
        ),
        library_action=(
            "tpu_collective_matmul_setup() returns the environment and the collective keyword "
            "arguments; its apply() refuses once this process has compiled a program, and "
            "read_dump() reads the post-optimization dumps. This package's own collective "
            "matmul (xla_permute.matmul) issues the permutes explicitly and needs no flag."
        ),
        sources=(
            f"{_PT_XLA}/pull/8855",
            f"{_PT_XLA}/blob/v2.9.0/torch_xla/csrc/runtime/pjrt_computation_client.cpp",
            f"{_PT_XLA}/blob/v2.9.0/test/test_mp_collective_matmul.py",
            f"{_PT_XLA}/issues/8815",
        ),
        evidence=(
            "the installed _XLAC (torch_xla 2.9.0) holds the variable name next to both option "
            "names; on the CPU mesh the variable set before the first compile makes every "
            "compile fail with \"No such compile option: 'xla_tpu_decompose_all_gather_einsum'\""
            ", and set after the first compile it is ignored (tutorial: Hardware caveats)"
        ),
    ),
    Caveat(
        id="tpu-libtpu-overlap-flags",
        applies_to=("TPU",),
        severity="performance",
        summary="LIBTPU_INIT_ARGS flags decide whether permutes and all-gathers overlap compute",
        what_goes_wrong=(
            "The TPU compiler overlaps collectives with compute only when asked: "
            "--xla_enable_async_collective_permute rewrites collective-permutes into "
            "asynchronous start/done pairs; --xla_tpu_enable_async_collective_fusion (with "
            "_fuse_all_gather and _multiple_steps), --xla_tpu_overlap_compute_collective_tc and "
            "--xla_enable_async_all_gather fuse async collectives with compute (continuation "
            "fusion); --xla_jf_spmd_threshold_for_windowed_einsum_mib sets the size above which "
            "the SPMD partitioner emits windowed einsums (collective matmul; MaxText disables "
            "them with 1000000). libtpu reads LIBTPU_INIT_ARGS when it initialises, before the "
            "first TPU use. These are TPU compiler flags, not part of OpenXLA, and may change. "
            "torch_xla 2.9 adds its own defaults to LIBTPU_INIT_ARGS on import when a TPU is "
            "found (async all-gather and async collective-permute on v5). The names "
            "--xla_tpu_enable_windowed_einsum_for_all_gather/_for_reduce_scatter appear in "
            "Google's MaxText configurations, but this project found no description of them."
        ),
        library_action=(
            "tpu_collective_matmul_setup(overlap=True) adds the async collective-permute and "
            "continuation-fusion flags to LIBTPU_INIT_ARGS, keeping flags already set; "
            "windowed_einsum_threshold_mib adds the threshold."
        ),
        sources=(
            "https://docs.jax.dev/en/latest/xla_flags.html",
            "https://openxla.org/xla/flags_guidance",
            f"{_MAXTEXT}/benchmarks/xla_flags_library.py",
            f"{_PT_XLA}/blob/v2.9.0/torch_xla/__init__.py",
        ),
        evidence=(
            "torch_xla 2.9.0's _setup_libtpu_flags (installed source) sets "
            "xla_enable_async_collective_permute=true on v5 only; no TPU was available to this "
            "project, so the flags' effect is cited, not measured"
        ),
    ),
    Caveat(
        id="pin-layout",
        applies_to=("*",),
        severity="silent",
        summary="pin_layout: default True on most xm collectives, absent on collective_permute",
        what_goes_wrong=(
            "Each replica compiles its own program, and a collective whose operand layout "
            "differs between replicas silently corrupts data; pin_layout=True pins the layout "
            "(constrain_layout=true in the HLO). xm.all_reduce, all_gather, reduce_scatter, "
            "all_to_all and collective_broadcast default to True. Mixing pinned and unpinned "
            "collectives can fail to compile ('HloModule has a mix of layout constrained ...'). "
            "A pinned single-tensor xm.all_gather is lowered as an all-reduce of a zero-padded "
            "tensor: N times the data, no channel_id and no use_global_device_ids (they are "
            "dropped silently), so the TPU collective-matmul rewrite has no all-gather to match "
            "and the CPU mesh aborts it. xm.collective_permute has no pin_layout argument; its "
            "HLO carries no layout constraint."
        ),
        library_action=(
            "Every collective this package issues passes pin_layout=False with a channel id and "
            "use_global_device_ids=True; collective_permute has nothing to pin. "
            "collective_signatures() reads the defaults from the installed torch_xla."
        ),
        sources=(
            f"{_PT_XLA}/pull/3511",
            f"{_PT_XLA}/issues/3506",
            f"{_PT_XLA}/pull/3568",
            f"{_PT_XLA}/blob/v2.9.0/torch_xla/core/xla_model.py",
            f"{_PT_XLA}/issues/8815",
        ),
        evidence=(
            "defaults read from the installed signatures; the HLO of a pinned and an unpinned "
            "all-gather and of a permute is traced on the CPU mesh (tutorial: Hardware caveats)"
        ),
    ),
    Caveat(
        id="neuron-complete-rings",
        applies_to=("NEURON",),
        severity="error",
        summary="Neuron runs only permutes whose pairs form complete rings",
        what_goes_wrong=(
            "CollectivePermute on Neuron needs pairs that form closed rings over directly "
            "linked NeuronCores; an open chain (a pipeline's 0 -> 1 -> 2, a single send) is "
            "not supported. pytorch/xla's Neuron permute test uses a full ring on a core set "
            "'where 0 has connectivity with N' (PR 8818); NKI recommends the ring form for "
            "hardware-optimised permutes."
        ),
        library_action=(
            "check_pairs('NEURON', ...) raises ValueError for open chains, naming the pair that "
            "closes each chain into a ring; collective_permute calls it on the native backend; "
            "requires_complete_rings('NEURON') is True, and the shift/pipeline helpers close "
            "chains themselves and discard the wrapped values."
        ),
        sources=(
            f"{_PT_XLA}/pull/8818",
            f"{_PT_XLA}/blob/v2.9.0/test/test_mp_collective_permute.py",
            f"{_NEURON_DOCS}/nki/api/generated/nki.collectives.collective_permute.html",
            f"{_PT_XLA}/pull/9373",
        ),
        evidence=(
            "not confirmed by a public AWS document: the rule ('only circular permute "
            "patterns') is from the project's design notes; PR 8818 confirms the connectivity "
            "requirement for its ring, and in PR 9373 an AWS engineer reports 2-rank send/recv "
            "tests passing on a Neuron device, so small open chains may run; the check is "
            "deliberately conservative"
        ),
    ),
    Caveat(
        id="neuron-inactive-ranks",
        applies_to=("NEURON",),
        severity="silent",
        summary="ranks in no pair stay inactive on Neuron; XLA says they receive zeros",
        what_goes_wrong=(
            "XLA's CollectivePermute gives every rank that is no pair's target a zero tensor. "
            "On Neuron, ranks outside the pairs do not take part, so their result is not "
            "guaranteed to be zeros."
        ),
        library_action=(
            "check_pairs('NEURON', ...) warns (HardwareWarning) and names the ranks; zero their "
            "result yourself if you use it."
        ),
        sources=("https://openxla.org/xla/operation_semantics#collectivepermute",),
        evidence=(
            "XLA's zero fill is in the operation semantics and is what the emulated backend "
            "and the reference do; the Neuron behaviour is from the project's design notes and "
            "not confirmed by a public AWS document"
        ),
    ),
    Caveat(
        id="neuron-no-64bit",
        applies_to=("NEURON",),
        severity="error",
        summary="no 64-bit dtypes in Neuron collectives",
        what_goes_wrong=(
            "Neuron collectives do not support 64-bit element types (int64, float64, ...). For "
            "all-reduce the Neuron compiler documents the integer case: the reduction runs in "
            "float32, so 32- and 64-bit integer operands are rejected (NCC_EVRF061)."
        ),
        library_action=(
            "check_pairs(..., dtype=...) warns (HardwareWarning) for a 64-bit dtype on Neuron; "
            "collective_permute passes its input's dtype. Cast to a 32-bit or 16-bit type first."
        ),
        sources=(f"{_NEURON_DOCS}/compiler/error-codes/EVRF061.html",),
        evidence=(
            "the all-reduce case is documented (NCC_EVRF061); the general rule for other "
            "collectives, permute included, is from the project's design notes and not "
            "confirmed by a public AWS document, hence a warning, not an error"
        ),
    ),
    Caveat(
        id="neuron-pin-layout-false",
        applies_to=("NEURON",),
        severity="info",
        summary="AWS's own tensor-parallel code calls the collectives with pin_layout=False",
        what_goes_wrong=(
            "NeuronX Distributed's sequence-parallel mappings call xm.all_gather and "
            "xm.reduce_scatter with pin_layout=False, and pytorch/xla set pin_layout=False for "
            "its torch.distributed process group with AWS in mind (PR 3568). Code that keeps "
            "the pinned defaults gets the all-reduce lowering of all_gather (see pin-layout)."
        ),
        library_action="This package passes pin_layout=False everywhere (see pin-layout).",
        sources=(
            "https://github.com/aws-neuron/neuronx-distributed/blob/main/src/"
            "neuronx_distributed/parallel_layers/mappings.py",
            f"{_PT_XLA}/pull/3568",
        ),
        evidence="read in the cited source; NxD's comm.py wrappers still default to True",
    ),
    Caveat(
        id="neuron-xla-training-ended",
        applies_to=("NEURON",),
        severity="info",
        summary="PyTorch 2.9 is the last PyTorch/XLA-based Neuron release for training",
        what_goes_wrong=(
            "AWS Neuron moved from PyTorch/XLA to native PyTorch (TorchNeuron) from PyTorch "
            "2.10; PyTorch 2.9 was the last PyTorch/XLA-based version, and from Neuron 2.30 "
            "PyTorch/XLA is no longer supported for training (inference continues)."
        ),
        library_action=(
            "This package pins torch and torch_xla 2.9.0; on Neuron it targets that last "
            "XLA-based release and inference on later ones."
        ),
        sources=(
            f"{_NEURON_DOCS}/about-neuron/announcements/neuron2.x/"
            "announce-transition-pytorch-trainium.html",
            f"{_NEURON_DOCS}/about-neuron/announcements/neuron2.x/"
            "announce-no-support-pytorch-xla-training.html",
        ),
        evidence="quoted from the cited AWS announcements",
    ),
    Caveat(
        id="collective-token",
        applies_to=("TPU", "NEURON", "CPU"),
        severity="performance",
        summary="torch_xla orders every collective after the previous one through a token",
        what_goes_wrong=(
            "Each xm collective takes the device's token and returns the next one, so in the "
            "native program every collective-permute depends on the one before: the two "
            "directions of a bidirectional collective-matmul step are serialised instead of "
            "using both link directions at once, and each operand is copied (a zero-valued "
            "add of the token) before it is sent. DISABLE_NUMERIC_CC_TOKEN=1, read by "
            "torch_xla's C++ runtime, turns the token off; AWS runs Neuron with it set."
        ),
        library_action=(
            "Leaves the token on (torch_xla's default keeps the collective order identical on "
            "every rank). tests/test_tracing.py shows the chain in the HLO; `bench` measures "
            "peak memory with the token on and off."
        ),
        sources=(f"{_PT_XLA}/issues/6077", f"{_PT_XLA}/issues/4912", f"{_PT_XLA}/issues/1420"),
        evidence=(
            "the dependency chain is checked on every build (tests/test_tracing.py, tutorial "
            "03); the variable name is in the installed _XLAC library; the Neuron setting is "
            "quoted from issue 6077"
        ),
    ),
    Caveat(
        id="cpu-thread-pool",
        applies_to=("CPU",),
        severity="error",
        summary="the CPU mesh hangs unless XLA_THREAD_POOL_SIZE >= the device count",
        what_goes_wrong=(
            "XLA:CPU runs the devices' programs on a thread pool sized by default to the core "
            "count; a collective blocks its thread until all participants arrive, so with "
            "fewer threads than devices the rendezvous never completes and XLA aborts."
        ),
        library_action=(
            "run_on_mesh starts the mesh in a child process with XLA_THREAD_POOL_SIZE >= n."
        ),
        sources=(),
        evidence="executed on every build in tutorial 01 (Getting started)",
    ),
    Caveat(
        id="cpu-channel-ids",
        applies_to=("CPU",),
        severity="error",
        summary="collectives without a channel id abort on the CPU mesh",
        what_goes_wrong=(
            "Every device thread compiles its own module, and XLA:CPU keys a collective's "
            "rendezvous on the channel id, or without one on the module id, which differs per "
            "thread: xm.all_reduce, xm.all_to_all and xm.collective_permute (no channel_id "
            "argument) never meet and abort. The native permute can be traced, not run."
        ),
        library_action=(
            "Every collective here carries a per-rank channel id (xla_permute.channels); "
            "collective_permute's 'auto' backend is the emulated one (channel-id all-gather "
            "and select) on CPU."
        ),
        sources=(),
        evidence="executed on every build in tutorial 01 (Getting started)",
    ),
    Caveat(
        id="gpu-removed",
        applies_to=("CUDA", "GPU"),
        severity="error",
        summary="XLA:CUDA was removed from torch_xla in 2.9",
        what_goes_wrong=(
            "The CUDA deprecation started in torch_xla 2.8; 2.9 removed the CUDA plugin, the "
            "CUDA runtime paths and the CUDA environment variables. PJRT_DEVICE=CUDA fails "
            "with 'No PjRtPlugin registered for: CUDA'."
        ),
        library_action=(
            "None: use torch_xla <= 2.8 for XLA:CUDA, or PyTorch's own CUDA collectives "
            "(torch.distributed, async tensor parallel) on GPUs."
        ),
        sources=(
            f"{_PT_XLA}/pull/9540",
            f"{_PT_XLA}/pull/9597",
            f"{_PT_XLA}/pull/9598",
            f"{_PT_XLA}/pull/9608",
        ),
        evidence=(
            "installed torch_xla 2.9.0: no CUDA entries in xla_env_vars, no _has_cuda_support "
            "in _XLAC, and PJRT_DEVICE=CUDA raises the error above"
        ),
    ),
)


def _device_type(device_type: object) -> str:
    if not isinstance(device_type, str) or not device_type.strip():
        raise TypeError(
            f"device_type must be a device type name such as 'CPU', 'TPU' or 'NEURON' "
            f"(torch_xla.runtime.device_type()), got {device_type!r}"
        )
    return device_type.strip().split("_")[0].upper()


def caveats(device_type: str | None = None) -> list[Caveat]:
    """The caveats that apply to ``device_type`` (``None``: all of them).

    >>> [c.id for c in caveats("NEURON")][:2]
    ['pin-layout', 'neuron-complete-rings']
    >>> {c.severity for c in caveats()} <= set(SEVERITIES)
    True
    """
    if device_type is None:
        return list(_CAVEATS)
    dt = _device_type(device_type)
    return [c for c in _CAVEATS if "*" in c.applies_to or dt in c.applies_to]


def requires_complete_rings(device_type: str) -> bool:
    """True when ``device_type`` runs only permutes whose pairs form closed rings (Neuron)."""
    return _device_type(device_type) == "NEURON"


_64_BIT = ("int64", "uint64", "float64", "complex128")


def check_pairs(
    device_type: str, pairs: _pairs.PairsLike, world_size: int, *, dtype: Any = None
) -> None:
    """Refuse or warn about a permute that ``device_type`` cannot run as XLA's semantics say.

    ``pairs`` are global ``(source, target)`` rank pairs over ``world_size`` ranks (first
    checked with :func:`xla_permute.pairs.check_pairs`); ``dtype`` is the tensor's dtype, if
    known. Empty pairs issue no collective and are always fine.

    Raises:
        TypeError, ValueError: invalid pairs (see :func:`xla_permute.pairs.check_pairs`).
        ValueError: on Neuron, pairs with an open chain; the message names the pair that
            closes each chain into a ring.

    Warns:
        HardwareWarning: on Neuron, ranks in no pair (not guaranteed zeros there) and 64-bit
        dtypes.

    >>> check_pairs("NEURON", [(0, 1), (1, 0), (2, 3), (3, 2)], 4)   # two rings: fine
    """
    dt = _device_type(device_type)
    checked = _pairs.check_pairs(pairs, world_size)
    if not checked or dt != "NEURON":
        return
    chains = _pairs.decompose(checked).chains
    if chains:
        fixes = "; ".join(
            f"add pair ({c[-1]}, {c[0]}) and discard the value rank {c[0]} then receives"
            for c in chains
        )
        paths = ", ".join(" -> ".join(map(str, c)) for c in chains)
        raise ValueError(
            f"pairs {list(checked)} form an open chain {paths}: {dt} runs only permutes whose "
            f"pairs form complete rings. Close each chain into a ring: {fixes} (instead of "
            f"zeros)."
        )
    covered = {r for p in checked for r in p}
    idle = [r for r in range(world_size) if r not in covered]
    if idle:
        warnings.warn(
            f"ranks {idle} are in no pair of {list(checked)}: XLA gives them zeros, but on "
            f"{dt} ranks outside the pairs stay inactive and their result is not guaranteed "
            f"to be zeros; zero it yourself on those ranks if you use it",
            HardwareWarning,
            stacklevel=2,
        )
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    if name in _64_BIT:
        warnings.warn(
            f"dtype {name} is 64-bit: {dt} collectives do not support 64-bit element types; "
            f"cast first, e.g. x.to(torch.{'int32' if 'int' in name else 'float32'})",
            HardwareWarning,
            stacklevel=2,
        )


# --------------------------------------------------------------------------- detection


@dataclass(frozen=True)
class Environment:
    """What :func:`detect` found.

    ``device_count`` is the runtime's count when the XLA runtime is running in this process,
    else what the configuration implies (``CPU_NUM_DEVICES``, TPU chips on the PCI bus,
    ``NEURON_RT_VISIBLE_CORES``), or None when unknown. ``source`` says which:
    ``"runtime"``, ``"PJRT_DEVICE"`` (set by the user) or ``"torch_xla default"`` (chosen by
    torch_xla at import). ``variables`` holds the relevant environment variables that are set.
    """

    device_type: str
    device_count: int | None
    torch_version: str | None
    torch_xla_version: str | None
    tpu_generation: str | None
    source: str
    runtime_initialized: bool
    variables: dict[str, str] = field(default_factory=dict)

    def format(self) -> str:
        """Plain-text lines for ``python -m xla_permute doctor``."""
        count = "unknown" if self.device_count is None else str(self.device_count)
        lines = [
            f"device type:       {self.device_type} (from {self.source})",
            f"device count:      {count}",
            f"torch:             {self.torch_version}",
            f"torch_xla:         {self.torch_xla_version}",
            f"TPU generation:    {self.tpu_generation or '-'}",
            f"runtime started:   {self.runtime_initialized}",
        ]
        lines += [f"  {k}={v}" for k, v in sorted(self.variables.items())]
        return "\n".join(lines)


_VARIABLES = (
    "PJRT_DEVICE",
    "CPU_NUM_DEVICES",
    "XLA_THREAD_POOL_SIZE",
    "XLA_USE_SPMD",
    "ENABLE_COLLECTIVE_MATMUL_IN_MP",
    "LIBTPU_INIT_ARGS",
    "XLA_FLAGS",
    "TPU_ACCELERATOR_TYPE",
    "NEURON_RT_VISIBLE_CORES",
)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _core_list(spec: str) -> int | None:
    """Count cores in a NEURON_RT_VISIBLE_CORES value such as ``0-3`` or ``0,2,4-7``."""
    count = 0
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            return None
        lo, hi = int(m[1]), int(m[2] or m[1])
        count += hi - lo + 1
    return count


def _tpu_generation(tpu: Any, chips: int) -> str | None:
    accelerator = os.environ.get("TPU_ACCELERATOR_TYPE")
    if accelerator:
        return accelerator.split("-")[0]
    if chips == 0:
        return None
    try:  # on a TPU VM: the metadata server
        return str(tpu.get_tpu_type())
    except Exception:
        return None


def detect() -> Environment:
    """Detect the device type, device count, versions and TPU generation, safely.

    Never starts the XLA runtime, so :func:`~xla_permute.launch.run_on_mesh` still works
    afterwards. It imports ``torch_xla`` (which does not start the runtime, but, like any
    import of torch_xla, sets ``PJRT_DEVICE`` by torch_xla's default rule when unset: TPU if
    libtpu and a TPU chip are found, NEURON if libneuronxla is, else CPU) and reads the
    configuration. When the runtime is already running here (inside a mesh rank, say), it
    asks the runtime instead.

    >>> env = detect()
    >>> env.device_type in {"CPU", "TPU", "NEURON"} and env.torch_xla_version is not None
    True
    """
    preset = os.environ.get("PJRT_DEVICE")
    previous = logging.root.manager.disable
    quiet = "torch_xla" not in sys.modules and previous < logging.WARNING
    if quiet:  # torch_xla logs its default choice at import; ``source`` reports it instead
        logging.disable(logging.WARNING)
    try:
        import torch_xla
        import torch_xla._internal.tpu as tpu
    except ImportError:
        return Environment(
            device_type=_device_type(preset) if preset else "UNKNOWN",
            device_count=None,
            torch_version=_version("torch"),
            torch_xla_version=None,
            tpu_generation=None,
            source="PJRT_DEVICE" if preset else "torch_xla not installed",
            runtime_initialized=False,
            variables={k: os.environ[k] for k in _VARIABLES if k in os.environ},
        )
    finally:
        if quiet:
            logging.disable(previous)
    running = bool(torch_xla._XLAC._xla_runtime_is_initialized())
    device_type = _device_type(os.environ.get("PJRT_DEVICE") or "UNKNOWN")
    chips = tpu.num_available_chips() if device_type == "TPU" else 0
    generation = _tpu_generation(tpu, chips) if device_type == "TPU" else None
    count: int | None = None
    if running:
        import torch_xla.runtime as xr

        count = xr.global_runtime_device_count()
    elif device_type == "CPU":
        count = int(os.environ.get("CPU_NUM_DEVICES") or 1)
    elif device_type == "TPU" and chips:
        count = chips * (2 if generation in ("v2", "v3") else 1)
    elif device_type == "NEURON" and os.environ.get("NEURON_RT_VISIBLE_CORES"):
        count = _core_list(os.environ["NEURON_RT_VISIBLE_CORES"])
    return Environment(
        device_type=device_type,
        device_count=count,
        torch_version=_version("torch"),
        torch_xla_version=getattr(torch_xla, "__version__", None) or _version("torch_xla"),
        tpu_generation=generation,
        source="runtime" if running else ("PJRT_DEVICE" if preset else "torch_xla default"),
        runtime_initialized=running,
        variables={k: os.environ[k] for k in _VARIABLES if k in os.environ},
    )


# --------------------------------------------------------------------------- pin_layout


@dataclass(frozen=True)
class CollectiveSignature:
    """What an upstream ``xm`` collective accepts: its ``pin_layout`` default (None: no such
    argument) and whether it takes ``channel_id`` and ``use_global_device_ids``."""

    name: str
    pin_layout_default: bool | None
    takes_channel_id: bool
    takes_use_global_device_ids: bool


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_broadcast",
    "collective_permute",
)


def collective_signatures() -> list[CollectiveSignature]:
    """Read the installed ``torch_xla.core.xla_model`` collectives' signatures.

    >>> sigs = {s.name: s for s in collective_signatures()}
    >>> sigs["all_gather"].pin_layout_default, sigs["collective_permute"].pin_layout_default
    (True, None)
    """
    import inspect

    import torch_xla.core.xla_model as xm

    out = []
    for name in _COLLECTIVES:
        params = inspect.signature(getattr(xm, name)).parameters
        pin = params.get("pin_layout")
        out.append(
            CollectiveSignature(
                name=name,
                pin_layout_default=None if pin is None else bool(pin.default),
                takes_channel_id="channel_id" in params,
                takes_use_global_device_ids="use_global_device_ids" in params,
            )
        )
    return out


# --------------------------------------------------------------------------- TPU recipe

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
        if isinstance(channel_id, bool) or not isinstance(channel_id, int) or channel_id < 1:
            raise ValueError(
                f"channel_id must be a positive int, the same on every rank and distinct per "
                f"collective in a program (xla_permute.channels.next_channel_id()); got "
                f"{channel_id!r}"
            )
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

    >>> setup = tpu_collective_matmul_setup(overlap=False)
    >>> setup.env, setup.collective_kwargs
    ({'ENABLE_COLLECTIVE_MATMUL_IN_MP': '1'}, {'pin_layout': False, 'use_global_device_ids': True})
    """
    env = {_ENABLE_CM: "1"}
    flags = list(_OVERLAP_FLAGS) if overlap else []
    if windowed_einsum_threshold_mib is not None:
        if isinstance(windowed_einsum_threshold_mib, bool) or windowed_einsum_threshold_mib < 0:
            raise ValueError(
                f"windowed_einsum_threshold_mib must be an int >= 0 (MiB), got "
                f"{windowed_einsum_threshold_mib!r}"
            )
        threshold = windowed_einsum_threshold_mib
        flags.append(f"--xla_jf_spmd_threshold_for_windowed_einsum_mib={threshold}")
    if flags:
        env["LIBTPU_INIT_ARGS"] = " ".join(flags)
    if dump_dir is not None:
        env["XLA_FLAGS"] = f"--xla_dump_to={os.fspath(dump_dir)} --xla_dump_hlo_as_text"
    return TpuCollectiveMatmulSetup(
        env=env,
        collective_kwargs={"pin_layout": False, "use_global_device_ids": True},
        dump_dir=None if dump_dir is None else os.fspath(dump_dir),
    )


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
    from xla_permute.hlo import parse

    ops = Counter(i.opcode.removesuffix("-start") for i in parse(text).instructions.values())
    return Counter({k: ops[k] for k in _COUNTED})


def read_dump(dump_dir: str | Path) -> list[DumpReport]:
    """Read an XLA dump directory (``--xla_dump_to`` with ``--xla_dump_hlo_as_text``).

    Pairs each module's ``*before_optimizations.txt`` with its ``*after_optimizations.txt``
    (XLA:CPU writes ``cpu_after_optimizations.txt``) and counts collectives, dots and loops.
    """
    root = Path(dump_dir)
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


# --------------------------------------------------------------------------- mesh evidence


def pin_layout_hlo() -> dict[str, str]:
    """Rank function: the HLO of a pinned and an unpinned all-gather and of a native permute.

    Each is traced in a program of its own (the collective token is reset in between) and
    nothing is executed: the pinned all-gather lowers to an all-reduce without a channel id,
    which would abort on the CPU mesh.
    """
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    n, device = xr.world_size(), torch_xla.device()
    world = [list(range(n))]
    ops: dict[str, Any] = {
        "pinned all-gather": lambda x: xm.all_gather(
            x, dim=0, groups=world, pin_layout=True, channel_id=1, use_global_device_ids=True
        ),
        "unpinned all-gather": lambda x: xm.all_gather(
            x, dim=0, groups=world, pin_layout=False, channel_id=1, use_global_device_ids=True
        ),
        "collective-permute": lambda x: xm.collective_permute(
            x, [[r, (r + 1) % n] for r in range(n)]
        ),
    }
    from xla_permute.tracing import discard_traced_collectives

    out = {}
    for name, op in ops.items():
        discard_traced_collectives()  # each program holds its own collective only
        x = torch.full((2, 3), float(xr.global_ordinal()), device=device)
        out[name] = torch_xla._XLAC._get_xla_tensors_hlo([op(x)])
    discard_traced_collectives()
    return out


def _gather_matmul(xs: Any, ws: Any) -> Any:
    """``AllGather(x, 0) @ w`` with an unpinned all-gather with a channel id; one program."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute.channels import next_channel_id

    n, r, device = xr.world_size(), xr.global_ordinal(), torch_xla.device()
    gathered = xm.all_gather(
        xs[r].to(device),
        dim=0,
        groups=[list(range(n))],
        pin_layout=False,
        channel_id=next_channel_id(),
        use_global_device_ids=True,
    )
    y = gathered @ ws[r].to(device)
    xm.mark_step()
    return y


def flag_read_once(xs: Any, ws: Any) -> Any:
    """Rank function: compile once, then set ``ENABLE_COLLECTIVE_MATMUL_IN_MP=1`` and run an
    all-gather-matmul (``xs``, ``ws``: virtual-mesh inputs, leading axis = rank).

    On CPU the flag makes a compile fail (TPU-only options); this one succeeds because torch_xla
    read the flag at the process's first compile, before any rank set it. Returns the product.
    """
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    warm = torch.ones(2, device=torch_xla.device()) * 2
    xm.mark_step()  # a compile: by its end torch_xla has read the flag (still unset)
    os.environ[_ENABLE_CM] = "1"  # every rank thread sets it after its own first compile
    del warm
    return _gather_matmul(xs, ws)


def compile_with_flag(xs: Any, ws: Any) -> Any:
    """Rank function: the all-gather-matmul of :func:`flag_read_once`, nothing before it (for a
    mesh launched with the flag set: on CPU its compile fails)."""
    return _gather_matmul(xs, ws)
