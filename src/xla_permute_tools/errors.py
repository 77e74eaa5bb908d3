"""The errors a user meets, as data: each literal message, what raises it, why, and the fix.

The docs' errors page has one entry per :class:`ErrorEntry` (the anchor ``error-<slug>``), each
triggered live by a cell. :func:`required` lists what the page must cover: every exception class
the library raises and every message a caveat names (``Caveat.messages``);
:func:`explain` writes an entry's cause and fix, from the caveat catalog for the entries that
have caveats. The library ends the messages this page explains with
``xla_permute.pairs.see(slug)``.

>>> entry("pairs").matches("pairs: duplicate target 1 in pairs (0, 1) and (2, 1); every ...")
True
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import xla_permute
from xla_permute_tools.known_caveats import CAVEATS, RENDEZVOUS_TIMEOUT

__all__ = ["ERRORS", "PROTOCOL_ERRORS", "ErrorEntry", "entry", "explain", "raised", "required"]


@dataclass(frozen=True)
class ErrorEntry:
    """One message a user sees: ``message`` as printed, ``...`` where it varies.

    ``raised_as`` is how it reaches the user; ``caveats`` are the catalog's ids behind it (their
    summaries and what this package does are the cause and the fix), else ``cause`` and ``fix``
    say it and ``page`` is where the topic is explained.
    """

    slug: str
    message: str
    raised_as: str
    caveats: tuple[str, ...] = ()
    cause: str = ""
    fix: str = ""
    page: str = ""

    def matches(self, text: str) -> bool:
        """Whether ``text`` holds the message: its parts between ``...``, in order."""
        pattern = ".*?".join(re.escape(part) for part in self.message.split("..."))
        return re.search(pattern, text, re.DOTALL) is not None


#: Every entry of the errors page in its order, the library's errors first, then XLA's.
#: The caveats behind a rendezvous abort, shared by its two entries (the abort, the message).
_RENDEZVOUS_CAVEATS = (
    "cpu-channel-ids",
    "cpu-thread-pool",
    "param-aliasing-deadlock",
    "empty-sync-device-lock",
    "compile-skew-rendezvous",
)

ERRORS: tuple[ErrorEntry, ...] = (
    ErrorEntry(
        "disagreement",
        "...: the ranks disagree on ...: rank ... passes ... (xla_permute agreement check, on "
        "rank ... every rank must pass the same to each collective, in the same order)",
        "xp.DisagreementError (a ValueError), on every rank",
        cause="the ranks passed different shapes, dtypes, pairs, groups or backends to one "
        "collective (or called different ones); without the check a rank reads past a buffer "
        "or waits forever",
        fix="make the named argument equal on every rank (shard evenly, cast every rank alike)",
        page="14_when_the_mesh_fails",
    ),
    ErrorEntry(
        "rank-error",
        "rank ... of ... raised ...",
        "xp.RankError (a MeshError) from run_on_mesh; the rank's own exception is its .original",
        cause="a rank function raised: the rank's error, its traceback and rank follow the words",
        fix="read the rank's error (often one of this page); its entry has the fix",
        page="01_getting_started",
    ),
    ErrorEntry(
        "mesh-abort",
        "The ...-device mesh running ... was killed by SIGABRT before returning results. "
        "Diagnosis: XLA:CPU aborted an ...",
        "xp.MeshError from run_on_mesh",
        caveats=_RENDEZVOUS_CAVEATS,
        cause="the device process died, most often XLA:CPU's abort of a collective that not "
        "every rank reached within 15 s; the diagnosis names the collective, the ranks that "
        "waited and where the others were",
        page="14_when_the_mesh_fails",
    ),
    ErrorEntry(
        "compile",
        "... was called inside torch.compile, which this package does not support",
        "xp.CompileError (a RuntimeError), on every rank before any collective",
        caveats=("torch-compile",),
    ),
    ErrorEntry(
        "pairs",
        "pairs: duplicate ... in pairs ...",
        "ValueError (TypeError for a pair that is not two integers), before any collective",
        cause="a permute's pairs are a partial permutation: every rank sends to at most one "
        "rank and receives from at most one, and the ids are in the group",
        fix="one pair per source and per target, ids in 0..group size - 1 (xp.ring_pairs(n) "
        "for a ring)",
        page="02_collective_permute",
    ),
    ErrorEntry(
        "neuron-rings",
        "pairs ... form an open chain ...: NEURON runs only permutes whose pairs form complete "
        "rings. Close each chain into a ring: add pair ...",
        "ValueError from collective_permute's native backend on Neuron (check_device_pairs)",
        caveats=("neuron-complete-rings",),
    ),
    ErrorEntry(
        "spmd",
        "... cannot run in torch_xla's SPMD mode (xr.use_spmd())",
        "ValueError, from every collective of this package in SPMD mode",
        caveats=("spmd-manual-collectives",),
    ),
    ErrorEntry(
        "native-on-cpu",
        "backend='native' ...",
        "ValueError from collective_permute on the CPU mesh",
        caveats=("cpu-channel-ids",),
    ),
    ErrorEntry(
        "plan",
        "plan key ... matches no module; close: ...",
        "ValueError from parallelize_module (and others for a style it cannot apply)",
        cause="a plan names modules by their dotted names (wildcards per part); this one names "
        "none, or a style does not fit its module (the message says which)",
        fix="use a name the message lists as close, or print [n for n, _ in model.named_modules()]",
        page="05_hugging_face_llama",
    ),
    ErrorEntry(
        "outside-rank",
        "... built outside a mesh rank needs world_size= and rank=",
        "RuntimeError from a tensor-parallel layer",
        cause="a layer learns its rank and world size from the running mesh; outside a rank, "
        "asking would start this process's XLA runtime (and break run_on_mesh)",
        fix="build the layer inside the rank function, or pass world_size= and rank=",
        page="04_tensor_parallel_poc",
    ),
    ErrorEntry(
        "cannot-send",
        "... cannot be sent to the device process: ...",
        "TypeError from run_on_mesh, before anything starts",
        cause="the function, a global or closure variable it uses, or an argument cannot be "
        "pickled (a lock, an open file, a tensor on an XLA device of this process)",
        fix="create it inside the function, or pass what it is built from (CPU tensors)",
        page="01_getting_started",
    ),
    ErrorEntry(
        "no-torch-xla",
        "... needs torch_xla, which is not installed: pip install 'xla-permute[xla]'",
        "ModuleNotFoundError (an ImportError), from an op outside a process group",
        cause="torch_xla is an extra (the 'xla' extra); without it only torch.distributed "
        "process groups run the ops",
        fix="pip install 'xla-permute[xla]', or call torch.distributed.init_process_group "
        "first (backend='c10d')",
        page="11_torch_distributed",
    ),
    ErrorEntry(
        "hardware-warning",
        "dtype ... is 64-bit: NEURON collectives do not support 64-bit element types",
        "xp.hardware.HardwareWarning (a UserWarning): the permute runs",
        caveats=("neuron-no-64bit",),
    ),
    ErrorEntry(
        "termination-timeout",
        RENDEZVOUS_TIMEOUT,
        "XLA:CPU's log, then SIGABRT (from run_on_mesh: MeshError)",
        caveats=_RENDEZVOUS_CAVEATS,
    ),
    ErrorEntry(
        "computation-hash",
        "Failed to get computation by hash ... Maybe the entry get kicked out of the LRU cache",
        "RuntimeError from torch_xla, on every rank",
        caveats=("torch-compile",),
    ),
    ErrorEntry(
        "compile-option",
        "No such compile option: 'xla_tpu_decompose_all_gather_einsum'",
        "RuntimeError from torch_xla at the first compile (RankError on the mesh)",
        caveats=("tpu-collective-matmul-flag",),
    ),
    ErrorEntry(
        "layout-mix",
        "HloModule has a mix of layout constrained and unconstrained AllReduce instructions",
        "ValueError from torch_xla's compile (the HLO verifier)",
        caveats=("pin-layout",),
    ),
    ErrorEntry(
        "span-bounds",
        "Span::at failed bounds check",
        "std::out_of_range, then SIGABRT: the process dies",
        caveats=("spmd-manual-collectives",),
    ),
    ErrorEntry(
        "cuda-plugin",
        "No PjRtPlugin registered for: CUDA",
        "RuntimeError from torch_xla when it starts its runtime",
        caveats=("gpu-removed",),
    ),
)

#: Exceptions the library raises that are Python's protocols, not errors a user meets.
PROTOCOL_ERRORS = {
    "NotImplementedError": "the abstract methods of backends.base.CommBackend",
    "AttributeError": "the namespace's __getattr__ for a name it does not have",
}


def entry(slug: str) -> ErrorEntry:
    """The entry with anchor ``error-<slug>``."""
    found = [e for e in ERRORS if e.slug == slug]
    if not found:
        raise ValueError(f"no error entry {slug!r}; the entries: {[e.slug for e in ERRORS]}")
    return found[0]


def raised() -> set[str]:
    """The names of the exception classes the library raises (``raise Name(...)`` in its source),
    less :data:`PROTOCOL_ERRORS`."""
    names = set()
    for path in Path(xla_permute.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name and name[0].isupper():
                    names.add(name)
    return names - set(PROTOCOL_ERRORS)


def required() -> dict[str, list[str]]:
    """What the errors page must cover -> the slugs of the entries that cover it (empty: none):
    each class of :func:`raised` and the library's warning (entries raised as it), each message
    of a caveat (entries with that message)."""

    def raised_as(item: ErrorEntry) -> str:  # "xp.hardware.HardwareWarning (a ...)" -> its class
        return re.match(r"[\w.]+", item.raised_as).group().rsplit(".", 1)[-1]

    need = {
        f"class {name}": [e.slug for e in ERRORS if raised_as(e) == name]
        for name in sorted(raised() | {"HardwareWarning"})
    }
    for c in CAVEATS:
        need |= {
            f"caveat {c.id}: {m}": [e.slug for e in ERRORS if e.message == m] for m in c.messages
        }
    return need


def explain(item: ErrorEntry) -> str:
    """How ``item`` is raised, its cause, its fix and its links as MyST Markdown; an entry with
    caveats and no cause of its own has a line per caveat: its summary (the cause) and what
    this package does about it (the fix).

    >>> explain(entry("layout-mix")).splitlines()[2][:46]
    '- {ref}`pin-layout <caveat-pin-layout>` (silen'
    """
    by_id = {c.id: c for c in CAVEATS}
    links = {cid: f"{{ref}}`{cid} <caveat-{cid}>`" for cid in item.caveats}
    said = [f"**Raised as** {item.raised_as}."]
    said += [f"**{label}**: {text}." for label, text in (("Cause", item.cause), ("Fix", item.fix))
             if text]  # fmt: skip
    if item.cause and links:  # the cause is said: the caveats as links
        said.append(f"**Caveats**: {', '.join(links.values())}.")
    said += [f"More: {{doc}}`{item.page}`."] if item.page else []
    lines = [" ".join(said)]
    if not item.cause:
        lines += [
            f"- {link} ({by_id[cid].severity}): {by_id[cid].summary}. *What to do*: "
            f"{by_id[cid].library_action}"
            for cid, link in links.items()
        ]
    return "\n\n".join(lines)
