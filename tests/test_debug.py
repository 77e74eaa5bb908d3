"""The debug mode on the host: switching it, the signature, the message; the bench CLI check.

On the mesh, every disagreement is in tests/test_reliability.py.
"""

from __future__ import annotations

import re
import threading
import zlib

import pytest

from xla_permute import debug
from xla_permute.debug import describe_disagreement, signature, signature_length

RING, BACK = ((0, 1), (1, 2), (2, 0)), ((0, 2), (1, 0), (2, 1))


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("detail", True), ("0", False), ("", False), ("off", False)]
)
def test_environment_switch(monkeypatch, value, on):
    monkeypatch.setenv(debug.ENV, value)
    assert debug.enabled() is on
    with debug.debug_mode(not on):  # the context manager overrides the environment
        assert debug.enabled() is (not on)
    assert debug.enabled() is on


def test_bad_environment_value_and_argument(monkeypatch):
    monkeypatch.setenv(debug.ENV, "fasle")
    with pytest.raises(ValueError, match="XLA_PERMUTE_DEBUG='fasle': set it to 1"):
        debug.enabled()
    with (
        pytest.raises(TypeError, match="enabled must be True, False or one of"),
        debug.debug_mode("yes"),
    ):
        pass


def test_context_is_per_thread(monkeypatch):
    monkeypatch.setenv(debug.ENV, "0")
    seen = []
    with debug.debug_mode():
        t = threading.Thread(target=lambda: seen.append(debug.enabled()))
        t.start()
        t.join()
        assert debug.enabled()
    assert seen == [False]  # another rank (thread) is not switched on by this one


CASES = {
    "shape": ({"x.shape": (3,)}, r"x\.shape: rank 1 passes \(3,\), ranks 0, 2 pass \(2,\)"),
    "dtype": ({"x.dtype": "torch.float64"}, "x.dtype: rank 1 passes torch.float64, ranks 0, 2"),
    "pairs": ({"pairs": BACK}, r"pairs: rank 1 passes \(\(0, 2\), \(1, 0\), \(2, 1\)\), ranks"),
    "groups": ({"groups": ((0,), (1,), (2,))}, r"groups: rank 1 passes \(\(0,\), \(1,\), \(2,\)\)"),
    "backend": ({"backend": "native"}, "backend: rank 1 passes native, ranks 0, 2 pass emulated"),
    "option": ({"wrap": True}, "wrap: rank 1 passes True, ranks 0, 2 pass False"),
    "long": ({"x.shape": tuple(range(1, 30))}, r"x\.shape: rank 1 passes \(1, 2, 3, .*29\)"),
}
BASE = {
    "x.shape": (2,),
    "x.dtype": "torch.float32",
    "pairs": RING,
    "groups": ((0, 1, 2),),
    "backend": "emulated",
    "wrap": False,
}


@pytest.mark.parametrize("case", list(CASES))
def test_message_names_the_rank_and_the_difference(case):
    change, pattern = CASES[case]
    rows = [signature("op", {**BASE, **(change if r == 1 else {})}, world_size=3) for r in range(3)]
    assert {len(row) for row in rows} == {signature_length(3)}
    assert re.search(pattern, describe_disagreement("op", rows))
    assert describe_disagreement("op", [rows[0]] * 3) is None


def test_different_ops_and_field_counts_keep_one_length():
    a = signature("collective_permute", BASE, world_size=4)
    b = signature("pipeline_forward", {"inputs.shape": (2, 2)}, world_size=4)
    assert len(a) == len(b) == signature_length(4)  # the check's all-gather itself agrees
    text = describe_disagreement("collective_permute", [a, b, a, a])
    assert "rank 1 calls pipeline_forward, ranks 0, 2, 3 call collective_permute" in text


def test_signature_is_deterministic():
    assert signature("op", BASE, world_size=3) == signature("op", dict(BASE), world_size=3)
    assert signature("op", BASE, world_size=3)[1] == zlib.crc32(b"op") & (2**31 - 1)  # int32


def test_bench_json_into_a_missing_directory_fails_before_the_run(tmp_path, capsys):
    from xla_permute.__main__ import main

    assert main(["bench", "--preset", "tiny", "--json", str(tmp_path / "no" / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err


def test_signature_fits_int32():
    """The check's all-gather is int32 (Neuron takes no 64-bit collectives)."""
    row = signature("op", {"x.shape": (2**40, 3), "n": 2**33, "s": "text"}, world_size=4)
    assert all(-(2**31) <= v < 2**31 for v in row)
    assert describe_disagreement("op", [row, row]) is None


def test_a_list_of_strings_travels_as_text():
    """A field such as a list of dtype names is text, not groups of ints (it crashed)."""
    rows = [signature("op", {"dtypes": [d]}, world_size=2) for d in ("torch.float32", "torch.int8")]
    assert len(rows[0]) == len(rows[1]) == signature_length(2)
    assert describe_disagreement("op", rows).startswith("op: the ranks disagree on dtypes")
