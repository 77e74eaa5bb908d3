"""The hardware rules (xla_permute.hardware) and the workshop's caveat catalog, environment
detection and TPU recipe (xla_permute_tools.catalog, .environment, .tpu), without a mesh.

Bad arguments of each public function are parametrised tables (``_BAD_*``): each names the
argument the error message must name.

The mesh evidence behind the caveats (HLO of pinned and unpinned collectives, the flag read at
the first compile, XLA dumps) runs in tutorials/13_hardware_caveats.md.
"""

import os
import warnings

import pytest
import torch

from xla_permute import hardware
from xla_permute.hardware import HardwareWarning, check_device_pairs, requires_complete_rings
from xla_permute_tools import catalog, environment, tpu
from xla_permute_tools.catalog import caveats

# ------------------------------------------------------------------------------------ caveats


def test_every_caveat_is_complete_and_sourced():
    ids = [c.id for c in caveats()]
    assert len(ids) == len(set(ids))
    for c in caveats():
        assert c.severity in catalog.SEVERITIES, c.id
        assert c.applies_to and c.summary and c.what_goes_wrong and c.library_action, c.id
        assert all(url.startswith("https://") for url in c.sources), c.id
        # every claim is cited or executed here: no sources means a tutorial runs it
        assert c.sources or "tutorial" in c.evidence, c.id
        assert c.id in c.format() and all(url in c.format() for url in c.sources)


SPMD = ("spmd-manual-collectives", "spmd-roll-all-gather")


@pytest.mark.parametrize(
    "device_type, required",
    [
        (
            "TPU",
            {
                "tpu-collective-matmul-flag",
                "tpu-libtpu-overlap-flags",
                "pin-layout",
                "collective-token",
                *SPMD,
            },
        ),
        (
            "NEURON",
            {
                "neuron-complete-rings",
                "neuron-inactive-ranks",
                "neuron-no-64bit",
                "neuron-pin-layout-false",
                "neuron-xla-training-ended",
                "pin-layout",
                "collective-token",
                *SPMD,
            },
        ),
        (
            "CPU",
            {
                "cpu-thread-pool",
                "cpu-channel-ids",
                "param-aliasing-deadlock",
                "empty-sync-device-lock",
                "compile-skew-rendezvous",
                "pin-layout",
                "collective-token",
                *SPMD,
            },
        ),
        ("CUDA", {"gpu-removed", "pin-layout"}),
    ],
)
def test_caveats_cover_the_issue_list(device_type, required):
    assert {c.id for c in caveats(device_type)} == required | {"torch-compile"}


def test_collective_matmul_caveat_names_the_collective_arguments():
    (flag,) = [c for c in caveats("TPU") if c.id == "tpu-collective-matmul-flag"]
    for needed in ("pin_layout=False", "channel_id", "use_global_device_ids=True", "once"):
        assert needed in flag.what_goes_wrong


def test_caveats_as_table_rows():
    cpu = caveats("CPU")
    names, rows = catalog.caveat_rows(cpu, ("id", "severity", "sources"))
    assert names == ["id", "severity", "sources"] and len(rows) == len(cpu)
    (pin,) = [row for row in rows if row[0] == "`pin-layout`"]
    assert "[pytorch/xla#3511](https://github.com/pytorch/xla/pull/3511)" in pin[2]
    one = next(c for c in cpu if c.id == "spmd-manual-collectives").rows()
    assert [label for label, _ in one] == [
        "summary",
        "what goes wrong",
        "this package",
        "evidence",
        "sources",
    ]
    assert all(text.strip() for _, text in one)
    with pytest.raises(ValueError, match="columns must be Caveat fields"):
        catalog.caveat_rows(cpu, ("id", "severty"))


def test_caveat_device_type_names():
    assert caveats("neuron") == caveats("NEURON") == caveats(" NEURON_0")
    assert not [c for c in caveats("TPU") if c.id.startswith(("neuron", "cpu", "gpu"))]
    assert caveats("GPU") == caveats("CUDA")
    named = {t for c in caveats() for t in c.applies_to} - {"*"}
    assert set(catalog.DEVICE_TYPES) == named  # every known type has caveats, and only those


_BAD_DEVICE_TYPES = [
    (3, TypeError, "device_type must be"),
    (None, TypeError, "device_type must be"),
    ("", ValueError, "blank string"),
    ("  ", ValueError, "blank string"),
    ("NUERON", ValueError, r"'NUERON' is not a device type .* CPU, TPU, NEURON, CUDA, GPU"),
    ("XPU", ValueError, "'XPU' is not a device type"),
]


@pytest.mark.parametrize("bad, error, match", _BAD_DEVICE_TYPES)
def test_caveats_reject_unknown_device_types(bad, error, match):
    if bad is None:  # caveats(None) means all of them; the rules need a name
        with pytest.raises(error, match=match):
            requires_complete_rings(bad)
        return
    with pytest.raises(error, match=match):
        caveats(bad)


@pytest.mark.parametrize("bad, error, match", [b for b in _BAD_DEVICE_TYPES if b[0] is not None])
def test_cli_rejects_bad_device_types_with_status_2(bad, error, match, capsys):
    from xla_permute_tools.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["doctor", "--device-type", str(bad), "--no-self-test"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m xla_permute doctor: error: argument --device-type:")
    assert "Traceback" not in "".join(err)


def test_requires_complete_rings():
    assert requires_complete_rings("NEURON") and requires_complete_rings("neuron")
    assert not requires_complete_rings("TPU") and not requires_complete_rings("CPU")
    assert not requires_complete_rings("MYPLUGIN")  # a PJRT plugin without rules here
    for bad, error in ((" ", ValueError), (3, TypeError)):
        with pytest.raises(error, match="device_type must"):
            requires_complete_rings(bad)


# -------------------------------------------------------------------------------- pair checks


def _no_warnings(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_device_pairs(*args, **kwargs)


def test_rings_are_fine_on_neuron():
    _no_warnings("NEURON", [(0, 1), (1, 2), (2, 3), (3, 0)], 4)
    _no_warnings("NEURON", [(0, 1), (1, 0), (2, 3), (3, 2)], 4, dtype=torch.bfloat16)
    _no_warnings("NEURON", [(0, 0), (1, 1)], 2)  # self pairs are cycles of length one
    _no_warnings("NEURON", [], 4)  # no collective is issued


def test_open_chain_is_refused_on_neuron_with_the_fix():
    with pytest.raises(ValueError, match=r"open chain 0 -> 1 -> 2 -> 3") as e:
        check_device_pairs("NEURON", [(0, 1), (1, 2), (2, 3)], 4)
    assert "add pair (3, 0) and discard the value rank 0" in str(e.value)
    with pytest.raises(ValueError) as e:
        check_device_pairs("NEURON", [(0, 1), (2, 3)], 4)
    assert "add pair (1, 0)" in str(e.value) and "add pair (3, 2)" in str(e.value)


def test_idle_ranks_and_64_bit_warn_on_neuron():
    with pytest.warns(HardwareWarning, match=r"ranks \[2, 3\] are in no pair"):
        check_device_pairs("NEURON", [(0, 1), (1, 0)], 4)
    for dtype in (torch.int64, torch.float64, "int64"):
        with pytest.warns(HardwareWarning, match="64-bit"):
            check_device_pairs("NEURON", [(0, 1), (1, 0)], 2, dtype=dtype)
    assert issubclass(HardwareWarning, UserWarning)


@pytest.mark.parametrize("device_type", ["CPU", "TPU"])
def test_other_backends_run_any_partial_permutation(device_type):
    _no_warnings(device_type, [(0, 1), (1, 2)], 4, dtype=torch.int64)


_BAD_WORLD_SIZES = [
    ("4", TypeError, "world_size must be an int >= 1"),
    (4.0, TypeError, "world_size must be an int >= 1"),
    (None, TypeError, "world_size must be an int >= 1"),
    (True, TypeError, "world_size must be an int >= 1"),
    (0, ValueError, "world_size must be an int >= 1, got 0; the number of ranks"),
    (-2, ValueError, "world_size must be an int >= 1, got -2"),
]


@pytest.mark.parametrize("device_type", ["CPU", "NEURON"])
@pytest.mark.parametrize("bad, error, match", _BAD_WORLD_SIZES)
def test_check_device_pairs_rejects_bad_world_sizes(device_type, bad, error, match):
    for pairs in ([(0, 1), (1, 0)], []):  # checked even when no collective would be issued
        with pytest.raises(error, match=match):
            check_device_pairs(device_type, pairs, bad)


def test_check_device_pairs_takes_numpy_world_sizes():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="open chain"):
        check_device_pairs("NEURON", [(0, 1)], np.int64(2))


@pytest.mark.parametrize("device_type", ["CPU", "TPU", "NEURON"])
def test_invalid_pairs_raise_everywhere(device_type):
    with pytest.raises(ValueError, match="duplicate target 1"):
        check_device_pairs(device_type, [(0, 1), (2, 1)], 4)
    with pytest.raises(ValueError, match="outside the group of 2"):
        check_device_pairs(device_type, [(0, 2)], 2)


class _FakeXlaTensor(torch.Tensor):
    """A CPU tensor that reports an XLA device, so no XLA runtime starts in this process."""

    @property
    def device(self):
        return torch.device("xla", 0)


def test_collective_permute_consults_the_hardware_rules(monkeypatch):
    import torch_xla.runtime as xr

    from xla_permute import collective_permute

    monkeypatch.setattr(xr, "world_size", lambda: 4)
    monkeypatch.setattr(xr, "device_type", lambda: "NEURON")
    x = torch.Tensor._make_subclass(_FakeXlaTensor, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"NEURON runs only .* add pair \(1, 0\)"):
        collective_permute(x, [(0, 1)], backend="native")
    with pytest.raises(ValueError, match=r"add pair \(1, 0\)"):  # group-local pairs, globalised
        collective_permute(x, [(0, 1)], groups=[[0, 1], [2, 3]], backend="native")


# ---------------------------------------------------------------------------------- detection


def _clean_env(monkeypatch, **values):
    for key in environment._VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def test_detect_cpu_from_the_configuration(monkeypatch):
    import torch_xla

    _clean_env(monkeypatch, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="3")
    env = environment.detect()
    assert (env.device_type, env.device_count, env.source) == ("CPU", 3, "PJRT_DEVICE")
    assert env.torch_xla_version == torch_xla.__version__
    assert env.torch_version == torch.__version__.split("+")[0]
    assert env.variables == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "3"}
    assert not env.runtime_initialized
    assert not torch_xla._XLAC._xla_runtime_is_initialized()  # run_on_mesh still works
    assert "CPU (from PJRT_DEVICE)" in env.format()
    assert not env.spmd and "SPMD mode:         off" in env.format()


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("0", False)])
def test_detect_spmd_mode_as_torch_xla_reads_it(monkeypatch, value, on):
    import torch_xla.runtime as xr

    _clean_env(monkeypatch, PJRT_DEVICE="CPU", XLA_USE_SPMD=value)
    env = environment.detect()
    assert env.spmd is on is hardware.spmd_mode() is xr.is_spmd()
    assert ("SPMD mode:         on (xr.use_spmd())" in env.format()) is on


def test_every_op_is_refused_in_spmd_mode_naming_it_and_the_fix():
    hardware.check_not_spmd("all_gather_matmul", {"XLA_USE_SPMD": "0"})
    with pytest.raises(ValueError, match=r"all_gather_matmul cannot run in torch_xla's SPMD") as e:
        hardware.check_not_spmd("all_gather_matmul", {"XLA_USE_SPMD": "1"})
    for fix in ("without use_spmd()", "run_on_mesh", "xr.world_size() is 1", "aborts"):
        assert fix in str(e.value)


def test_detect_tpu_generation_and_neuron_cores(monkeypatch):
    import torch_xla._internal.tpu as torch_xla_tpu

    _clean_env(monkeypatch, PJRT_DEVICE="TPU", TPU_ACCELERATOR_TYPE="v5litepod-8")
    env = environment.detect()
    assert (env.device_type, env.tpu_generation) == ("TPU", "v5litepod")
    assert env.device_count == (torch_xla_tpu.num_available_chips() or None)
    _clean_env(monkeypatch, PJRT_DEVICE="NEURON", NEURON_RT_VISIBLE_CORES="0-3,8")
    env = environment.detect()
    assert (env.device_type, env.device_count, env.tpu_generation) == ("NEURON", 5, None)
    _clean_env(monkeypatch, PJRT_DEVICE=" ")  # blank: reported, not raised
    assert environment.detect().device_type == "UNKNOWN"


def test_collective_signatures_of_the_installed_torch_xla():
    sigs = {s.name: s for s in environment.collective_signatures()}
    assert sigs["collective_permute"].pin_layout_default is None
    pinned = {name for name, s in sigs.items() if s.pin_layout_default}
    assert pinned == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "collective_broadcast",
    }
    assert {n for n, s in sigs.items() if s.takes_channel_id} == {"all_gather", "reduce_scatter"}


# ---------------------------------------------------------------------------------- TPU recipe


def test_tpu_setup_as_data():
    setup = tpu.tpu_collective_matmul_setup(dump_dir="/tmp/d", windowed_einsum_threshold_mib=0)
    assert setup.env["ENABLE_COLLECTIVE_MATMUL_IN_MP"] == "1"
    flags = setup.env["LIBTPU_INIT_ARGS"].split()
    assert "--xla_enable_async_collective_permute=true" in flags
    assert "--xla_jf_spmd_threshold_for_windowed_einsum_mib=0" in flags
    assert setup.env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_dump_hlo_as_text"
    assert setup.kwargs(2, [[0, 1, 2, 3]]) == {
        "pin_layout": False,
        "use_global_device_ids": True,
        "channel_id": 2,
        "groups": [[0, 1, 2, 3]],
    }
    for bad, error in ((0, ValueError), (-1, ValueError), (True, TypeError), ("1", TypeError)):
        with pytest.raises(error, match="channel_id must be an int >= 1, got .*same on every rank"):
            setup.kwargs(bad, [[0, 1]])
    assert "XLA_FLAGS" not in tpu.tpu_collective_matmul_setup().env
    from pathlib import Path

    assert tpu.tpu_collective_matmul_setup(dump_dir=Path("/tmp/d")).dump_dir == "/tmp/d"


_BAD_TPU_SETUPS = [
    ({"windowed_einsum_threshold_mib": "8"}, TypeError, "windowed_einsum_threshold_mib must"),
    ({"windowed_einsum_threshold_mib": 8.0}, TypeError, "windowed_einsum_threshold_mib must"),
    ({"windowed_einsum_threshold_mib": True}, TypeError, "windowed_einsum_threshold_mib must"),
    ({"windowed_einsum_threshold_mib": -1}, ValueError, "windowed_einsum_threshold_mib must"),
    ({"dump_dir": 3}, TypeError, "dump_dir must be a directory path"),
    ({"dump_dir": b"/tmp/d"}, TypeError, "dump_dir must be a directory path"),
    ({"dump_dir": ""}, ValueError, "dump_dir must be a non-empty"),
    ({"dump_dir": "/tmp/my dumps"}, ValueError, "dump_dir .* contains whitespace"),
    ({"overlap": 1}, TypeError, "overlap must be True or False"),
    ({"overlap": "yes"}, TypeError, "overlap must be True or False"),
]


@pytest.mark.parametrize("kwargs, error, match", _BAD_TPU_SETUPS)
def test_tpu_setup_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        tpu.tpu_collective_matmul_setup(**kwargs)


def test_tpu_setup_apply_merges_flags_and_problems_reports():
    setup = tpu.tpu_collective_matmul_setup()
    environ = {
        "PJRT_DEVICE": "TPU",
        "LIBTPU_INIT_ARGS": "--xla_enable_async_collective_permute=false --xla_other=1",
    }
    assert any("ENABLE_COLLECTIVE_MATMUL_IN_MP is unset" in p for p in setup.problems(environ))
    setup.apply(environ)
    flags = environ["LIBTPU_INIT_ARGS"].split()
    assert flags[:2] == ["--xla_enable_async_collective_permute=false", "--xla_other=1"]
    assert len(flags) == 2 + len(tpu._OVERLAP_FLAGS) - 1  # the user's own value kept
    assert environ["ENABLE_COLLECTIVE_MATMUL_IN_MP"] == "1"
    problems = setup.problems(environ)
    assert problems == ["LIBTPU_INIT_ARGS lacks --xla_enable_async_collective_permute=true"]
    assert "not TPU" in setup.problems({**environ, "PJRT_DEVICE": "CPU"})[0]


def test_tpu_setup_refuses_after_the_first_compile(monkeypatch):
    monkeypatch.setattr(tpu, "_compiled_in_this_process", lambda: True)
    setup = tpu.tpu_collective_matmul_setup()
    with pytest.raises(RuntimeError, match="before the first compile"):
        setup.apply()
    assert "ENABLE_COLLECTIVE_MATMUL_IN_MP" not in os.environ
    assert any("compiled already" in p for p in setup.problems({"PJRT_DEVICE": "TPU"}))


_BEFORE = """HloModule m
ENTRY %main (p0: f32[2,3], p1: f32[3,4]) -> f32[8,4] {
  %p0 = f32[2,3]{1,0} parameter(0)
  %p1 = f32[3,4]{1,0} parameter(1)
  %all-gather.1 = f32[8,3]{1,0} all-gather(f32[2,3]{1,0} %p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  ROOT %dot.2 = f32[8,4]{1,0} dot(f32[8,3]{1,0} %all-gather.1, f32[3,4]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""  # noqa: E501
_REWRITTEN = """HloModule m
%body (t: (f32[2,3])) -> (f32[2,3]) {
  %t = (f32[2,3]{1,0}) parameter(0)
  %x = f32[2,3]{1,0} get-tuple-element((f32[2,3]{1,0}) %t), index=0
  %collective-permute-start.1 = (f32[2,3]{1,0}, f32[2,3]{1,0}) collective-permute-start(f32[2,3]{1,0} %x), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %r = (f32[2,3]{1,0}) tuple(f32[2,3]{1,0} %x)
}
ENTRY %main (p0: f32[2,3]) -> (f32[2,3]) {
  %p0 = f32[2,3]{1,0} parameter(0)
  %tuple = (f32[2,3]{1,0}) tuple(f32[2,3]{1,0} %p0)
  ROOT %decomposed_all_gather_while = (f32[2,3]{1,0}) while((f32[2,3]{1,0}) %tuple), body=%body
}
"""  # noqa: E501


def test_read_dump_tells_rewritten_from_not(tmp_path):
    (tmp_path / "module_0000.g.1.before_optimizations.txt").write_text(_BEFORE)
    (tmp_path / "module_0000.g.1.tpu_after_optimizations.txt").write_text(_REWRITTEN)
    (tmp_path / "module_0001.g.1.before_optimizations.txt").write_text(_BEFORE)
    (tmp_path / "module_0001.g.1.cpu_after_optimizations.txt").write_text(_BEFORE)
    (tmp_path / "module_0002.g.1.before_optimizations.txt").write_text(_BEFORE)  # no after
    rewritten, kept = tpu.read_dump(tmp_path)
    assert (rewritten.module, kept.module) == ("module_0000.g.1", "module_0001.g.1")
    assert rewritten.rewritten and not kept.rewritten
    assert rewritten.after["collective-permute"] == 1 and rewritten.after["while"] == 1
    assert rewritten.decomposed == ("decomposed_all_gather_while",)
    assert kept.after["all-gather"] == kept.before["all-gather"] == 1 and kept.after["dot"] == 1


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (3, TypeError, "dump_dir must be a directory path"),
        ("/nonexistent/xla", FileNotFoundError, "is not a directory"),
    ],
)
def test_read_dump_rejects_what_is_not_a_directory(bad, error, match, tmp_path):
    with pytest.raises(error, match=match):
        tpu.read_dump(bad)
    assert tpu.read_dump(tmp_path) == []  # an empty dump: no module compiled yet


# ------------------------------------------------------------------------------------ layering


def _package_imports(module) -> set[str]:
    """The ``xla_permute`` modules a module imports anywhere (top level or in a function)."""
    import ast
    import inspect

    found = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.module == "xla_permute":
            found.update(f"xla_permute.{a.name}" for a in node.names)  # from xla_permute import x
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("xla_permute")}


def test_the_rules_sit_below_the_ops():
    """The rules need pairs only (the ops import them); the workshop's caveat modules read the
    library through its namespace, its rules and pairs only."""
    from xla_permute_tools import caveat, known_caveats

    assert _package_imports(hardware) == {"xla_permute.pairs"}
    library = {"xla_permute", "xla_permute.hardware", "xla_permute.pairs"}
    for module in (caveat, catalog, environment, known_caveats, tpu):
        found = {m for m in _package_imports(module) if not m.startswith("xla_permute_tools")}
        assert found <= library, module.__name__


@pytest.mark.parametrize("name", ["native", "emulated"])
def test_the_xla_backends_refuse_spmd_mode_before_asking_the_runtime(monkeypatch, name):
    """Every op finds its place through the backend: in SPMD mode that raises, first."""
    import torch_xla

    from xla_permute.backends.xla import xla_backend

    monkeypatch.setenv("XLA_USE_SPMD", "1")
    for place in (xla_backend(name).world_size, xla_backend(name).rank):
        with pytest.raises(ValueError, match="cannot run in torch_xla's SPMD mode"):
            place()
    assert not torch_xla._XLAC._xla_runtime_is_initialized()  # refused before the runtime
