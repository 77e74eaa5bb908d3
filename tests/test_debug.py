"""The debug mode on the host: switching it, the signature, the message; the bench CLI check.

On the mesh, every disagreement is in tests/test_reliability.py.
"""

from __future__ import annotations

import re
import threading

import pytest

from xla_permute import debug
from xla_permute.debug import SIGNATURE_INTS, describe_disagreement, signature

RING, BACK = ((0, 1), (1, 2), (2, 0)), ((0, 2), (1, 0), (2, 1))


@pytest.mark.parametrize(
    ("value", "level"),
    [("1", "every"), ("every", "every"), ("0", "sampled"), ("", "sampled"), ("none", "off"),
     ("off", "off")],
)  # fmt: skip
def test_environment_switch(monkeypatch, value, level):
    monkeypatch.setenv(debug.ENV, value)
    assert debug.check_level() == level
    for other in debug.LEVELS:  # the context manager overrides the environment
        with debug.debug_mode(other):
            assert debug.check_level() == other
    with debug.debug_mode():  # the debug mode: every call
        assert debug.check_level() == "every"
    assert debug.check_level() == level


def test_bad_environment_value_and_argument(monkeypatch):
    monkeypatch.setenv(debug.ENV, "fasle")
    with pytest.raises(ValueError, match="XLA_PERMUTE_DEBUG='fasle': set it to 1"):
        debug.check_level()
    for wrong in ("yes", False, True, None):  # a level says what it means: no booleans
        with (
            pytest.raises(ValueError, match=r"debug_mode takes a level of \('every', 'sampled'"),
            debug.debug_mode(wrong),
        ):
            pass


def test_context_is_per_thread(monkeypatch):
    monkeypatch.setenv(debug.ENV, "0")
    seen = []
    with debug.debug_mode():
        t = threading.Thread(target=lambda: seen.append(debug.check_level()))
        t.start()
        t.join()
        assert debug.check_level() == "every"
    assert seen == ["sampled"]  # another rank (thread) is not switched on by this one


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
    rows = [signature("op", {**BASE, **(change if r == 1 else {})}) for r in range(3)]
    assert {len(row) for row in rows} == {SIGNATURE_INTS}
    assert re.search(pattern, describe_disagreement(rows))
    assert describe_disagreement([rows[0]] * 3) is None


def test_different_ops_and_field_counts_keep_one_length():
    a = signature("collective_permute", BASE)
    b = signature("pipeline_forward", {"inputs.shape": (2, 2)})
    assert len(a) == len(b) == SIGNATURE_INTS  # the check's all-gather itself agrees
    text = describe_disagreement([a, b, a, a])
    assert "rank 1 calls pipeline_forward, ranks 0, 2, 3 call collective_permute" in text


def test_signature_is_deterministic():
    assert signature("op", BASE) == signature("op", dict(BASE))
    assert signature("op", BASE) != signature("op", {**BASE, "wrap": True})


def test_a_long_value_is_cut_but_still_compared():
    """A value longer than MAX_VALUE is shown cut, with a checksum of the whole."""
    long = [tuple((r, (r + 1) % 400) for r in range(400)), tuple((r, r) for r in range(400))]
    rows = [signature("op", {"pairs": p}) for p in (long[0], long[1], long[0])]
    text = describe_disagreement(rows)
    assert re.search(r"^op: the ranks disagree on pairs: rank 1 passes \(\(0, 0\), .*\.\.\. "
                     r"\(crc32 [0-9a-f]{8}\), ranks 0, 2 pass \(\(0, 1\)", text)  # fmt: skip


def test_bench_json_into_a_missing_directory_fails_before_the_run(tmp_path, capsys):
    from xla_permute_tools.__main__ import main

    assert main(["bench", "--preset", "tiny", "--json", str(tmp_path / "no" / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err


def test_signature_fits_int32():
    """The check's all-gather is int32 (Neuron takes no 64-bit collectives)."""
    row = signature("op", {"x.shape": (2**40, 3), "n": 2**33, "s": "text"})
    assert all(-(2**31) <= v < 2**31 for v in row)
    assert describe_disagreement([row, row]) is None
    other = signature("op", {"x.shape": (2**40, 4), "n": 2**33, "s": "text"})
    assert "rank 1 passes (1099511627776, 4)" in describe_disagreement([row, other])


def test_a_list_of_strings_travels_as_text():
    """A field such as a list of dtype names is text, not groups of ints (it crashed)."""
    rows = [signature("op", {"dtypes": [d]}) for d in ("torch.float32", "torch.int8")]
    assert len(rows[0]) == len(rows[1]) == SIGNATURE_INTS
    assert describe_disagreement(rows).startswith("op: the ranks disagree on dtypes")


class _TwoRanks:
    """A backend whose other rank passes ``other``'s signature (or this rank's); named as
    c10d's, it asks no XLA runtime whether it is tracing."""

    name = "c10d"

    def __init__(self, other=None):
        self.other, self.gathered = other, 0

    def device_error(self, x, name):
        return None

    def gather_rows(self, row):
        self.gathered += 1
        return [row, row if self.other is None else signature(*self.other)]

    def rank(self):
        return 0

    def world_size(self):
        return 2


@pytest.mark.parametrize(("level", "checked"), [("every", 8), ("sampled", 4), ("off", 0)])
def test_each_level_checks_what_it_says(level, checked):
    """Eight calls: every one, the 1st, 2nd, 4th and 8th, or none; the hook sees them all."""
    import torch

    backend, seen = _TwoRanks(), []
    debug.on_op(seen.append)
    try:
        with debug.debug_mode(level):
            for _ in range(8):
                debug.agree("op", {"x": torch.ones(2)}, {"wrap": False}, backend=backend)
    finally:
        debug.on_op(None)
    assert backend.gathered == checked and seen == ["op"] * 8


def test_agree_raises_naming_the_difference_and_the_rank():
    import torch

    other = ("op", {"x.shape": (3,), "x.dtype": "torch.float32", "wrap": False, "error": None})
    with pytest.raises(debug.DisagreementError) as raised, debug.debug_mode():
        debug.agree("op", {"x": torch.ones(2)}, {"wrap": False}, backend=_TwoRanks(other))
    assert str(raised.value).startswith(
        "op: the ranks disagree on x.shape: rank 0 passes (2,), rank 1 passes (3,) "
        "(xla_permute agreement check, on rank 0 of 2:"
    )
