"""The errors page: every library message that names an entry names one the page has, and the
page covers every exception class the library raises and every message a caveat names.

The page (tutorials/*_errors.md) triggers each entry live; here, the library's pointers to it
(``xla_permute.pairs.see``) are checked against the page's anchors and the entries' data.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest
import torch

import xla_permute as xp
from xla_permute.debug import describe_disagreement, signature
from xla_permute.pairs import ERRORS_PAGE, see
from xla_permute_tools import errors
from xla_permute_tools.catalog import caveats

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / ERRORS_PAGE.replace(".html", ".md")
LIBRARY = ROOT / "src" / "xla_permute"


def _anchors() -> list[str]:
    return re.findall(r"^\(error-([\w-]+)\)=$", PAGE.read_text(), re.MULTILINE)


def test_the_page_the_library_names_exists_with_one_anchor_per_entry():
    assert PAGE.exists(), f"xla_permute.pairs.ERRORS_PAGE names {ERRORS_PAGE}, not a page"
    assert sorted(_anchors()) == sorted(e.slug for e in errors.ERRORS)


def test_every_entry_the_library_names_is_on_the_page():
    named = {
        slug
        for path in LIBRARY.rglob("*.py")
        for slug in re.findall(r"""see\(["'](.+?)["']\)""", path.read_text())
    }
    assert named, "no library message names an entry"
    assert named <= set(_anchors()), named - set(_anchors())
    # the library's own refusals whose cause the page explains all name their entry
    assert {"pairs", "neuron-rings", "spmd", "plan", "disagreement", "compile"} <= named
    assert {"native-on-cpu", "no-torch-xla", "outside-rank"} <= named
    assert {"mesh-abort", "rank-error", "cannot-send"} <= named


def test_the_messages_end_with_their_entry_and_match_it():
    raised = {}
    for slug, call in {
        "pairs": lambda: xp.check_pairs([(0, 1), (2, 1)], 4),
        "neuron-rings": lambda: xp.hardware.check_device_pairs("NEURON", [(0, 1), (1, 2)], 4),
        "spmd": lambda: xp.hardware.check_not_spmd(environ={"XLA_USE_SPMD": "1"}),
        "plan": lambda: xp.parallelize_module(
            torch.nn.Sequential(torch.nn.Linear(2, 2)), None, {"x": None}, world_size=2, rank=0
        ),
    }.items():
        with pytest.raises(ValueError) as e:
            call()
        raised[slug] = str(e.value)
    if importlib.util.find_spec("torch_xla") is not None:  # else it names the missing extra
        with pytest.raises(RuntimeError) as e:
            xp.ColumnParallelLinear(4, 8)  # outside a rank, without world_size= and rank=
        raised["outside-rank"] = str(e.value)
    for slug, message in raised.items():
        assert message.endswith(see(slug)), message
        assert errors.entry(slug).matches(message), message


def test_a_disagreement_matches_its_entry():
    rows = [signature("collective_permute", {"x.shape": (2 + (r == 1),)}) for r in range(4)]
    described = describe_disagreement(rows)
    assert described == (
        "collective_permute: the ranks disagree on x.shape: rank 1 passes (3,), ranks 0, 2, 3 "
        "pass (2,)"
    )
    # as DisagreementError completes it (xla_permute.debug.agree)
    text = (
        f"{described} (xla_permute agreement check, on rank 0 of 4: every rank must pass the "
        f"same to each collective, in the same order){see('disagreement')}"
    )
    assert errors.entry("disagreement").matches(text)
    source = (LIBRARY / "debug.py").read_text()
    assert "the same order){see('disagreement')}" in source


def test_the_page_covers_every_class_and_every_caveat_message():
    covered = errors.required()
    assert {"class ValueError", "class DisagreementError", "class MeshError"} <= set(covered)
    assert any(what.startswith("caveat pin-layout: HloModule") for what in covered)
    assert all(covered.values()), [what for what, slugs in covered.items() if not slugs]


def test_coverage_fails_for_a_class_without_an_entry(monkeypatch):
    monkeypatch.setattr(errors, "raised", lambda: {"ValueError", "OverflowError"})
    assert errors.required()["class OverflowError"] == []


def test_explain_takes_the_cause_and_fix_from_the_caveat():
    text = errors.explain(errors.entry("layout-mix"))
    (pin,) = [c for c in caveats() if c.id == "pin-layout"]
    assert pin.summary in text and pin.library_action in text
    assert "{ref}`pin-layout <caveat-pin-layout>`" in text


def test_an_unknown_entry_is_refused_naming_the_entries():
    with pytest.raises(ValueError, match="no error entry 'nope'; the entries: \\['disagreement'"):
        errors.entry("nope")


def test_the_warning_names_what_to_cast_to():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xp.hardware.check_device_pairs("NEURON", [(0, 1), (1, 0)], 2, dtype=torch.int64)
    (w,) = caught
    assert errors.entry("hardware-warning").matches(str(w.message))
