"""``parallelize_module``: a model made tensor-parallel in place, from a plan of styles.

The DTensor-style call of PyTorch (``torch.distributed.tensor.parallel.parallelize_module``)
for this package's layers: the plan maps module names (``*`` matches one name of the path, as
in ``"model.layers.*.mlp.up_proj"``) to styles (:mod:`xla_permute.tensor_parallel.styles`);
each style swaps the module in place for this rank's shard of it, its weights cut from the
original, so that the model's own ``forward`` runs unchanged on every rank:

* a ``Linear`` becomes a :class:`~xla_permute.ColumnParallelLinear` or
  :class:`~xla_permute.RowParallelLinear` (collective matmul where the layouts ask for a
  gather or a scatter, ``strategy``: ``"ring"``, ``"baseline"``, ``"auto"``, ``"xla"``);
  column-parallel siblings fed the same sequence-sharded input (q/k/v, gate/up) share one ring
  (``share_rings``; :func:`~xla_permute.tensor_parallel.layers.share_ring`);
* an ``Embedding`` under ``RowwiseParallel`` becomes a
  :class:`~xla_permute.VocabParallelEmbedding`;
* an attention under :class:`~xla_permute.HeadwiseParallel` becomes a
  :class:`~xla_permute.ParallelAttention`;
* a module under ``SequenceParallel`` keeps its weights whole; their gradients are summed over
  the group inside the backward (:func:`~xla_permute.sum_gradients`), as are the replicated
  key/value heads of grouped-query attention and the biases of row-parallel layers: **no
  gradient sum is left to the user**.

Every rank builds the same plan for the same model; everything is checked, and every new layer
built, before the model is touched and before any collective: a plan key that matches no
module, a module matched twice, a style on a module it cannot shard, sizes the group does not
divide, and (when the plan shards the sequence) a parameter in no planned module, whose
gradient would be silently partial.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from xla_permute.collectives import sum_gradients
from xla_permute.pairs import GroupsLike
from xla_permute.sequence import check_layout
from xla_permute.tensor_parallel.heads import ParallelAttention
from xla_permute.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    _world,
    share_ring,
)
from xla_permute.tensor_parallel.regions import gather_replicated
from xla_permute.tensor_parallel.styles import HeadwiseParallel, Layout, layout_of, one_layout
from xla_permute.tensor_parallel.vocab import VocabParallelEmbedding

__all__ = ["parallelize_module"]


def _matches(pattern: str, name: str) -> bool:
    """``pattern`` matches the module path ``name`` name by name (``*`` is one name)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True)
    )


def _assign(plan: Mapping[str, Any], names: list[str]) -> dict[str, tuple[str, Any]]:
    """``module name -> (plan key, style)``; ValueError for a key that matches nothing or a
    module that two keys match."""
    chosen: dict[str, tuple[str, Any]] = {}
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"plan keys are module names (str), got {key!r}")
        hits = [n for n in names if n and _matches(key, n)]
        if not hits:
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
            hint = f"; close names: {close}" if close else ""
            raise ValueError(f"plan key {key!r} matches no module of the model{hint}")
        for hit in hits:
            if hit in chosen:
                raise ValueError(
                    f"module {hit!r} is matched by two plan keys, {chosen[hit][0]!r} and "
                    f"{key!r}; give it one style"
                )
            chosen[hit] = (key, style)
    return chosen


def _column_options(style: Any, name: str) -> dict[str, Any]:
    """ColwiseParallel's layouts as :class:`ColumnParallelLinear` options."""
    kind, dim = one_layout(style.input_layouts, f"{name}: ColwiseParallel input_layouts")
    out = one_layout(style.output_layouts, f"{name}: ColwiseParallel output_layouts")
    if kind == "shard" and (dim is None or dim < 0):
        raise ValueError(
            f"{name}: ColwiseParallel(input_layouts=Shard({dim})) shards the features; a "
            f"column-parallel input is whole (Replicate()) or split along the sequence "
            f"(Shard(1)): a Linear on feature shards is RowwiseParallel"
        )
    if out not in (("shard", -1), ("replicate", None)):
        raise ValueError(
            f"{name}: ColwiseParallel(output_layouts={style.output_layouts[0]!r}): the output "
            f"is this rank's features (Shard(-1)) or gathered (Replicate())"
        )
    options: dict[str, Any] = {"sequence_parallel": kind == "shard"}
    if kind == "shard":
        options["dim"] = dim
    options["gather_output"] = out[0] == "replicate"
    return options


def _row_options(style: Any, name: str) -> tuple[Layout, dict[str, Any]]:
    """RowwiseParallel's layouts: (input layout, output options)."""
    inp = one_layout(style.input_layouts, f"{name}: RowwiseParallel input_layouts")
    kind, dim = one_layout(style.output_layouts, f"{name}: RowwiseParallel output_layouts")
    if kind == "shard" and (dim is None or dim < 0):
        raise ValueError(
            f"{name}: RowwiseParallel(output_layouts=Shard({dim})): the output is summed over "
            f"ranks, then whole (Replicate()) or scattered along the sequence (Shard(1))"
        )
    return inp, {"sequence_parallel": kind == "shard", "dim": 1 if dim is None else dim}


def _build(
    name: str,
    module: nn.Module,
    style: Any,
    comm: dict[str, Any],
    layer: dict[str, Any],
    context: dict[str, Any],
) -> tuple[nn.Module | None, Layout | None]:
    """This rank's replacement of ``module`` (None: the module stays, wrapped) and, when the
    style puts activations on sequence shards, their layout ``("shard", d)`` (else None)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    kind = type(style).__name__
    if isinstance(style, ColwiseParallel):
        if not isinstance(module, nn.Linear):
            fix = " (a vocabulary-parallel embedding is RowwiseParallel)" * isinstance(
                module, nn.Embedding
            )
            raise ValueError(
                f"{name}: ColwiseParallel shards an nn.Linear, not a {type(module).__name__}{fix}"
            )
        options = _column_options(style, name)
        new = ColumnParallelLinear.from_linear(module, **comm, **layer, **options)
        sequence = ("shard", options["dim"]) if options["sequence_parallel"] else None
        return new.to(module.weight.device), sequence
    if isinstance(style, RowwiseParallel):
        inp, options = _row_options(style, name)
        if isinstance(module, nn.Embedding):
            if inp != ("replicate", None):
                raise ValueError(
                    f"{name}: a vocabulary-parallel embedding takes the tokens "
                    f"whole: RowwiseParallel(input_layouts=Replicate())"
                )
            output = "sequence" if options["sequence_parallel"] else "replicated"
            dim = options["dim"]
            new = VocabParallelEmbedding.from_embedding(module, output=output, dim=dim, **comm)
            return new, ("shard", dim) if output == "sequence" else None
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"{name}: RowwiseParallel shards an nn.Linear or nn.Embedding, "
                f"not a {type(module).__name__}"
            )
        if inp != ("shard", -1):
            raise ValueError(
                f"{name}: RowwiseParallel takes this rank's features (input_layouts=Shard(-1), "
                f"the output of a ColwiseParallel), got {style.input_layouts[0]!r}"
            )
        new = RowParallelLinear.from_linear(module, **comm, **layer, **options)
        sequence = ("shard", options["dim"]) if options["sequence_parallel"] else None
        return new.to(module.weight.device), sequence
    if isinstance(style, SequenceParallel):
        return None, ("shard", style.sequence_sharding[0].dim)
    if isinstance(style, PrepareModuleInput):
        _input_conversions(style, name)  # checked now, installed later
        return None, None
    if isinstance(style, HeadwiseParallel):
        layout = style.layout()
        dropout = getattr(module, "attention_dropout", 0.0) or getattr(module, "dropout", 0.0)
        if isinstance(dropout, float) and dropout > 0:
            raise ValueError(
                f"{name}: attention dropout {dropout} is not supported by ParallelAttention; "
                f"build the model with attention_dropout=0.0"
            )
        proj = style.projections(module, name)
        heads, kv_heads, head_dim = style.head_counts(module, name)
        sp = {"sequence_parallel": layout[0] == "shard", "dim": layout[1] or 1}
        new = ParallelAttention.from_linears(
            **proj,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            position_fn=style.position_fn,
            causal=style.causal,
            returns_weights=style.hf_outputs(module),
            **context,
            **comm,
            **layer,
            **sp,
        )
        return new, layout if layout[0] == "shard" else None
    raise TypeError(
        f"{name}: style {kind} is not one this package applies; use ColwiseParallel, "
        f"RowwiseParallel, SequenceParallel, PrepareModuleInput (torch.distributed.tensor."
        f"parallel) or xla_permute.HeadwiseParallel"
    )


def _input_conversions(style: Any, name: str) -> list[Layout | None]:
    """PrepareModuleInput's positional conversions: for each input, the dim to gather (a
    ``("shard", d)``) or None (left as it is)."""
    if style.with_kwargs and any(
        layout_of(a, "input_kwarg_layouts") != layout_of(b, "desired_input_kwarg_layouts")
        for a, b in (
            (style.input_kwarg_layouts[k], style.desired_input_kwarg_layouts.get(k))
            for k in style.input_kwarg_layouts
        )
    ):
        raise ValueError(f"{name}: PrepareModuleInput converts positional inputs only here")
    out: list[Layout | None] = []
    for have, want in zip(style.input_layouts, style.desired_input_layouts, strict=True):
        if have is None or want is None:
            out.append(None)
            continue
        a, b = layout_of(have, f"{name}: input_layouts"), layout_of(want, f"{name}: desired")
        if a == b:
            out.append(None)
        elif a[0] == "shard" and b[0] == "replicate" and a[1] is not None and a[1] >= 0:
            out.append(a)
        else:
            raise ValueError(
                f"{name}: PrepareModuleInput from {have!r} to {want!r}: only a gather "
                f"(Shard(d) -> Replicate(), d >= 0) or no change is supported"
            )
    return out


def _gather_inputs(module: nn.Module, style: Any, name: str, rank: int, comm: dict) -> None:
    """Install PrepareModuleInput's gathers as a forward pre-hook."""
    conversions = _input_conversions(style, name)

    def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(
            x if c is None else gather_replicated(x, c[1], rank, **comm)
            for x, c in zip(args, [*conversions, *[None] * len(args)], strict=False)
        )

    module.register_forward_pre_hook(hook)


def _sum_gradients_on_use(module: nn.Module, comm: dict[str, Any]) -> None:
    """Make every forward of ``module`` use its parameters through :func:`sum_gradients`
    (identity forward, the gradient summed over the group backward): a pre-hook puts the
    summed views in place of the parameters, a hook that runs even when the forward raises
    puts them back. Hooks take the module as an argument, so a copy of the model keeps them."""

    def substitute(m: nn.Module, args: tuple[Any, ...]) -> None:
        saved = [(o, n, p) for o in m.modules() for n, p in o._parameters.items() if p is not None]
        m.__dict__.setdefault("_summed_parameters", []).append(saved)
        for o, n, p in saved:
            o._parameters[n] = sum_gradients(p, **comm)  # type: ignore[assignment]

    def restore(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        for o, n, p in m.__dict__["_summed_parameters"].pop():
            o._parameters[n] = p

    module.register_forward_pre_hook(substitute)
    module.register_forward_hook(restore, always_call=True)


def parallelize_module(
    module: nn.Module,
    groups: GroupsLike = None,
    plan: Mapping[str, Any] | None = None,
    *,
    strategy: str = "ring",
    bidirectional: bool = False,
    share_rings: bool = True,
    context_groups: GroupsLike = None,
    layout: str = "contiguous",
    backend: str = "auto",
    world_size: int | None = None,
    rank: int | None = None,
) -> nn.Module:
    """Make ``module`` tensor-parallel in place by ``plan`` (module docstring); returns it.

    Args:
        module: the model, the same on every rank (moved to the rank's device or not: each new
            layer goes where its original was).
        groups: the tensor-parallel groups (where PyTorch takes a DeviceMesh); None: all ranks.
        plan: ``{module name or pattern: style}``.
        strategy, bidirectional: of every collective matmul
            (:mod:`xla_permute.tensor_parallel.layers`).
        share_rings: column-parallel siblings with sequence-sharded inputs share one ring
            (a ring whose members turn out to read different inputs stops sharing, with a
            warning, and its results stay right).
        context_groups, layout: context parallelism (module docstring of
            :mod:`xla_permute.tensor_parallel.heads`): the groups that split the sequence
            (``Mesh2D``'s ``cp_groups``; ``groups`` then its ``tp_groups``) and the layout of each
            rank's context shard; every parameter's gradient is then also summed over its context
            group (each holds other tokens). The attentions run ring attention over it.
        backend, world_size, rank: as the layers' (None: asked from the running mesh or
            process group).

    Raises:
        TypeError, ValueError: a bad plan (module docstring), before the model changes.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"plan must be a non-empty mapping of module names to styles, got {plan!r}")
    n, r = _world(world_size, rank, groups, backend)
    comm: dict[str, Any] = dict(groups=groups, backend=backend, world_size=n, rank=r)
    layer = dict(strategy=strategy, bidirectional=bidirectional)
    named = dict(module.named_modules())
    chosen = _assign(plan, list(named))
    for name, (_, style) in chosen.items():
        if isinstance(style, HeadwiseParallel | _sequence_parallel_type()):
            inner = [o for o in chosen if o.startswith(name + ".")]
            if inner:
                raise ValueError(
                    f"{inner[0]!r} is inside {name!r}, which {type(style).__name__} takes "
                    f"whole; remove the plan key {chosen[inner[0]][0]!r}"
                )
    context = dict(context_groups=context_groups, layout=check_layout(layout))
    built = {
        name: _build(name, named[name], style, comm, layer, context)
        for name, (_, style) in chosen.items()
    }
    if any(sequence is not None for _, sequence in built.values()):
        _check_covered(module, chosen)
    reduce = dict(groups=groups, backend=backend)
    for name, (new, _) in built.items():
        style = chosen[name][1]
        if new is not None:
            parent, _, attr = name.rpartition(".")
            setattr(named[parent] if parent else module, attr, new)
        elif type(style).__name__ == "SequenceParallel":
            _sum_gradients_on_use(named[name], reduce)
        else:  # PrepareModuleInput
            _gather_inputs(named[name], style, name, r, reduce)
    if share_rings:
        _share_sibling_rings(module)
    if context_groups is not None:  # each context rank holds other tokens: sum everything
        _sum_gradients_on_use(module, dict(groups=context_groups, backend=backend))
    if any(isinstance(new, ParallelAttention) and new.returns_weights for new, _ in built.values()):
        module.register_forward_pre_hook(_refuse_padding_mask, with_kwargs=True)
    return module


def _refuse_padding_mask(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A Hugging Face model's padding mask would be dropped by its parallel attentions."""
    if kwargs.get("attention_mask") is not None or len(args) > 1:
        raise ValueError(
            f"{type(module).__name__} was parallelized with HeadwiseParallel, whose attention "
            f"is causal over the whole sequence and takes no padding mask: call it with "
            f"input_ids only (pack the sequences; no attention_mask)"
        )


def _sequence_parallel_type() -> type:
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel


def _check_covered(module: nn.Module, chosen: Mapping[str, Any]) -> None:
    """With the sequence sharded, a parameter in no planned module is refused: its gradient
    would hold this rank's tokens only."""
    loose = [
        p
        for p, _ in module.named_parameters()
        if not any(p.startswith(name + ".") for name in chosen)
    ]
    if loose:
        raise ValueError(
            f"the plan shards the sequence, but parameters {loose[:4]} are in no planned "
            f"module: on sequence shards each rank's gradient would hold its own tokens only. "
            f"Add their modules to the plan (SequenceParallel() for a norm)"
        )


def _share_sibling_rings(module: nn.Module) -> None:
    """Column-parallel children of one parent, sequence parallel, of one setting: one ring."""
    for parent in module.modules():
        kids = [
            m
            for m in parent.children()
            if isinstance(m, ColumnParallelLinear) and m.sequence_parallel and m.ring is None
        ]
        settings: dict[tuple[Any, ...], list[ColumnParallelLinear]] = {}
        for m in kids:
            key = (m.in_features, m.dim, m.strategy, m.bidirectional, str(m.groups), m.backend)
            settings.setdefault(key, []).append(m)
        for same in settings.values():
            if len(same) > 1:
                share_ring(same)
