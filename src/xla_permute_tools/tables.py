"""Per-rank results as tables: one row per rank, the way notebooks show where the data is.

:func:`rank_table` turns what each rank returned (tensors, labels) into a
:class:`RankTable`, which a notebook shows as an HTML table and ``print`` as aligned text;
:func:`table` makes any other table of rows (chips, schedules, programs), which a notebook
shows as a Markdown table. Reached as ``figures.rank_table`` and ``figures.table`` too.
No torch or matplotlib import: tensors are recognised by their ``shape`` and ``tolist``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xla_permute_tools.caveat import Caveat

__all__ = [
    "CaveatEntries",
    "RankTable",
    "Table",
    "caveat_anchor",
    "caveat_entries",
    "describe",
    "rank_table",
    "table",
]


class RankTable:
    """Per-rank values as a table: one row per rank, one column per label.

    Jupyter shows it as an HTML table (``_repr_html_``); ``str()`` gives the same table as
    aligned text. Made by :func:`rank_table`.
    """

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[str]], title: str = ""):
        self.columns, self.rows, self.title = list(columns), [list(r) for r in rows], title

    def _repr_html_(self) -> str:
        from html import escape

        head = "".join(f"<th>{escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{escape(v)}</td>" for v in row) + "</tr>" for row in self.rows
        )
        caption = f"<caption>{escape(self.title)}</caption>" if self.title else ""
        return (
            f'<table class="rank-table">{caption}<thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>"
        )

    def __str__(self) -> str:
        table = [self.columns, *self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.columns))]
        lines = [
            "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
            for row in table
        ]
        return "\n".join([self.title, *lines] if self.title else lines)

    __repr__ = __str__


def describe(value: Any, max_values: int = 8) -> str:
    """A short text for one table cell: a small tensor's values, a larger one's shape.

    >>> import torch
    >>> describe(torch.tensor([[1.0, 2.0], [3.0, 4.5]])), describe(torch.zeros(2, 8))
    ('[[1, 2], [3, 4.5]]', '[2, 8] float32')
    """
    if hasattr(value, "shape") and hasattr(value, "tolist"):
        if value.numel() <= max_values:
            return str(_plain(value.tolist()))
        return f"[{', '.join(str(s) for s in value.shape)}] {str(value.dtype).split('.')[-1]}"
    return str(value)


def _plain(v: Any) -> Any:
    """Integer-valued floats as ints, in nested lists."""
    if isinstance(v, list):
        return [_plain(u) for u in v]
    return int(v) if isinstance(v, float) and v.is_integer() else v


def rank_table(
    per_rank: Sequence[Any], columns: Sequence[str] | None = None, *, title: str = ""
) -> RankTable:
    """A table of what each rank holds: row ``r`` is ``per_rank[r]``.

    ``per_rank[r]`` is a dict (its keys are the columns) or a sequence of cells (``columns``
    names them; default ``0, 1, ...``). A cell that is a tensor shows its values when it has
    at most 8 elements, else its shape and dtype; anything else shows as ``str()``.

    >>> print(rank_table([{"holds": "x0", "sends to": 1}, {"holds": "x1", "sends to": 0}]))
    rank  holds  sends to
    0     x0     1
    1     x1     0
    """
    rows = []
    for r, entry in enumerate(per_rank):
        if isinstance(entry, dict):
            if columns is None:
                columns = list(entry)
            cells = [entry[c] for c in columns]
        else:
            cells = list(entry)
            if columns is None:
                columns = [str(i) for i in range(len(cells))]
        if len(cells) != len(columns):
            raise ValueError(
                f"rank_table: rank {r} has {len(cells)} cells for {len(columns)} columns "
                f"{list(columns)}; give every rank one value per column"
            )
        rows.append([str(r), *(describe(v) for v in cells)])
    return RankTable(["rank", *(columns or [])], rows, title)


class Table:
    """Rows of cells under named columns: Markdown in a notebook, aligned text in ``print``.

    Made by :func:`table`; ``align`` holds ``"<"`` (left) or ``">"`` (right) per column.
    """

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[str]], align: str):
        self.columns, self.rows, self.align = list(columns), [list(r) for r in rows], align

    def _repr_markdown_(self) -> str:
        """The table as Markdown; a cell's line breaks become spaces and its pipes escaped.

        >>> print(table(["what", "text"], [["a | b", "two\\nlines"]])._repr_markdown_())
        | what | text |
        | --- | --- |
        | a \\| b | two lines |
        """
        rule = ["--:" if a == ">" else "---" for a in self.align]
        body = [[" ".join(v.split()).replace("|", "\\|") for v in row] for row in self.rows]
        lines = [self.columns, rule, *body]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)

    def __str__(self) -> str:
        table = [self.columns, *self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.columns))]
        return "\n".join(
            "  ".join(
                v.rjust(w) if a == ">" else v.ljust(w)
                for v, w, a in zip(row, widths, self.align, strict=True)
            ).rstrip()
            for row in table
        )

    __repr__ = __str__


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> Table:
    """A table of ``rows`` (each a sequence of cells, shown with ``str()``) under ``columns``.

    ``align``: one ``"<"`` or ``">"`` per column (default: every column left-aligned).

    >>> print(table(["chip", "N"], [["v5e", 4], ["v5p", 8]], align="<>"))
    chip  N
    v5e   4
    v5p   8
    """
    align = align or "<" * len(columns)
    if len(align) != len(columns) or set(align) - {"<", ">"}:
        raise ValueError(f"table: align needs one '<' or '>' per column, got {align!r}")
    cells = [[str(v) for v in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(columns):
            raise ValueError(
                f"table: row {i} has {len(row)} cells for {len(columns)} columns {list(columns)}"
            )
    return Table(columns, cells, align)


def caveat_anchor(caveat_id: str) -> str:
    """The label of a caveat's entry (page 13 renders each with :func:`caveat_entries`): other
    pages link to it with ``{ref}`caveat-<id>```.

    >>> caveat_anchor("pin-layout")
    'caveat-pin-layout'
    """
    return f"caveat-{caveat_id}"


class CaveatEntries:
    """Caveats as MyST Markdown, each under its label (:func:`caveat_anchor`): a notebook
    shows them with the labels as link targets; ``str()`` gives the Markdown. Made by
    :func:`caveat_entries`."""

    def __init__(self, markdown: str) -> None:
        self.markdown = markdown

    def _repr_markdown_(self) -> str:
        return self.markdown

    def __str__(self) -> str:
        return self.markdown

    __repr__ = __str__


def caveat_entries(selected: Sequence[Caveat]) -> CaveatEntries:
    """Each caveat in full, once, as the site renders it: the label ``(caveat-<id>)=``, the id
    as a small heading (a rubric, out of the page's table of contents, the text a
    ``{ref}`caveat-<id>``` link shows), its severity, device types and summary, then a list of
    what goes wrong, what this package does, the evidence and the sources. A list, not a
    table: on a phone it wraps where a table's columns would not fit.

    >>> from xla_permute_tools.catalog import caveats
    >>> text = str(caveat_entries([c for c in caveats("CPU") if c.id == "cpu-channel-ids"]))
    >>> text.splitlines()[:3]
    ['(caveat-cpu-channel-ids)=', '', ':::{rubric} cpu-channel-ids']
    """
    blocks = []
    for c in selected:
        devices = "every device type" if "*" in c.applies_to else ", ".join(c.applies_to)
        rows = dict(c.rows())
        items = [
            f"- **{label.capitalize()}:** {text}" for label, text in c.rows() if label != "summary"
        ]
        blocks.append(
            "\n".join(
                [
                    f"({caveat_anchor(c.id)})=",
                    "",
                    f":::{{rubric}} {c.id}",
                    ":::",
                    "",
                    f"**{c.severity}**, {devices}: {rows['summary']}",
                    "",
                    *items,
                ]
            )
        )
    return CaveatEntries("\n\n".join(blocks))
