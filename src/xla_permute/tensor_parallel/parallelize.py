"""``parallelize_module``: a model made tensor-parallel in place, from a plan of styles.

PyTorch's call on this package's layers (local tensors, no DTensor): the plan maps module
names (``*`` is one name: ``"model.layers.*.mlp.up_proj"``) to PyTorch's own styles, read by
their layouts (every output is local: ``use_local_output`` has no effect). Each swaps its
module for this rank's shard of it, and the model's own ``forward`` runs unchanged:

* ``ColwiseParallel`` on a Linear: :class:`~xla_permute.ColumnParallelLinear`, ``dim=d`` for
  input ``Shard(d)`` (an all-gather-matmul), ``None`` for ``Replicate()``; output ``Shard(-1)``
  or ``Replicate()`` (``gather_output``);
* ``RowwiseParallel`` on a Linear (input ``Shard(-1)``): :class:`~xla_permute.RowParallelLinear`,
  output ``Shard(d)`` (a matmul-reduce-scatter) or ``Replicate()`` (an all-reduce); on an
  Embedding (input ``Replicate()``): :class:`~xla_permute.VocabParallelEmbedding`;
* ``SequenceParallel``: the module runs on sequence shards, its weights whole;
* ``PrepareModuleInput``: ``Shard(d) -> Replicate()`` per positional input, an all-gather;
* :class:`~xla_permute.HeadwiseParallel` (this package's) on an attention: a
  :class:`~xla_permute.ParallelAttention` (q, k and v on one ring);
* Hugging Face's strings (``config.base_model_tp_plan``): ``"colwise"``, ``"rowwise"``, their
  ``_rep`` (``Replicate()`` output, input: a Linear stays whole), ``"replicate"`` (whole); q, k,
  v ``"colwise"`` and o ``"rowwise"`` are ``HeadwiseParallel`` if ParallelAttention is exact.

A Hugging Face gated MLP whose gate and up are ``ColwiseParallel`` on sequence shards becomes
one :class:`~xla_permute.GatedMLP` (one ring for both; the Hugging Face specifics are the last
section here). Weights several ranks hold (a ``SequenceParallel`` module's, KV copies, biases
of row-parallel layers) have their gradients summed inside the backward.

Every new layer is built and everything checked before the model changes: a plan key that
matches no module, a module matched twice, a style on a module it cannot shard, sizes the
group does not divide, a column split that cuts a head, and on sequence shards a parameter in
no planned module.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

import torch
from torch import nn

from xla_permute.collectives import sum_gradients
from xla_permute.pairs import GroupsLike, see
from xla_permute.sequence import check_layout
from xla_permute.tensor_parallel.heads import ParallelAttention, PositionFn
from xla_permute.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    _place,
    gather_replicated,
)
from xla_permute.tensor_parallel.mlp import GatedMLP
from xla_permute.tensor_parallel.vocab import VocabParallelEmbedding

__all__ = ["HeadwiseParallel", "parallelize_module"]


def _layout(placements: Any, what: str) -> tuple[str, int | None]:
    """A style's single layout, ``("shard", d)`` or ``("replicate", None)``."""
    from torch.distributed.tensor import Replicate, Shard

    many = isinstance(placements, tuple | list)
    one = placements[0] if many and len(placements) == 1 else placements
    if isinstance(one, Shard | Replicate):
        return ("shard", one.dim) if isinstance(one, Shard) else ("replicate", None)
    raise ValueError(
        f"{what} = {placements!r}: the layers take one Shard(d) or Replicate() layout (a "
        f"Partial layout has no local equivalent: reduce it first)"
    )


@dataclass(frozen=True)
class HeadwiseParallel:
    """Attention with its heads split over ranks: the module (its Linears ``q_proj, k_proj,
    v_proj, o_proj``) becomes a :class:`~xla_permute.ParallelAttention`, returning
    ``(y, None)`` where a Hugging Face attention was.

    Args:
        input_layouts: ``Shard(1)`` (sequence parallel, the default) or ``Replicate()``.
        position_fn: ``(q, k, positions) -> (q, k)`` after the gather (rotary embeddings).
        causal: the causal mask.
        heads, kv_heads: None: the module's or its ``config``'s ``num_attention_heads``,
            ``num_key_value_heads``.
    """

    input_layouts: Any = None
    position_fn: PositionFn | None = None
    causal: bool = True
    heads: int | None = None
    kv_heads: int | None = None

    def build(self, name: str, module: nn.Module, options: dict[str, Any]) -> ParallelAttention:
        """This rank's :class:`~xla_permute.ParallelAttention` for ``module``."""
        from torch.distributed.tensor import Shard

        layout = Shard(1) if self.input_layouts is None else self.input_layouts
        _, dim = _layout(layout, f"{name}: HeadwiseParallel input_layouts")
        dropout = getattr(module, "attention_dropout", 0.0) or getattr(module, "dropout", 0.0)
        if isinstance(dropout, float) and dropout > 0:
            raise ValueError(f"{name}: attention dropout {dropout} is not supported; use 0.0")
        proj = {r: getattr(module, f"{r}_proj", None) for r in "qkvo"}
        if not all(isinstance(p, nn.Linear) for p in proj.values()):
            raise ValueError(f"HeadwiseParallel on {name!r}: no Linears q_proj/k_proj/...")
        config = getattr(module, "config", None)  # Hugging Face's keeps the head counts
        names = ("num_attention_heads", "num_key_value_heads")
        found = [getattr(module, a, getattr(config, a, None)) for a in names]
        heads, kv_heads = self.heads or found[0], self.kv_heads or found[1]
        if heads is None:
            raise ValueError(f"{name}: no head count found; pass HeadwiseParallel(heads=...)")
        options = dict(options, position_fn=self.position_fn, causal=self.causal, dim=dim)
        options |= dict(head_dim=getattr(module, "head_dim", None), kv_heads=kv_heads)
        hf = _is_hugging_face(module)
        return ParallelAttention.from_linears(**proj, heads=heads, returns_weights=hf, **options)


def _build(name: str, module: nn.Module, style: Any, options: dict[str, Any]) -> nn.Module | None:
    """This rank's replacement of ``module`` (None: the module stays, with hooks)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    what, kind = f"{name}: {type(style).__name__}", type(module).__name__
    layer = {k: v for k, v in options.items() if k not in ("context_groups", "layout")}
    if isinstance(style, ColwiseParallel):
        if not isinstance(module, nn.Linear):
            fix = " (an embedding is RowwiseParallel)" * isinstance(module, nn.Embedding)
            raise ValueError(f"{what} shards an nn.Linear, not a {kind}{fix}")
        _, dim = _layout(style.input_layouts, f"{what} input_layouts")
        out = _layout(style.output_layouts, f"{what} output_layouts")
        if (dim is not None and dim < 0) or out not in (("shard", -1), ("replicate", None)):
            raise ValueError(
                f"{what}: the input is whole (Replicate()) or split along the sequence "
                f"(Shard(1)), the output Shard(-1) or Replicate(); on feature shards a Linear "
                f"is RowwiseParallel"
            )
        gather = out[0] == "replicate"
        return ColumnParallelLinear.from_linear(module, dim=dim, gather_output=gather, **layer)
    if isinstance(style, RowwiseParallel):
        inp = _layout(style.input_layouts, f"{what} input_layouts")
        _, dim = _layout(style.output_layouts, f"{what} output_layouts")
        if dim is not None and dim < 0:
            raise ValueError(f"{what}: the output is Replicate() or Shard(1), the sequence")
        if isinstance(module, nn.Embedding):
            if inp != ("replicate", None):
                raise ValueError(f"{what}: an embedding takes the tokens whole: Replicate()")
            comm = {k: layer[k] for k in ("groups", "backend", "world_size", "rank")}
            return VocabParallelEmbedding.from_embedding(module, dim=dim, **comm)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{what} shards an nn.Linear or nn.Embedding, not a {kind}")
        if inp != ("shard", -1):
            raise ValueError(f"{what}: the input is this rank's features, Shard(-1)")
        return RowParallelLinear.from_linear(module, dim=dim, **layer)
    if isinstance(style, HeadwiseParallel):
        return style.build(name, module, options)
    return None


def _gathers(style: Any, name: str) -> list[int | None]:
    """PrepareModuleInput's positional conversions: per input, the dim to gather or None."""
    if style.with_kwargs:
        raise ValueError(f"{name}: PrepareModuleInput converts positional inputs only here")
    dims: list[int | None] = []
    for have, want in zip(style.input_layouts, style.desired_input_layouts, strict=True):
        a = None if have is None else _layout(have, f"{name}: input_layouts")
        b = None if want is None else _layout(want, f"{name}: desired_input_layouts")
        if a is not None and b is not None and a != b and (b[0], a[0]) != ("replicate", "shard"):
            raise ValueError(f"{name}: PrepareModuleInput only gathers (Shard(d) -> Replicate())")
        dims.append(None if a == b or a is None or b is None else a[1])
    return dims


def _gather_inputs(dims: list, position: int, comm: dict, _: nn.Module, args: tuple) -> tuple:
    """PrepareModuleInput's pre-hook: the inputs with a dim in ``dims`` gathered."""
    dims = [*dims, *[None] * len(args)]
    return tuple(
        x if d is None else gather_replicated(x, d, position, **comm)
        for x, d in zip(args, dims, strict=False)
    )


def _sum_gradients_on_use(module: nn.Module, comm: dict[str, Any]) -> None:
    """Every forward of ``module`` uses its parameters through :func:`sum_gradients`: a
    pre-hook swaps them in, a hook that runs even when the forward raises swaps them back."""

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
        module: the model, the same on every rank (each new layer goes where its original was).
        groups: the tensor-parallel groups (where PyTorch takes a DeviceMesh); None: all ranks.
        plan: ``{module name or pattern: style}``.
        strategy, bidirectional: of every layer (:mod:`~xla_permute.tensor_parallel.layers`).
        context_groups, layout: context parallelism (:mod:`~xla_permute.tensor_parallel.heads`;
            ``Mesh2D``'s ``cp_groups``, ``groups`` its ``tp_groups``); every gradient is then
            also summed over the context group (each rank holds other tokens).
        backend, world_size, rank: as the layers' (None: asked from the running mesh).

    Raises ``TypeError``, ``ValueError`` for a bad plan (module docstring), before any change.
    """
    from torch.distributed.tensor import parallel as tp

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"plan must be a non-empty mapping of module names to styles, got {plan!r}")
    n, r = _place(groups, backend, world_size, rank, "parallelize_module")
    options = dict(groups=groups, backend=backend, world_size=n, rank=r, strategy=strategy)
    options |= dict(bidirectional=bidirectional, context_groups=context_groups)
    options["layout"] = check_layout(layout)
    named = dict(module.named_modules())
    prefix = getattr(module, "base_model_prefix", "")  # Hugging Face's plans start there
    chosen = _hf_styles(module, named, _assign(plan, list(named), prefix))
    styles = (tp.ColwiseParallel, tp.RowwiseParallel, tp.SequenceParallel, tp.PrepareModuleInput)
    for name, style in chosen.items():
        inner = [o for o in chosen if o.startswith(name + ".")]
        if not isinstance(style, (*styles, HeadwiseParallel)):  # the module docstring's
            raise TypeError(f"{name}: style {type(style).__name__} is not one this package applies")
        if inner and isinstance(style, HeadwiseParallel | tp.SequenceParallel):
            raise ValueError(f"{inner[0]!r} is inside {name!r}, which its style takes whole")
        if isinstance(style, tp.PrepareModuleInput):
            _gathers(style, name)  # checked now, installed below
    new = {name: _build(name, named[name], style, options) for name, style in chosen.items()}
    _check_built(module, named, chosen, new, n)
    new = {name: layer for name, layer in new.items() if layer is not None}
    _fuse_gated_mlps(named, new, chosen)  # before anything changes: GatedMLP checks
    comm = dict(groups=groups, backend=backend)
    for name, style in chosen.items():
        if isinstance(style, tp.SequenceParallel):
            _sum_gradients_on_use(named[name], comm)
        elif isinstance(style, tp.PrepareModuleInput):
            hook = partial(_gather_inputs, _gathers(style, name), r, comm)
            named[name].register_forward_pre_hook(hook)
    for name, layer in new.items():
        parent, _, attr = name.rpartition(".")
        setattr(named[parent] if parent else module, attr, layer)
    if context_groups is not None:  # each context rank holds other tokens: sum everything
        _sum_gradients_on_use(module, dict(groups=context_groups, backend=backend))
    if any(isinstance(m, ParallelAttention) and m.returns_weights for m in new.values()):
        module.register_forward_pre_hook(_refuse_padding_mask, with_kwargs=True)
    return module


def _assign(plan: Mapping[str, Any], names: list[str], prefix: str = "") -> dict[str, Any]:
    """``module name -> style`` (``*`` is one name of the path; else tried after ``prefix.``);
    ValueError for a key that matches nothing or a module two keys give different styles."""
    chosen: dict[str, Any] = {}
    keys: dict[str, str] = {}
    split = [(n, n.split(".")) for n in names if n]
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"plan keys are module names (str), got {key!r}")
        for parts in (key.split("."), [prefix, *key.split(".")]):  # "" matches no name
            hits = [n for n, p in split if len(p) == len(parts) and all(map(fnmatchcase, p, parts))]
            if hits:
                break
        if not hits:
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
            raise ValueError(f"plan key {key!r} matches no module; close: {close}{see('plan')}")
        for hit in hits:
            if hit in chosen and chosen[hit] is not style and chosen[hit] != style:
                raise ValueError(f"module {hit!r} is matched by two plan keys: {keys[hit]!r}")
            chosen[hit], keys[hit] = style, key
    return chosen


def _check_built(module: nn.Module, named: dict, chosen: dict, new: dict, n: int) -> None:
    """A column split of an attention's projection (its parent has ``head_dim``) must leave
    each rank whole heads; a weight two modules share (tied) is replaced in both or neither;
    with the sequence sharded, a parameter in no planned module is refused (its gradient
    would hold this rank's tokens only)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    for name, layer in new.items():
        parent, _, _ = name.rpartition(".")
        hd, rows = getattr(named[parent], "head_dim", 0), getattr(layer, "out_features", 0)
        cut = isinstance(layer, ColumnParallelLinear) and not layer.gather_output
        if cut and isinstance(hd, int) and hd > 0 and rows % hd == 0 and (rows // hd) % n:
            raise ValueError(
                f"{name}: ColwiseParallel would cut its {rows // hd} heads of {hd} features "
                f"over {n} ranks ({rows / hd / n:g} a rank). Make {parent!r} HeadwiseParallel() "
                f"(ranks share a KV head) or use ranks that divide {rows // hd}{see('plan')}"
            )
    params = list(module.named_parameters(remove_duplicate=False))
    first = {id(p): k for k, p in reversed(params)}  # a tied weight's first name
    replaced = tuple(name + "." for name, layer in new.items() if layer is not None)
    for k, p in params:
        if first[id(p)] != k and k.startswith(replaced) != first[id(p)].startswith(replaced):
            raise ValueError(f"{k} is {first[id(p)]} (tied): plan both or neither, or untie them")
    layers = [getattr(m, "o_proj", m) for m in new.values()]  # an attention: its o_proj's dim
    sharded = any(getattr(m, "dim", None) is not None for m in layers)
    planned = tuple(name + "." for name in chosen)
    loose = [p for p, _ in module.named_parameters() if not any(map(p.startswith, planned))]
    if loose and (sharded or any(isinstance(s, SequenceParallel) for s in chosen.values())):
        raise ValueError(
            f"the plan shards the sequence, but parameters {loose[:4]} are in no planned "
            f"module: each rank's gradient would hold its own tokens only. Add their modules "
            f"to the plan (SequenceParallel() for a norm)"
        )


# --- Hugging Face: what its modules need, in one place -------------------------------------


def _is_hugging_face(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def _hf_styles(model: nn.Module, named: dict[str, nn.Module], chosen: dict) -> dict[str, Any]:
    """``chosen`` with Hugging Face's strings as styles (module docstring); ValueError naming a
    string it does not apply and the style to use instead."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import parallel as tp

    known = {"colwise": tp.ColwiseParallel(), "rowwise": tp.RowwiseParallel(), "replicate": None}
    known |= {"colwise_rep": tp.ColwiseParallel(output_layouts=Replicate())}
    known |= {"rowwise_rep": tp.RowwiseParallel(input_layouts=Replicate())}
    strings = {k: v for k, v in chosen.items() if isinstance(v, str)}
    for name, style in strings.items():
        if style not in known:
            hint = {"sequence_parallel": "SequenceParallel()"}.get(style, f"one of {sorted(known)}")
            if style.startswith(("local", "gather", "grouped_gemm", "ep_router")):  # experts'
                hint = "ColwiseParallel()/RowwiseParallel() on each expert's Linears"
            raise ValueError(f"{name}: Hugging Face's {style!r} is not applied here; use {hint}")
        whole = isinstance(named[name], nn.Linear) and style == "rowwise_rep"  # the same product
        chosen[name] = None if whole else known[style]
    for name, attn in named.items():
        parts = {f"{name}.{p}_proj": "rowwise" if p == "o" else "colwise" for p in "qkvo"}
        if all(strings.get(p) == s for p, s in parts.items()) and (rope := _rope(model, attn)):
            chosen = {k: v for k, v in chosen.items() if k not in parts}
            chosen[name] = HeadwiseParallel(input_layouts=Replicate(), position_fn=rope)
    return {name: style for name, style in chosen.items() if style is not None}


def _rope(model: nn.Module, attn: nn.Module) -> PositionFn | None:
    """The rotary embedding (the model's ``rotary_emb``) of a Hugging Face attention that
    ParallelAttention computes exactly: causal, softmax scale ``head_dim ** -0.5``, no sliding
    window or soft cap, parameters in q, k, v, o only; None for any other."""
    hd, own = getattr(attn, "head_dim", 0), {p.split(".")[0] for p, _ in attn.named_parameters()}
    rotary = [m for n, m in model.named_modules() if n.rpartition(".")[2] == "rotary_emb"]
    apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    odd = getattr(attn, "sliding_window", None) or getattr(attn, "attn_logit_softcapping", None)
    scaled = isinstance(hd, int) and hd > 0 and getattr(attn, "scaling", None) == hd**-0.5
    plain = own == {"q_proj", "k_proj", "v_proj", "o_proj"} and getattr(attn, "is_causal", 0)
    if not plain or not scaled or odd or len(rotary) != 1 or apply is None:
        return None
    return lambda q, k, positions: apply(q, k, *rotary[0](q, positions[None]))


def _act_times(act: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return act(a) * b


def _fuse_gated_mlps(named: dict, new: dict[str, nn.Module], chosen: Mapping[str, Any]) -> None:
    """Hugging Face's gated MLPs (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Llama,
    Mistral, Qwen2, ...) whose gate and up the plan made column-parallel on sequence shards
    become, in ``new``, one :class:`~xla_permute.GatedMLP` (one ring; theirs would run two)."""
    for name, mlp in named.items():
        parts = [f"{name}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        gate, up, down = (new.get(p) for p in parts)
        columns = isinstance(gate, ColumnParallelLinear) and isinstance(up, ColumnParallelLinear)
        hf = name not in chosen and _is_hugging_face(mlp) and hasattr(mlp, "act_fn")
        chain = columns and isinstance(down, RowParallelLinear) and gate.dim is not None
        gathered = chain and (gate.gather_output or up.gather_output)
        if hf and chain and gate.dim == up.dim == down.dim and not gathered:
            new[name] = GatedMLP(gate, up, down, partial(_act_times, mlp.act_fn))
            for p in parts:
                del new[p]


def _refuse_padding_mask(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A Hugging Face model's padding mask would be dropped by its parallel attentions."""
    if kwargs.get("attention_mask") is not None or len(args) > 1:
        raise ValueError(
            f"{type(module).__name__}'s attentions (HeadwiseParallel) take no padding mask: call "
            f"it with input_ids only (pack the sequences)"
        )
