"""Figures for the docs, drawn from the package's own data with matplotlib (Agg, no pyplot).

Figure functions return a ``matplotlib.figure.Figure``; made with :func:`new_figure`, a
notebook shows it as a PNG without pyplot. A script saves it with ``fig.savefig(path)``.
Nothing here touches an XLA device. Per-rank tables (:func:`~xla_permute_tools.tables.rank_table`,
in :mod:`xla_permute_tools.tables`) are reached from here too, as ``figures.rank_table``.

>>> fig = pairs_figure([(0, 1), (1, 0), (2, 2)], n=4)   # a swap and a fixed point
>>> arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
>>> len(arrows), [t.get_text() for t in fig.axes[0].texts].count("zeros")   # rank 3 gets zeros
(3, 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO
from typing import Any

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch
    from matplotlib.text import Text
except ModuleNotFoundError as e:  # the optional dependency: name the extra that installs it
    if (e.name or "").partition(".")[0] != "matplotlib":
        raise
    raise ModuleNotFoundError(
        "xla_permute_tools.figures needs matplotlib, which is not installed: "
        "pip install 'xla-permute[figures]'",
        name="matplotlib",
    ) from e

import xla_permute as xp
from xla_permute.pairs import PairsLike, check_groups, global_pairs
from xla_permute.pipeline.schedule import units
from xla_permute.sequence import layout_chunks
from xla_permute_tools.cost.model import link_time, matmul_time, predict
from xla_permute_tools.tables import (  # noqa: F401  (figures.rank_table, .table, ...)
    CaveatEntries,
    RankTable,
    Table,
    caveat_anchor,
    caveat_entries,
    describe,
    rank_table,
    table,
)

__all__ = [
    "new_figure",
    "overlap_timeline_figure",
    "pairs_figure",
    "pipeline_schedule_figure",
    "ring_attention_figure",
    "ring_schedule_figure",
    "smallest_text",
]

_GROUP_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
_ZERO_COLOR = "#9a9a9a"


#: Resolution of the PNGs notebooks show, and the PNG text key that records the size of the
#: figure's smallest text in pixels at it (tests/check_site.py reads it: at the page's width the
#: smallest text must be 9 pt or more).
DPI = 110
SMALLEST_TEXT_KEY = "xla-permute smallest text px"
#: The smallest font size any figure here uses (points), and the widest figure (inches): a
#: figure up to 8 inches wide is shown at 89% or more of its size in the page's 784 px column,
#: so its smallest text stays above 9 pt there.
MIN_FONT = 9.5
MAX_WIDTH = 8.0


def smallest_text(fig: Figure) -> float:
    """The font size, in points, of the smallest visible, non-empty text of ``fig``
    (titles, labels, tick labels, legends, annotations); 0 when it has none."""
    sizes = [
        t.get_fontsize()
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and t.figure is not None
    ]
    return min(sizes, default=0.0)


class _DisplayFigure(Figure):
    """A Figure that Jupyter shows as a PNG by itself (no pyplot, no inline backend needed)."""

    def _repr_png_(self) -> bytes:
        buf = BytesIO()
        px = smallest_text(self) * DPI / 72
        metadata = {SMALLEST_TEXT_KEY: f"{px:.2f}"}
        self.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata=metadata)
        return buf.getvalue()


def new_figure(**kwargs: Any) -> Figure:
    """A Figure with an Agg canvas that Jupyter shows as a PNG without pyplot.

    ``kwargs`` go to ``matplotlib.figure.Figure``. Every figure function here starts from it.
    """
    fig = _DisplayFigure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _box(ax, x: float, y: float, text: str, color: str, filled: bool) -> None:
    ax.add_patch(
        FancyBboxPatch(
            (x - 0.36, y - 0.17),
            0.72,
            0.34,
            boxstyle="round,pad=0.02",
            facecolor=color if filled else "white",
            edgecolor=color,
            linewidth=1.5,
            linestyle="-" if filled else "--",
        )
    )
    ax.text(
        x, y, text, ha="center", va="center", fontsize=MIN_FONT, color="white" if filled else color
    )


def pairs_figure(
    pairs: PairsLike,
    n: int | None = None,
    *,
    groups: Sequence[Sequence[int]] | None = None,
    title: str | None = None,
    received: Sequence[str] | None = None,
) -> Figure:
    """Who sends to whom: senders on top, receivers below, one arrow per (global) pair.

    Args:
        pairs: ``(source, target)`` pairs, group-local when ``groups`` is given (checked as
            :func:`~xla_permute.permute.collective_permute` checks them).
        n: number of ranks; default: the ranks covered by ``groups``, else the largest id + 1.
        groups: replica groups; arrows are coloured by group.
        title: the figure title (say which backend produced any numbers shown).
        received: optional per-rank text printed under each receiver (e.g. the values it got).

    A receiver that is no pair's target is drawn dashed and grey: it receives zeros.
    """
    checked_pairs = list(pairs)
    if n is None:
        if groups is not None:
            n = sum(len(g) for g in groups)
        else:
            ids = [int(r) for pair in checked_pairs for r in pair]
            n = max(ids, default=0) + 1
    glob = global_pairs(checked_pairs, groups, n)
    group_of = {r: i for i, g in enumerate(check_groups(groups, n)) for r in g}
    if received is not None and len(received) != n:
        raise ValueError(f"received must have one entry per rank ({n}), got {len(received)}")

    fig = new_figure(figsize=(1.3 * n + 1.2, 2.9 if received is None else 3.3))
    ax = fig.add_subplot()
    top, bottom = 1.0, 0.0
    targets = {t for _, t in glob}
    multi = len(set(group_of.values())) > 1
    for r in range(n):
        color = _GROUP_COLORS[group_of[r] % len(_GROUP_COLORS)] if multi else _GROUP_COLORS[0]
        _box(ax, r, top, f"rank {r}", color, filled=True)
        if r in targets:
            _box(ax, r, bottom, f"rank {r}", color, filled=True)
        else:
            _box(ax, r, bottom, f"rank {r}", _ZERO_COLOR, filled=False)
            ax.text(
                r,
                bottom - 0.3,
                "zeros",
                ha="center",
                va="top",
                fontsize=MIN_FONT,
                color=_ZERO_COLOR,
            )
        if received is not None:
            ax.text(r, bottom - 0.52, received[r], ha="center", va="top", fontsize=MIN_FONT)
    for s, t in glob:
        color = _GROUP_COLORS[group_of[s] % len(_GROUP_COLORS)] if multi else "black"
        ax.add_patch(
            FancyArrowPatch(
                (s, top - 0.19),
                (t, bottom + 0.19),
                arrowstyle="-|>",
                mutation_scale=12,
                color=color,
                linewidth=1.3,
                shrinkA=0,
                shrinkB=0,
            )
        )
    if multi:
        handles = [
            Patch(color=_GROUP_COLORS[i % len(_GROUP_COLORS)], label=f"group {list(g)}")
            for i, g in enumerate(check_groups(groups, n))
        ]
        ax.legend(handles=handles, loc="lower left", fontsize=MIN_FONT, frameon=False)
    ax.text(-0.6, top, "x (sends)", ha="right", va="center", fontsize=MIN_FONT)
    ax.text(-0.6, bottom, "y (receives)", ha="right", va="center", fontsize=MIN_FONT)
    ax.set_xlim(-1.9, n - 0.5)
    ax.set_ylim(-0.95 if received is not None else -0.6, 1.35)
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def pipeline_schedule_figure(schedule, *, title: str | None = None) -> Figure:
    """A :class:`~xla_permute.pipeline.schedule.PipelineSchedule` as a grid: ranks (rows) by
    ticks (columns), each rank's idle ticks and peak activations beside its row.

    A cell holds the micro-batch: forward blue, backward (``B``) orange, input gradient
    (``I``) red, weight gradient (``W``) green, darker for a rank's later stages; an
    overlapped tick (DualPipeV) is split, forward on top; blank is the bubble.

    >>> fig = pipeline_schedule_figure(xp.make_schedule("1f1b", 4, 8))
    >>> texts = [t.get_text() for t in fig.axes[0].texts]
    >>> texts.count("7"), texts[-1]
    (8, 'idle 6, peak 1')
    """
    from matplotlib.patches import Rectangle

    p, ticks, v = schedule.ranks, schedule.ticks, schedule.stages_per_rank
    fig = new_figure(figsize=(min(MAX_WIDTH, 0.3 * ticks + 2.4), 0.42 * p + 1.5))
    ax = fig.add_subplot()
    shades = {
        "F": ("#6baed6", "#2171b5", "#08306b"),
        "B": ("#fdae6b", "#e6550d", "#7f2704"),
        "I": ("#fc9272", "#de2d26", "#67000d"),
        "W": ("#a1d99b", "#31a354", "#00441b"),
    }
    for t, tick in enumerate(schedule.work):
        for r, cell in enumerate(tick):
            y, parts = p - 1 - r, units(cell)
            if not parts:
                ax.add_patch(Rectangle((t, y), 0.94, 0.86, facecolor="white",
                                       edgecolor="#dddddd"))  # fmt: skip
            height = 0.86 / max(1, len(parts))
            for j, w in enumerate(parts):
                dark = min(schedule.stages_of(r).index(w.stage), 2)  # light to dark
                bottom = y + 0.86 - (j + 1) * height
                ax.add_patch(Rectangle((t, bottom), 0.94, height, facecolor=shades[w.kind][dark],
                                       edgecolor="white"))  # fmt: skip
                ax.text(t + 0.47, bottom + height / 2, str(w.micro_batch), ha="center",
                        va="center", fontsize=MIN_FONT,
                        color="white" if dark else "black")  # fmt: skip
    for r in range(p):
        label = f"idle {schedule.idle_ticks[r]}, peak {schedule.peak_in_flight[r]}"
        ax.text(ticks + 0.4, p - 0.57 - r, label, va="center", fontsize=MIN_FONT)
    ax.set_yticks(
        [p - 0.57 - r for r in range(p)], [f"rank {r}" for r in range(p)], fontsize=MIN_FONT
    )
    shown = range(0, ticks, max(1, ticks // 12))
    ax.set_xticks([t + 0.47 for t in shown], [str(t) for t in shown], fontsize=MIN_FONT)
    kinds = {w.kind for tick in schedule.work for cell in tick for w in units(cell)}
    names = {"F": "forward blue", "B": "backward orange", "I": "input grad red",
             "W": "weight grad green"}  # fmt: skip
    legend = ", ".join(names[k] for k in "FBIW" if k in kinds)
    ax.set_xlabel(f"ticks ({legend}{', later stages darker' * (v > 1)})", fontsize=MIN_FONT)
    ax.set_xlim(-0.2, ticks + 0.2)
    ax.set_ylim(-0.2, p)
    ax.spines[:].set_visible(False)
    ax.set_title(f"{title or schedule.name}: bubble {schedule.bubble_fraction:.1%}", fontsize=10)
    fig.tight_layout()
    return fig


def ring_schedule_figure(n: int, kind: str = "all_gather", bidirectional: bool = False) -> Figure:
    """Collective matmul's schedule: which block each rank multiplies at each step.

    Drawn from :func:`xla_permute.all_gather_schedule` (``kind="all_gather"``: the x
    block ``x_j`` of rank j) or :func:`~xla_permute.reduce_scatter_schedule`
    (``kind="reduce_scatter"``: the contribution to output block ``y_j``), the schedules the
    code runs. Arrows under a cell show the permutes issued in that step (to rank r+1 / r-1).

    >>> fig = ring_schedule_figure(4, bidirectional=True)
    >>> sorted(t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("x"))[:3]
    ['x0', 'x0', 'x0']
    """
    from matplotlib import colormaps

    if kind not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"kind must be 'all_gather' or 'reduce_scatter', got {kind!r}")
    schedule = xp.all_gather_schedule if kind == "all_gather" else xp.reduce_scatter_schedule
    letter = "x" if kind == "all_gather" else "y"
    steps = [schedule(n, r, bidirectional) for r in range(n)]
    colors = colormaps["tab10"]
    fig = new_figure(figsize=(1.3 * len(steps[0]) + 1.2, 0.75 * n + 1.0))
    ax = fig.add_subplot()
    for r, rank_steps in enumerate(steps):
        for step in rank_steps:
            width = 0.8 / len(step.blocks)
            for i, block in enumerate(step.blocks):
                x0 = step.step - 0.4 + i * width
                ax.add_patch(
                    FancyBboxPatch(
                        (x0 + 0.02, r - 0.28),
                        width - 0.04,
                        0.4,
                        boxstyle="round,pad=0.01",
                        facecolor=colors(block % 10),
                        edgecolor="none",
                        alpha=0.85,
                    )
                )
                ax.text(
                    x0 + width / 2,
                    r - 0.08,
                    f"{letter}{block}",
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=MIN_FONT,
                    fontweight="bold",
                )
            sends = " ".join("\u2193 r+1" if d == 1 else "\u2191 r-1" for d in step.sends)
            ax.text(
                step.step, r + 0.3, sends, ha="center", va="center", fontsize=MIN_FONT, color="0.3"
            )
    ax.set_xlim(-0.6, len(steps[0]) - 0.4)
    ax.set_ylim(n - 0.4, -0.6)
    ax.set_xticks(range(len(steps[0])), [f"step {t}" for t in range(len(steps[0]))])
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    what = "all-gather-matmul" if kind == "all_gather" else "matmul-reduce-scatter"
    ax.set_title(
        f"{what}, {'bi' if bidirectional else 'uni'}directional, N={n} (from {schedule.__name__})",
        fontsize=10,
    )
    return fig


def ring_attention_figure(n: int, *, causal: bool = True) -> Figure:
    """Ring attention's schedule: which (query chunk, key chunk) blocks each rank computes.

    Drawn from :func:`xla_permute.ring_attention_schedule`, the schedule the code
    runs: one panel per layout (contiguous, zigzag), a row per rank, a column per hop. In a
    cell, rows are the rank's query chunks and columns the key chunks it holds at that hop:
    filled = computed in full, lower triangle = the diagonal block (causal mask inside),
    blank = skipped. The number is the cell's work in chunk-pairs of that layout.

    >>> fig = ring_attention_figure(2)
    >>> [ax.get_title().split(":")[0] for ax in fig.axes]
    ['contiguous', 'zigzag']
    """
    from matplotlib.patches import Polygon, Rectangle

    fig = new_figure(figsize=(MAX_WIDTH, 2 * (0.7 * n + 1.0)))
    for p, layout in enumerate(("contiguous", "zigzag")):
        ax = fig.add_subplot(2, 1, p + 1)  # stacked: wide cells, legible labels
        busiest = 0.0
        total = 0.0
        for r in range(n):
            schedule = xp.ring_attention_schedule(n, r, causal=causal, layout=layout)
            work = xp.schedule_work(schedule)
            total += sum(work)
            own = layout_chunks(n, r, layout)
            for hop, w in zip(schedule, work, strict=True):
                held = layout_chunks(n, hop.source, layout)
                size = 0.62 / len(own)
                blocks = hop.blocks
                kinds = {(i, j): b.causal for b in blocks for i in b.q_chunks for j in b.k_chunks}
                for a, i in enumerate(own):
                    for c, j in enumerate(held):
                        x0, y0 = hop.hop - 0.45 + c * size, r - 0.31 + a * size
                        ax.add_patch(
                            Rectangle(
                                (x0, y0),
                                size,
                                size,
                                facecolor="white",
                                edgecolor="#bbbbbb",
                                linewidth=0.6,
                            )
                        )
                        if (i, j) not in kinds:
                            continue
                        color = _GROUP_COLORS[hop.source % len(_GROUP_COLORS)]
                        corners = [(x0, y0), (x0, y0 + size), (x0 + size, y0 + size)]
                        shape = (
                            Polygon(corners, closed=True, facecolor=color, alpha=0.85)
                            if kinds[(i, j)]
                            else Rectangle((x0, y0), size, size, facecolor=color, alpha=0.85)
                        )
                        ax.add_patch(shape)
                        ax.text(
                            x0 + size / 2,
                            y0 + size / 2,
                            f"q{i}k{j}",
                            ha="center",
                            va="center",
                            fontsize=MIN_FONT,
                            color="black",
                        )
                ax.text(hop.hop + 0.45, r, f"{w:g}", ha="right", va="center", fontsize=MIN_FONT)
        for t in range(n):
            busiest += max(
                xp.schedule_work(xp.ring_attention_schedule(n, r, causal=causal, layout=layout))[t]
                for r in range(n)
            )
        ax.set_xlim(-0.5, n - 0.5)
        ax.set_ylim(n - 0.5, -0.55)
        ax.set_xticks(range(n), [f"hop {t}" for t in range(n)], fontsize=MIN_FONT)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=MIN_FONT)
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        balance = total / (n * busiest) if busiest else 1.0
        ax.set_title(f"{layout}: {balance:.0%} of ideal", fontsize=MIN_FONT)
    what = "causal" if causal else "full"
    fig.suptitle(f"ring attention, {what}, N={n} (from ring_attention_schedule)", fontsize=10)
    fig.tight_layout()
    return fig


def overlap_timeline_figure(chip: Any, work: Any) -> Figure:
    """One rank's timeline of a unidirectional all-gather-matmul next to the baseline's.

    Drawn from :func:`xla_permute.all_gather_schedule` (which block rank 0 multiplies
    and sends at each step) and the cost model's terms for ``work`` on ``chip``
    (:mod:`xla_permute_tools.cost`): each step's matmul and the transfer of its block run at once,
    and the next step starts when the longer of the two and the hop's latency and overhead
    are over; the baseline's all-gather runs first and its one matmul waits for it. The two
    totals are :func:`~xla_permute_tools.cost.predict`'s, checked here.

    >>> from xla_permute_tools import cost
    >>> w = cost.Workload(m=2048, k=8192, n=2048, n_devices=4)
    >>> fig = overlap_timeline_figure(cost.CHIPS["tpu-v5e"], w)
    >>> [t.get_text() for t in fig.axes[0].get_yticklabels()][:2]
    ['ring: link', 'ring: matmul']
    """
    import math

    if work.op != "all_gather_matmul" or work.chunks != 1:
        raise ValueError("overlap_timeline_figure draws an unchunked all_gather_matmul only")
    n, us = work.n_devices, 1e6
    step = matmul_time(chip, work.m, work.k, work.n, work.dtype_bytes) * us
    send = link_time(chip, work.block_bytes) * us
    hops = 1 if (work.wraps(chip) or chip.switched) else n - 1
    wait = (hops * chip.hop_latency + chip.collective_overhead) * us
    ring, base = predict(chip, work, "uni"), predict(chip, work, "baseline")
    fig = new_figure(figsize=(MAX_WIDTH, 3.3))
    ax = fig.add_subplot()
    lanes = {"ring: link": 3, "ring: matmul": 2, "baseline: link": 1, "baseline: matmul": 0}
    colors = {"link": "#ff7f0e", "matmul": "#1f77b4", "wait": "#cccccc"}

    def bar(lane: str, start: float, length: float, kind: str, label: str = "") -> None:
        ax.barh(lanes[lane], length, left=start, height=0.7, color=colors[kind])
        if label and length > 0.06 * ring.total * us:
            ax.text(
                start + length / 2,
                lanes[lane],
                label,
                ha="center",
                va="center",
                fontsize=MIN_FONT,
                color="white" if kind != "wait" else "black",
            )

    t = 0.0
    for s in xp.all_gather_schedule(n, rank=0):
        bar("ring: matmul", t, step, "matmul", f"x{s.blocks[0]} @ w")
        if s.sends:
            bar("ring: link", t, send, "link", f"x{s.blocks[0]} to rank 1")
            bar("ring: link", t + max(step, send), wait, "wait")
            t += max(step, send) + wait
        else:
            t += step
    if not math.isclose(t, ring.total * us, rel_tol=1e-9):
        raise AssertionError(f"timeline {t} us != the model's {ring.total * us} us")
    gather = (base.comm + base.latency) * us
    bar("baseline: link", 0.0, gather, "link", "all-gather")
    bar("baseline: matmul", gather, base.math * us, "matmul", f"x (all {n}) @ w")
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_xlabel("microseconds (cost model)", fontsize=MIN_FONT)
    for name, total in (("ring", ring.total), ("baseline", base.total)):
        y = lanes[f"{name}: link"] + 0.45
        ax.text(total * us, y, f" {total * us:.0f} us", va="bottom", fontsize=MIN_FONT)
    handles = [
        Patch(color=c, label=k if k != "wait" else "hop latency + overhead")
        for k, c in colors.items()
    ]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28),
        ncol=3,
        fontsize=MIN_FONT,
        frameon=False,
    )
    ax.set_xlim(0, max(ring.total, base.total) * us * 1.15)
    ax.set_ylim(-0.6, 3.9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{chip.name}, N={n}: rank 0's steps (model, not a measurement)", fontsize=10)
    fig.tight_layout()
    return fig
