"""The styles of a plan: PyTorch's, read as they are, and :class:`HeadwiseParallel`, this package's.

A plan maps module names to styles, as ``torch.distributed.tensor.parallel.parallelize_module``'s
does, with PyTorch's own style objects (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``) and their layouts (``Shard(d)``, ``Replicate()``).
Each style becomes this package's layer, holding local tensors (no DTensor); what each layout
pair becomes:

* ``ColwiseParallel`` on a Linear: input ``Shard(d)`` -> an all-gather-matmul; input
  ``Replicate()`` -> a local matmul; output ``Shard(-1)`` (this rank's features) or
  ``Replicate()`` (then an all-gather);
* ``RowwiseParallel`` on a Linear: input ``Shard(-1)``; output ``Shard(d)`` -> a
  matmul-reduce-scatter, ``Replicate()`` -> a matmul and an all-reduce;
* ``RowwiseParallel`` on an Embedding: input ``Replicate()`` (the tokens); output
  ``Shard(d)`` or ``Replicate()``: a vocabulary-parallel embedding;
* ``SequenceParallel`` on any module: it runs on sequence shards, its weights whole, their
  gradients summed over the group;
* ``PrepareModuleInput`` on any module: ``Shard(d) -> Replicate()`` per positional input, an
  all-gather;
* :class:`HeadwiseParallel` on an attention: input ``Shard(1)`` or ``Replicate()`` -> a
  :class:`~xla_permute.tensor_parallel.heads.ParallelAttention`.

``use_local_output`` is accepted and has no effect: every output is a local tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from xla_permute.tensor_parallel.heads import PositionFn

__all__ = ["HeadwiseParallel", "layout_of", "one_layout"]

# A layout as this package reads one: ("shard", d) or ("replicate", None).
Layout = tuple[str, int | None]


def layout_of(placement: object, what: str) -> Layout:
    """``Shard(d)`` -> ``("shard", d)``, ``Replicate()`` -> ``("replicate", None)``; a
    ``Partial`` or anything else is refused (ValueError naming ``what``)."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(placement, Shard):
        return ("shard", placement.dim)
    if isinstance(placement, Replicate):
        return ("replicate", None)
    raise ValueError(
        f"{what} = {placement!r}: this package's layers take Shard(d) or Replicate() layouts "
        f"(a Partial layout has no local equivalent: reduce it first)"
    )


def one_layout(placements: Sequence[object] | object, what: str) -> Layout:
    """The layout of a style's single input or output (a tuple of one, as PyTorch keeps it)."""
    if isinstance(placements, tuple | list):
        if len(placements) != 1:
            raise ValueError(f"{what} must name one layout, got {placements!r}")
        placements = placements[0]
    return layout_of(placements, what)


@dataclass(frozen=True)
class HeadwiseParallel:
    """Attention with its heads split over ranks: the module becomes a
    :class:`~xla_permute.tensor_parallel.heads.ParallelAttention` (one ring for q/k/v, one for o).

    Args:
        input_layouts: ``Shard(1)`` (sequence parallel, the default) or ``Replicate()``;
            the output takes the same layout.
        position_fn: ``(q, k, positions) -> (q, k)`` applied after the gather (rotary
            embeddings); None: none.
        causal: the causal mask.
        heads, kv_heads, head_dim: read from the module when None (``config``'s
            ``num_attention_heads``/``num_key_value_heads``, or the module's ``num_heads``,
            ``n_heads``, ``num_key_value_heads``, ``n_kv_heads``, ``head_dim``).
        q, k, v, o: the projections' names in the module (default: the first of
            ``q_proj, k_proj, v_proj, o_proj`` and ``wq, wk, wv, wo`` it has); ``qkv``: the
            name of a fused ``[q | k | v]`` projection instead of q, k, v.
        returns_weights: return ``(y, None)`` as a Hugging Face attention does; None: when the
            module is one (its class comes from ``transformers``).
    """

    input_layouts: Any = None
    position_fn: PositionFn | None = None
    causal: bool = True
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    q: str | None = None
    k: str | None = None
    v: str | None = None
    o: str | None = None
    qkv: str | None = None
    returns_weights: bool | None = None

    def layout(self) -> Layout:
        from torch.distributed.tensor import Shard

        placement = Shard(1) if self.input_layouts is None else self.input_layouts
        layout = one_layout(placement, "HeadwiseParallel(input_layouts=)")
        return layout

    def projections(self, module: nn.Module, name: str) -> dict[str, nn.Linear]:
        """The module's projections by role (``q, k, v, o`` or ``qkv, o``); ValueError when
        it has none of the known names or names that are not Linears."""
        if self.qkv is not None:
            names = {"qkv": self.qkv, "o": self.o or "o_proj"}
        elif self.q is not None:
            names = {"q": self.q, "k": self.k, "v": self.v, "o": self.o}
        else:
            known = [("q_proj", "k_proj", "v_proj", "o_proj"), ("wq", "wk", "wv", "wo")]
            found = next((n for n in known if all(hasattr(module, a) for a in n)), None)
            if found is None:
                raise ValueError(
                    f"HeadwiseParallel on {name!r} ({type(module).__name__}): it has none of "
                    f"q_proj/k_proj/v_proj/o_proj or wq/wk/wv/wo; name its projections: "
                    f"HeadwiseParallel(q=..., k=..., v=..., o=...) or (qkv=..., o=...)"
                )
            names = dict(zip("qkvo", found, strict=True))
        found = {}
        for role, attr in names.items():
            lin = getattr(module, attr or "", None)
            if not isinstance(lin, nn.Linear):
                raise ValueError(
                    f"HeadwiseParallel on {name!r}: {role}={attr!r} is not an nn.Linear of "
                    f"{type(module).__name__} (got {type(lin).__name__})"
                )
            found[role] = lin
        return found

    def head_counts(self, module: nn.Module, name: str) -> tuple[int, int, int | None]:
        """``(heads, kv_heads, head_dim)``, given or read from the module."""
        config = getattr(module, "config", None)

        def read(given: int | None, *attrs: str) -> int | None:
            if given is not None:
                return given
            for owner in (module, config):
                for attr in attrs:
                    value = getattr(owner, attr, None)
                    if isinstance(value, int) and not isinstance(value, bool):
                        return value
            return None

        heads = read(self.heads, "num_attention_heads", "num_heads", "n_heads")
        if heads is None:
            raise ValueError(
                f"HeadwiseParallel on {name!r}: the head count is neither given nor found on "
                f"the module; pass HeadwiseParallel(heads=..., kv_heads=...)"
            )
        kv = read(self.kv_heads, "num_key_value_heads", "n_kv_heads", "num_kv_heads")
        return heads, heads if kv is None else kv, read(self.head_dim, "head_dim")

    def hf_outputs(self, module: nn.Module) -> bool:
        if self.returns_weights is not None:
            return self.returns_weights
        return type(module).__module__.startswith("transformers.")
