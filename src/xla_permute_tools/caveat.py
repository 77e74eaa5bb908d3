"""One hardware caveat: the record, its severities, and how it prints (text, table rows).

The caveats themselves are data in :mod:`xla_permute_tools.known_caveats`;
:func:`xla_permute_tools.catalog.caveats` lists those that apply to a device type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SEVERITIES", "Caveat", "caveat_rows"]

#: The severities of a caveat, most severe first. ``error``: the program fails, hangs or is
#: refused; ``silent``: wrong or unexpected results without an error; ``performance``;
#: ``info``: status and practice.
SEVERITIES = ("error", "silent", "performance", "info")


@dataclass(frozen=True)
class Caveat:
    """One hardware caveat.

    ``applies_to`` lists device types (``"*"``: all); ``sources`` are upstream URLs;
    ``evidence`` says what this project checked itself (installed source, a run on the CPU
    mesh, a tutorial) or that a fact is not confirmed by a public source. ``messages`` are the
    messages of XLA, torch_xla or torch.distributed a user sees when it bites, as printed
    (``...`` where they vary); the errors page has an entry for each and triggers it.
    """

    id: str
    applies_to: tuple[str, ...]
    severity: str
    summary: str
    what_goes_wrong: str
    library_action: str
    sources: tuple[str, ...]
    evidence: str
    messages: tuple[str, ...] = ()

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

    def rows(self) -> list[tuple[str, str]]:
        """This caveat as ``(label, text)`` rows, its sources as Markdown links: page 13 shows
        them with ``figures.caveat_entries`` (:mod:`xla_permute_tools.figures`).

        >>> from xla_permute_tools.catalog import caveats
        >>> cpu = {c.id: c for c in caveats("CPU")}
        >>> [label for label, _ in cpu["cpu-channel-ids"].rows()][:2]
        ['summary', 'what goes wrong']
        """
        rows = [
            ("summary", self.summary),
            ("what goes wrong", self.what_goes_wrong),
            ("this package", self.library_action),
            ("evidence", self.evidence),
        ]
        if self.sources:
            rows.append(("sources", ", ".join(_link(url) for url in self.sources)))
        return rows


def _link(url: str) -> str:
    """A markdown link with a short name: ``pytorch/xla#8855`` for an issue or pull request."""
    parts = url.removeprefix("https://github.com/").split("/")
    if url.startswith("https://github.com/") and len(parts) >= 4 and parts[2] in ("issues", "pull"):
        name = f"{parts[0]}/{parts[1]}#{parts[3]}"
    else:
        name = url.rstrip("/").rsplit("/", 1)[-1] or url
    return f"[{name}]({url})"


def caveat_rows(
    selected: Sequence[Caveat], columns: Sequence[str] = ("severity", "id", "summary")
) -> tuple[list[str], list[list[str]]]:
    """The column names and one row per caveat of the given
    :class:`~xla_permute_tools.catalog.Caveat` fields (``id`` as code, ``sources`` as
    Markdown links); a notebook shows them with ``figures.table(*caveat_rows(selected, columns))``.

    >>> from xla_permute_tools.catalog import caveats
    >>> names, rows = caveat_rows(caveats("CUDA")[:1])
    >>> names[:2], rows[0][:2]
    (['severity', 'id'], ['silent', '`pin-layout`'])
    """
    fields = {f.name for f in dataclasses.fields(Caveat)}
    bad = [c for c in columns if c not in fields]
    if bad or not columns:
        raise ValueError(f"columns must be Caveat fields ({', '.join(sorted(fields))}), got {bad}")

    def value(caveat: Caveat, column: str) -> str:
        v = getattr(caveat, column)
        if column == "id":
            return f"`{v}`"
        if column == "sources":
            return ", ".join(_link(url) for url in v)
        if column == "applies_to":
            return "every device type" if "*" in v else ", ".join(v)
        return str(v)

    names = [c.replace("_", " ") for c in columns]
    return names, [[value(c, col) for col in columns] for c in selected]
