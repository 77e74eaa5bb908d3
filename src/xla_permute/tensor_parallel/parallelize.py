"""``parallelize_module``: a model made tensor-parallel in place, from a plan of styles.

PyTorch's call (``torch.distributed.tensor.parallel.parallelize_module``) on this package's
layers, which hold local tensors (no DTensor). The plan maps module names (``*`` matches one
name of the path, as in ``"model.layers.*.mlp.up_proj"``) to PyTorch's own style objects, read
by their layouts (``Shard(d)``, ``Replicate()``; ``use_local_output`` has no effect: every
output is a local tensor). Each style swaps its module for this rank's shard of it, the
weights cut from the original, so that the model's own ``forward`` runs unchanged:

* ``ColwiseParallel`` on a Linear: a :class:`~xla_permute.ColumnParallelLinear`; input
  ``Shard(d)``: an all-gather-matmul (``dim=d``), ``Replicate()``: a local matmul; output
  ``Shard(-1)`` (this rank's features) or ``Replicate()`` (then gathered);
* ``RowwiseParallel`` on a Linear: a :class:`~xla_permute.RowParallelLinear`; input
  ``Shard(-1)``; output ``Shard(d)``: a matmul-reduce-scatter, ``Replicate()``: an all-reduce.
  On an Embedding (input ``Replicate()``, the tokens): a
  :class:`~xla_permute.VocabParallelEmbedding`;
* ``SequenceParallel`` on any module: it runs on sequence shards, its weights whole;
* ``PrepareModuleInput``: ``Shard(d) -> Replicate()`` per positional input, an all-gather;
* :class:`HeadwiseParallel` (this package's) on an attention: a
  :class:`~xla_permute.ParallelAttention` (q, k and v on one ring).

Gate and up of a Hugging Face gated MLP, both ``ColwiseParallel`` on sequence shards beside
a ``RowwiseParallel`` down, become one :class:`~xla_permute.GatedMLP` (x travels once for
both); the Hugging Face specifics are the last section of this module. The gradients of
weights several ranks hold (a ``SequenceParallel`` module's, grouped-query attention's KV
copies, row-parallel biases) are summed over the group inside the backward: **no gradient
sum is left to the user**.

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
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from xla_permute.collectives import sum_gradients
from xla_permute.pairs import GroupsLike
from xla_permute.sequence import check_layout
from xla_permute.tensor_parallel.heads import ParallelAttention, PositionFn
from xla_permute.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, _place
from xla_permute.tensor_parallel.mlp import GatedMLP
from xla_permute.tensor_parallel.regions import gather_replicated
from xla_permute.tensor_parallel.vocab import VocabParallelEmbedding

__all__ = ["HeadwiseParallel", "parallelize_module"]

# A layout as this module reads one: ("shard", d) or ("replicate", None).
Layout = tuple[str, int | None]


def _layout(placements: Any, what: str) -> Layout:
    """A style's single layout (PyTorch keeps it as a tuple of one)."""
    from torch.distributed.tensor import Replicate, Shard

    one = placements[0] if isinstance(placements, tuple | list) else placements
    if isinstance(placements, tuple | list) and len(placements) != 1:
        raise ValueError(f"{what} must name one layout, got {placements!r}")
    if isinstance(one, Shard):
        return ("shard", one.dim)
    if isinstance(one, Replicate):
        return ("replicate", None)
    raise ValueError(
        f"{what} = {placements!r}: this package's layers take Shard(d) or Replicate() layouts "
        f"(a Partial layout has no local equivalent: reduce it first)"
    )


@dataclass(frozen=True)
class HeadwiseParallel:
    """Attention with its heads split over ranks: the module becomes a
    :class:`~xla_permute.ParallelAttention` (one ring for q/k/v, one for o).

    Args:
        input_layouts: ``Shard(1)`` (sequence parallel, the default) or ``Replicate()``;
            the output takes the same layout.
        position_fn: ``(q, k, positions) -> (q, k)`` applied after the gather (rotary
            embeddings); None: none.
        causal: the causal mask.
        heads, kv_heads, head_dim: read from the module when None (its ``config``'s
            ``num_attention_heads``/``num_key_value_heads``, or its ``num_heads``,
            ``n_heads``, ``num_key_value_heads``, ``n_kv_heads``, ``head_dim``). The
            projections are its ``q_proj, k_proj, v_proj, o_proj`` or ``wq, wk, wv, wo``.
        returns_weights: return ``(y, None)`` as a Hugging Face attention does; None: when the
            module is one.
    """

    input_layouts: Any = None
    position_fn: PositionFn | None = None
    causal: bool = True
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    returns_weights: bool | None = None

    def build(
        self, name: str, module: nn.Module, options: dict[str, Any]
    ) -> tuple[ParallelAttention, bool]:
        """This rank's :class:`~xla_permute.ParallelAttention` for ``module``, and whether
        its input is on sequence shards."""
        from torch.distributed.tensor import Shard

        layout = Shard(1) if self.input_layouts is None else self.input_layouts
        _, dim = _layout(layout, f"{name}: HeadwiseParallel(input_layouts=)")
        dropout = getattr(module, "attention_dropout", 0.0) or getattr(module, "dropout", 0.0)
        if isinstance(dropout, float) and dropout > 0:
            raise ValueError(
                f"{name}: attention dropout {dropout} is not supported by ParallelAttention; "
                f"build the model with attention_dropout=0.0"
            )
        known = [("q_proj", "k_proj", "v_proj", "o_proj"), ("wq", "wk", "wv", "wo")]
        found = next((n for n in known if all(hasattr(module, a) for a in n)), None)
        proj = dict(zip("qkvo", [getattr(module, a) for a in found or ()], strict=False))
        if found is None or not all(isinstance(p, nn.Linear) for p in proj.values()):
            raise ValueError(
                f"HeadwiseParallel on {name!r} ({type(module).__name__}): it has no Linears "
                f"q_proj/k_proj/v_proj/o_proj or wq/wk/wv/wo"
            )
        config = getattr(module, "config", None)

        def read(given: int | None, *attrs: str) -> int | None:
            values = [getattr(o, a, None) for o in (module, config) for a in attrs]
            ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
            return given if given is not None else next(iter(ints), None)

        heads = read(self.heads, "num_attention_heads", "num_heads", "n_heads")
        if heads is None:
            raise ValueError(
                f"HeadwiseParallel on {name!r}: the head count is neither given nor found on "
                f"the module; pass HeadwiseParallel(heads=..., kv_heads=...)"
            )
        kv_heads = read(self.kv_heads, "num_key_value_heads", "n_kv_heads", "num_kv_heads")
        returns = _is_hugging_face(module) if self.returns_weights is None else self.returns_weights
        new = ParallelAttention.from_linears(
            **proj,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=read(self.head_dim, "head_dim"),
            position_fn=self.position_fn,
            causal=self.causal,
            returns_weights=returns,
            **options,
            dim=dim,
        )
        return new, dim is not None


def _build(
    name: str,
    module: nn.Module,
    style: Any,
    comm: dict[str, Any],
    options: dict[str, Any],
    attention: dict[str, Any],
) -> tuple[nn.Module | None, bool]:
    """This rank's replacement of ``module`` (None: the module stays, with hooks) and whether
    the style puts activations on sequence shards."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    kind = type(module).__name__
    if isinstance(style, ColwiseParallel):
        if not isinstance(module, nn.Linear):
            fix = " (a vocabulary-parallel embedding is RowwiseParallel)"
            fix = fix if isinstance(module, nn.Embedding) else ""
            raise ValueError(f"{name}: ColwiseParallel shards an nn.Linear, not a {kind}{fix}")
        inp, dim = _layout(style.input_layouts, f"{name}: ColwiseParallel input_layouts")
        out = _layout(style.output_layouts, f"{name}: ColwiseParallel output_layouts")
        if inp == "shard" and dim < 0:
            raise ValueError(
                f"{name}: ColwiseParallel(input_layouts=Shard({dim})) shards the features; a "
                f"column-parallel input is whole (Replicate()) or split along the sequence "
                f"(Shard(1)): a Linear on feature shards is RowwiseParallel"
            )
        if out not in (("shard", -1), ("replicate", None)):
            raise ValueError(
                f"{name}: ColwiseParallel(output_layouts={style.output_layouts!r}): the output "
                f"is this rank's features (Shard(-1)) or gathered (Replicate())"
            )
        gather = out[0] == "replicate"
        new = ColumnParallelLinear.from_linear(module, dim=dim, gather_output=gather, **options)
        return new, dim is not None
    if isinstance(style, RowwiseParallel):
        inp = _layout(style.input_layouts, f"{name}: RowwiseParallel input_layouts")
        _, dim = _layout(style.output_layouts, f"{name}: RowwiseParallel output_layouts")
        if dim is not None and dim < 0:
            raise ValueError(
                f"{name}: RowwiseParallel(output_layouts=Shard({dim})): the output is summed "
                f"over ranks, then whole (Replicate()) or scattered along the sequence (Shard(1))"
            )
        if isinstance(module, nn.Embedding):
            if inp != ("replicate", None):
                raise ValueError(
                    f"{name}: a vocabulary-parallel embedding takes the tokens whole: "
                    f"RowwiseParallel(input_layouts=Replicate())"
                )
            output = "replicated" if dim is None else "sequence"
            new = VocabParallelEmbedding.from_embedding(module, output=output, dim=dim or 1, **comm)
            return new, dim is not None
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"{name}: RowwiseParallel shards an nn.Linear or nn.Embedding, not a {kind}"
            )
        if inp != ("shard", -1):
            raise ValueError(
                f"{name}: RowwiseParallel takes this rank's features (input_layouts=Shard(-1), "
                f"the output of a ColwiseParallel), got {style.input_layouts!r}"
            )
        return RowParallelLinear.from_linear(module, dim=dim, **options), dim is not None
    if isinstance(style, SequenceParallel):
        return None, True
    if isinstance(style, PrepareModuleInput):
        _gathers(style, name)  # checked now, installed later
        return None, False
    if isinstance(style, HeadwiseParallel):
        return style.build(name, module, {**options, **attention})
    raise TypeError(
        f"{name}: style {type(style).__name__} is not one this package applies; use "
        f"ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput "
        f"(torch.distributed.tensor.parallel) or xla_permute.HeadwiseParallel"
    )


def _gathers(style: Any, name: str) -> list[int | None]:
    """PrepareModuleInput's positional conversions: per input, the dim to gather or None."""
    if style.with_kwargs and any(
        _layout(have, name) != _layout(style.desired_input_kwarg_layouts.get(k), name)
        for k, have in style.input_kwarg_layouts.items()
    ):
        raise ValueError(f"{name}: PrepareModuleInput converts positional inputs only here")
    dims: list[int | None] = []
    for have, want in zip(style.input_layouts, style.desired_input_layouts, strict=True):
        a = None if have is None else _layout(have, f"{name}: input_layouts")
        b = None if want is None else _layout(want, f"{name}: desired_input_layouts")
        if a is None or b is None or a == b:
            dims.append(None)
        elif a[0] == "shard" and b[0] == "replicate" and a[1] >= 0:
            dims.append(a[1])
        else:
            raise ValueError(
                f"{name}: PrepareModuleInput from {have!r} to {want!r}: only a gather "
                f"(Shard(d) -> Replicate(), d >= 0) or no change is supported"
            )
    return dims


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
        strategy, bidirectional: of every layer (:mod:`xla_permute.tensor_parallel.layers`;
            the cost model's advice, ``xla_permute_tools.cost.choose_strategy``, is a value
            to pass here).
        context_groups, layout: context parallelism (:mod:`xla_permute.tensor_parallel.heads`):
            the groups that split the sequence (``Mesh2D``'s ``cp_groups``; ``groups`` then its
            ``tp_groups``) and the layout of each rank's context shard; every parameter's
            gradient is then also summed over its context group (each holds other tokens).
        backend, world_size, rank: as the layers' (None: asked from the running mesh or
            process group).

    Raises:
        TypeError, ValueError: a bad plan (module docstring), before the model changes.
    """
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"plan must be a non-empty mapping of module names to styles, got {plan!r}")
    n, r = _place(groups, backend, world_size, rank, "parallelize_module")
    comm: dict[str, Any] = dict(groups=groups, backend=backend, world_size=n, rank=r)
    options = dict(comm, strategy=strategy, bidirectional=bidirectional)
    named = dict(module.named_modules())
    chosen = _assign(plan, list(named))
    for name, style in chosen.items():
        inner = [o for o in chosen if o.startswith(name + ".")]
        if inner and isinstance(style, HeadwiseParallel | SequenceParallel):
            raise ValueError(
                f"{inner[0]!r} is inside {name!r}, which {type(style).__name__} takes whole; "
                f"remove its plan key"
            )
    attention = dict(context_groups=context_groups, layout=check_layout(layout))
    built = {
        name: _build(name, named[name], style, comm, options, attention)
        for name, style in chosen.items()
    }
    if any(sequence for _, sequence in built.values()):
        _check_covered(module, chosen)
    new = {name: layer for name, (layer, _) in built.items() if layer is not None}
    _fuse_gated_mlps(named, new, chosen)  # before anything changes: GatedMLP checks
    reduce = dict(groups=groups, backend=backend)
    for name, style in chosen.items():
        if isinstance(style, SequenceParallel):
            _sum_gradients_on_use(named[name], reduce)
        elif isinstance(style, PrepareModuleInput):
            dims = _gathers(style, name)

            def gather(_: nn.Module, args: tuple[Any, ...], dims: list = dims) -> tuple:
                dims = [*dims, *[None] * len(args)]
                return tuple(x if d is None else gather_replicated(x, d, r, **reduce)
                             for x, d in zip(args, dims, strict=False))  # fmt: skip

            named[name].register_forward_pre_hook(gather)
    for name in new:
        parent, _, attr = name.rpartition(".")
        setattr(named[parent] if parent else module, attr, new[name])
    if context_groups is not None:  # each context rank holds other tokens: sum everything
        _sum_gradients_on_use(module, dict(groups=context_groups, backend=backend))
    if any(isinstance(m, ParallelAttention) and m.returns_weights for m in new.values()):
        module.register_forward_pre_hook(_refuse_padding_mask, with_kwargs=True)
    return module


def _matches(pattern: str, name: str) -> bool:
    """``pattern`` matches the module path ``name`` name by name (``*`` is one name)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(map(fnmatch.fnmatchcase, names, parts))


def _assign(plan: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """``module name -> style``; ValueError for a key that matches nothing or a module that
    two keys match."""
    chosen: dict[str, Any] = {}
    keys: dict[str, str] = {}
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
                    f"module {hit!r} is matched by two plan keys, {keys[hit]!r} and {key!r}; "
                    f"give it one style"
                )
            chosen[hit], keys[hit] = style, key
    return chosen


def _check_covered(module: nn.Module, chosen: Mapping[str, Any]) -> None:
    """With the sequence sharded, a parameter in no planned module is refused: its gradient
    would hold this rank's tokens only."""
    loose = [
        p for p, _ in module.named_parameters() if not any(p.startswith(n + ".") for n in chosen)
    ]
    if loose:
        raise ValueError(
            f"the plan shards the sequence, but parameters {loose[:4]} are in no planned "
            f"module: on sequence shards each rank's gradient would hold its own tokens only. "
            f"Add their modules to the plan (SequenceParallel() for a norm)"
        )


# --- Hugging Face: what its modules need, in one place -------------------------------------


def _is_hugging_face(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def _act_times(act: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return act(a) * b


def _fuse_gated_mlps(
    named: dict[str, nn.Module], new: dict[str, nn.Module], chosen: Mapping[str, Any]
) -> None:
    """Hugging Face's gated MLPs (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Llama,
    Mistral, Qwen2, ...) whose gate and up the plan made column-parallel on sequence shards:
    in ``new`` (``{name: replacement}``) the MLP becomes one :class:`~xla_permute.GatedMLP`
    of the three layers (gate and up on one ring); its own forward would run two."""
    for name, mlp in named.items():
        if name in chosen or not _is_hugging_face(mlp) or not hasattr(mlp, "act_fn"):
            continue
        parts = [f"{name}.{p}".lstrip(".") for p in ("gate_proj", "up_proj", "down_proj")]
        gate, up, down = (new.get(p) for p in parts)
        if (
            isinstance(gate, ColumnParallelLinear)
            and isinstance(up, ColumnParallelLinear)
            and isinstance(down, RowParallelLinear)
            and gate.dim is not None
            and gate.dim == up.dim == down.dim
            and not (gate.gather_output or up.gather_output)
        ):
            new[name] = GatedMLP(gate, up, down, partial(_act_times, mlp.act_fn))
            for p in parts:
                del new[p]


def _refuse_padding_mask(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A Hugging Face model's padding mask would be dropped by its parallel attentions."""
    if kwargs.get("attention_mask") is not None or len(args) > 1:
        raise ValueError(
            f"{type(module).__name__} was parallelized with HeadwiseParallel, whose attention "
            f"is causal over the whole sequence and takes no padding mask: call it with "
            f"input_ids only (pack the sequences; no attention_mask)"
        )
