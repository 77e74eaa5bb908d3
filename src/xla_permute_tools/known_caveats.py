"""The hardware caveats as data: what each backend does to a collective, what this package does.

Each :class:`~xla_permute_tools.caveat.Caveat` has what goes wrong, the upstream sources,
what this package does about it, and what this project checked itself (``evidence``); facts it
could not confirm in a public source say so there instead of citing one.
:func:`xla_permute_tools.catalog.caveats` lists them per device type.
"""

from __future__ import annotations

from xla_permute_tools.caveat import Caveat

__all__ = ["CAVEATS", "RENDEZVOUS_TIMEOUT"]

_PT_XLA = "https://github.com/pytorch/xla"
_MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext/blob/main"
_NEURON_DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest"
#: The message of a collective that not every rank reached in time, on XLA's CPU client.
RENDEZVOUS_TIMEOUT = (
    "Termination timeout for `... RendezvousKey{...}` of ... seconds exceeded. ... but only ... "
    "of them arrived on time."
)

#: Every caveat, in the order :func:`~xla_permute_tools.catalog.caveats` lists them.
CAVEATS: tuple[Caveat, ...] = (
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
        messages=("No such compile option: 'xla_tpu_decompose_all_gather_einsum'",),
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
        messages=(
            "HloModule has a mix of layout constrained and unconstrained AllReduce instructions",
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
            "check_device_pairs('NEURON', ...) raises ValueError for open chains, naming the "
            "pair that closes each chain into a ring; collective_permute calls it on the native "
            "backend; "
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
            "not confirmed by a public AWS document: this project assumes the rule ('only "
            "circular permute patterns') without a public source; PR 8818 confirms the "
            "connectivity requirement for its ring, and in PR 9373 an AWS engineer reports "
            "2-rank send/recv tests passing on a Neuron device, so small open chains may run; "
            "the check is deliberately conservative"
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
            "check_device_pairs('NEURON', ...) warns (HardwareWarning) and names the ranks; "
            "zero their result yourself if you use it."
        ),
        sources=("https://openxla.org/xla/operation_semantics#collectivepermute",),
        evidence=(
            "XLA's zero fill is in the operation semantics and is what the emulated backend "
            "and the reference do; the Neuron behaviour is an assumption of this project, not "
            "confirmed by a public AWS document"
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
            "check_device_pairs(..., dtype=...) warns (HardwareWarning) for a 64-bit dtype on "
            "Neuron; collective_permute passes its input's dtype. Cast to a 32-bit or 16-bit "
            "type first."
        ),
        sources=(f"{_NEURON_DOCS}/compiler/error-codes/EVRF061.html",),
        evidence=(
            "the all-reduce case is documented (NCC_EVRF061); the general rule for other "
            "collectives, permute included, is an assumption of this project, not confirmed "
            "by a public AWS document, hence a warning, not an error"
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
        evidence=(
            "executed on every build in tutorials/01_getting_started.md (How the examples run)"
        ),
        messages=(RENDEZVOUS_TIMEOUT,),
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
            "Every collective here carries a per-rank channel id (xla_permute.backends.channels); "
            "collective_permute's 'auto' backend is the emulated one (channel-id all-gather "
            "and select) on CPU."
        ),
        sources=(),
        evidence=(
            "executed on every build in tutorials/01_getting_started.md (How the examples run)"
        ),
        messages=(RENDEZVOUS_TIMEOUT,),
    ),
    Caveat(
        id="param-aliasing-deadlock",
        applies_to=("CPU",),
        severity="error",
        summary=(
            "with parameter aliasing on (XLA_ENABLE_PARAM_ALIASING=1), a training loop on a mesh "
            "of device threads can deadlock, and XLA:CPU aborts it"
        ),
        what_goes_wrong=(
            "torch_xla.sync() dispatches the step, then resets the collective token with the "
            "GIL held. The token's graph holds the inputs of the step's collectives; if it "
            "holds the last reference to a buffer donated to the step (a tensor updated in "
            "place), freeing that buffer waits for the program, which waits in a collective for "
            "a rank whose thread needs the GIL to finish tracing. XLA:CPU aborts after 15 s "
            "(Termination timeout for `all gather ...`). It needs devices that are threads of "
            "one process (the CPU mesh, torch_xla.launch on the CPU; TPU v2/v3 under xmp.spawn "
            "by the mechanism, not run here), a program XLA:CPU runs asynchronously (1000 "
            "flops or more) and ranks that reach sync at different times."
        ),
        library_action=(
            "run_on_mesh sets XLA_ENABLE_PARAM_ALIASING=0 unless the caller sets it; users of "
            "torch_xla.launch on the CPU should set it too. MeshError's message names it."
        ),
        sources=(
            f"{_PT_XLA}/blob/v2.9.0/torch_xla/torch_xla.py",
            "https://github.com/openxla/xla/blob/main/xla/pjrt/cpu/cpu_client.cc",
            f"{_PT_XLA}/pull/4504",
        ),
        evidence=(
            "a plain torch_xla reproducer runs on every build in "
            "tutorials/14_when_the_mesh_fails.md (aborts with aliasing on, passes with it off); "
            "tests/test_training_probes.py runs 132 collective + in-place update + sync probes "
            "in one launch"
        ),
        messages=(RENDEZVOUS_TIMEOUT,),
    ),
    Caveat(
        id="empty-sync-device-lock",
        applies_to=("CPU",),
        severity="error",
        summary=(
            "on a mesh of device threads, a torch_xla.sync() with nothing to run waits for "
            "rank 0's device, and a rank stuck there aborts rank 0's collective"
        ),
        what_goes_wrong=(
            "A sync whose rank holds no pending tensor (it dropped its results, or every call "
            "since its last sync was refused) collects no tensors, and torch_xla's barrier then "
            "locks a default-constructed device, CPU:0. While rank 0 executes a collective, "
            "which holds its device's lock until the collective ends, such a rank waits for that "
            "lock instead of reaching the collective; XLA:CPU aborts after 15 s. It needs "
            "devices that are threads of one process (the CPU mesh, torch_xla.launch on the "
            "CPU; TPU v2/v3 under xmp.spawn by the mechanism, not run here)."
        ),
        library_action=(
            "run_on_mesh gives every rank's sync a pending scalar on the rank's own device, so "
            "that the sync locks that device only (XLA_PERMUTE_SYNC_GUARD=0 turns it off)."
        ),
        sources=(
            f"{_PT_XLA}/blob/v2.9.0/torch_xla/csrc/xla_graph_executor.cpp",
            f"{_PT_XLA}/blob/v2.9.0/torch_xla/torch_xla.py",
        ),
        evidence=(
            "tests/test_mesh_programs.py runs a torch_xla-only reproducer (three ranks sync "
            "with nothing to run while rank 0 is in an all-gather): it aborts with the guard "
            "off and passes with it on; the same file runs a loop that drops every permute's "
            "result and 132 good and bad calls with a mark_step after each"
        ),
        messages=(RENDEZVOUS_TIMEOUT,),
    ),
    Caveat(
        id="compile-skew-rendezvous",
        applies_to=("CPU",),
        severity="error",
        summary=(
            "each rank of the CPU mesh compiles its own program, and a rank that finishes "
            "compiling more than 15 s after another aborts the mesh at the first collective"
        ),
        messages=(RENDEZVOUS_TIMEOUT,),
        what_goes_wrong=(
            "XLA:CPU matches a collective's ranks in an in-process rendezvous that gives up 15 s "
            "after the first rank arrives (hard-coded). The ranks compile the same step "
            "concurrently (or different ones, when a rank slices its data on the device); on a "
            "loaded machine the compiles of a model-sized program end tens of seconds apart: a "
            "2-layer Llama's step took 77 s on rank 0 beside three other compiles at load 6."
        ),
        library_action=(
            "the mesh's compile barrier (xla_permute.cpu_mesh.barrier, on by default, "
            "XLA_PERMUTE_COMPILE_BARRIER=0 turns it off): a rank that called a collective since "
            "its last sync compiles its step, waits for the others, then runs it, so no rank "
            "reaches a collective while another still compiles; a rank that syncs with nothing "
            "pending does not wait; one that has not come after 120 s leaves the others to go "
            "on, and the MeshError says so, with each rank's compile time. It covers "
            "torch_xla.sync() and xm.mark_step(), not a value read with .cpu() or .item() "
            "before the sync. run_on_mesh also compiles with LLVM's optimizer off "
            "(--xla_backend_optimization_level=0 unless XLA_FLAGS sets the level)."
        ),
        sources=("https://github.com/openxla/xla/blob/main/xla/service/rendezvous.cc",),
        evidence=(
            "tests/test_compile_barrier.py: a rank that reaches its sync 20 s after the others "
            "aborts the mesh with the barrier off and passes with it on; the compile times "
            "above were read from torch_xla's own log (TF_CPP_VMODULE=xla_graph_executor=4)"
        ),
    ),
    Caveat(
        id="torch-compile",
        applies_to=("*",),
        severity="error",
        summary="the ops of this package do not run under torch.compile; they refuse at once",
        messages=(
            "Failed to get computation by hash ... Maybe the entry get kicked out of the LRU cache",
        ),
        what_goes_wrong=(
            "Dynamo cannot trace the host state the ops keep per rank (channel ids, the "
            "collective token, the agreement checks: torch_xla._XLAC calls). Under "
            "torch.compile(backend='openxla') on the CPU mesh the ops aborted the mesh or every "
            "rank failed with 'Failed to get computation by hash ... LRU cache', also with the "
            "op wrapped in torch.compiler.disable."
        ),
        library_action=(
            "every public op raises CompileError on every rank before any collective, naming "
            "the op. Compile only the math around the ops, or run eagerly: torch_xla's lazy "
            "tensors compile each step into one XLA program at torch_xla.sync() anyway. On the "
            "CPU mesh, local math compiles: the device process makes "
            "torch_xla's dynamo bridge wait for the rank's own device (it waited for every "
            "device: another rank inside a collective, an abort after 15 s). torch's compiler "
            "keeps process-global state that rank threads compiling at once corrupted (an FX "
            "assertion; 'Detected that you are using FX to symbolically trace a "
            "dynamo-optimized function'): the bridge and the lazy compile of a backward take "
            "Dynamo's compile lock, after the rank's sync, and the FX tracing flag counts only "
            "for the thread that holds it."
        ),
        sources=("https://docs.pytorch.org/xla/master/perf/dynamo.html",),
        evidence=(
            "tests/test_mesh_programs.py compiles collective_permute, all_gather_matmul and "
            "ColumnParallelLinear (forward and backward) on the 4-device mesh; "
            "tests/test_compile_barrier.py trains a compiled RMSNorm and MLP before and after "
            "an all-gather for three AdamW steps, equal to eager"
        ),
    ),
    Caveat(
        id="spmd-manual-collectives",
        applies_to=("TPU", "NEURON", "CPU"),
        severity="error",
        summary=(
            "in SPMD mode, xm.collective_permute in a manual-sharding region aborts and "
            "xm.all_reduce there is dropped"
        ),
        what_goes_wrong=(
            "With xr.use_spmd() torch_xla traces one program for all devices and "
            "xr.world_size() is 1. Inside a manual-sharding region, as torch_xla's "
            "experimental _shard_map builds it (enable_manual_sharding, the function on each "
            "shard, disable_manual_sharding), an xm.all_gather with a channel_id "
            "(pin_layout=False, use_global_device_ids=True) runs over the devices; "
            "xm.collective_permute carries no channel id, so it is a cross-replica permute "
            "over a single replica and the process aborts (std::out_of_range, 'Span::at failed "
            "bounds check' on XLA:CPU); xm.all_reduce takes its world-size-1 path and returns "
            "its input unchanged, with no all-reduce in the program and no error."
        ),
        library_action=(
            "Every collective of this package refuses to run in SPMD mode "
            "(xla_permute.hardware.check_not_spmd: a ValueError naming the op and the "
            "multi-process mode that runs it), instead of seeing a world of one rank; "
            "python -m xla_permute doctor reports SPMD mode."
        ),
        sources=(
            f"{_PT_XLA}/blob/v2.9.0/torch_xla/experimental/custom_kernel.py",
            f"{_PT_XLA}/blob/v2.9.0/torch_xla/core/xla_model.py",
            f"{_PT_XLA}/blob/v2.9.0/torch_xla/runtime.py",
        ),
        evidence=(
            "executed on every build in tutorials/13_hardware_caveats.md (Hardware caveats, "
            "SPMD mode) in child processes on a 4-device CPU mesh, the abort in one of its own"
        ),
        messages=("Span::at failed bounds check",),
    ),
    Caveat(
        id="spmd-roll-all-gather",
        applies_to=("TPU", "NEURON", "CPU"),
        severity="performance",
        summary="GSPMD lowered a torch.roll of a sharded dimension to an all-gather",
        what_goes_wrong=(
            "In SPMD mode the partitioner chooses the collectives. A torch.roll along the "
            "sharded dimension of a tensor sharded over a 4-device XLA:CPU mesh compiled to "
            "one all-gather of the whole tensor and a slice, not a collective-permute: N times "
            "the bytes a ring hop sends, and the whole tensor held on every device. Not "
            "checked on a TPU by this project."
        ),
        library_action=(
            "None in SPMD mode. In the multi-process mode collective_permute issues the "
            "permute explicitly (one collective-permute on the native backend) and the rings "
            "of this package build on it."
        ),
        sources=(),
        evidence=(
            "executed on every build in tutorials/13_hardware_caveats.md (Hardware caveats, "
            "SPMD mode): the optimized program read from XLA's dump"
        ),
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
        messages=("No PjRtPlugin registered for: CUDA",),
    ),
)
