"""Tensor-parallel layers on collective matmul (Megatron naming, sequence-parallel form).

With sequence parallelism (Megatron-LM's ``sequence_parallel=True``) activations between
blocks are sharded along the sequence, so a column-parallel linear starts with an all-gather
and a row-parallel linear ends with a reduce-scatter: exactly the two collectives that
collective matmul overlaps with the matmul. ``strategy="baseline"`` runs the upstream
baseline (blocking collective, then matmul) for comparison.

Per-rank shapes, N ranks, sequence dimension ``dim`` (default 1 of ``[batch, seq, features]``):

* :class:`ColumnParallelLinear` ``(K -> F)``: ``x [B, S/N, K] -> y [B, S, F/N]``;
  ``y = AllGather(x) @ W_r.T + b_r`` with ``W_r`` rows ``r*F/N ... (r+1)*F/N`` of the full
  ``nn.Linear`` weight ``[F, K]``.
* :class:`RowParallelLinear` ``(K -> F)``: ``x [B, S, K/N] -> y [B, S/N, F]``;
  ``y = ReduceScatter(x @ W_r.T) + b`` with ``W_r`` columns ``r*K/N ... (r+1)*K/N`` of
  the full weight and the full bias ``b`` (added once per output row; its gradient is
  summed over ranks, see :func:`~xla_permute.collectives.sum_gradients`).

The MLP blocks built on them (:class:`~xla_permute.tensor_parallel.mlp.SequenceParallelMLP`,
:class:`~xla_permute.tensor_parallel.mlp.GatedMLP`) are in :mod:`xla_permute.tensor_parallel.mlp`.

``strategy`` (every layer): ``"ring"`` (collective matmul, the default), ``"baseline"``
(blocking upstream collective, then matmul), ``"xla"`` or ``"auto"`` (the faster of ring and
baseline by :func:`~xla_permute.cost.choose_strategy` (the cost model) for the detected chip and
shape; ring off TPU/Neuron). ``"xla"`` leaves the overlap to the TPU compiler's own collective
matmul: it issues the baseline's collectives in the form that rewrite needs, as the upstream
proof of concept does (one all-gather or reduce-scatter next to the matmul, a channel id,
``pin_layout=False``, global device ids, the reduce-scatter in the input dtype), and the rewrite
fires only with the environment of :func:`xla_permute.hardware.tpu_collective_matmul_setup` set
before torch_xla's first compile (in the launcher). On a TPU the first ``"xla"`` forward warns
once (:func:`~xla_permute.hardware.tpu.warn_recipe_incomplete`) naming the variables that are
missing; on other devices ``"xla"`` is the baseline with the reduce-scatter in the input dtype.
``groups``: tensor parallelism within each replica group (a ring in the group's order);
``world_size`` is then the group size. Empty inputs give empty outputs without a collective.

``sequence_parallel=False`` (Megatron's layers without sequence parallelism): the activations
around the pair are replicated, whole on every rank. A column-parallel layer then takes
``x [..., S, K]`` as it is (``y = x @ W_r.T + b_r``, no collective forward; backward sums
``dx`` over ranks, :func:`~xla_permute.collectives.sum_gradients`) and a row-parallel one ends
with a sum, ``y = AllReduce(x @ W_r.T) + b``
(:func:`~xla_permute.tensor_parallel.regions.reduce_replicated`).
``gather_output=True`` (column-parallel): the output's features gathered, ``[..., F]`` on every
rank (:func:`~xla_permute.tensor_parallel.regions.gather_replicated`).

Column-parallel layers that read the same input (q/k/v, gate/up) share one ring when
:func:`share_ring` links them: the first one called computes every member's output in one
:func:`~xla_permute.matmul.all_gather_matmul` (x travels once), the others, called next with
the same tensor, take theirs from it; called with another tensor, a member runs its own ring.

Backward: through the collective matmuls' own backward (see :mod:`xla_permute.matmul`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from xla_permute.backends.select import BACKENDS, get_backend
from xla_permute.collectives import sum_gradients
from xla_permute.matmul import (
    all_gather_matmul,
    all_gather_then_matmul,
    matmul_reduce_scatter,
    matmul_then_reduce_scatter,
)
from xla_permute.pairs import GroupsLike, check_int
from xla_permute.tensor_parallel.regions import gather_replicated, reduce_replicated

__all__ = [
    "STRATEGIES",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "share_ring",
]

STRATEGIES = ("ring", "baseline", "xla", "auto")


def _world(
    world_size: object, rank: object, groups: GroupsLike, backend: str = "auto"
) -> tuple[int, int]:
    """The group size and this rank's position in it: given, or asked from the backend (a
    running mesh, or torch.distributed's process group)."""
    from xla_permute.backends.select import distributed_ready

    if world_size is not None:
        world_size = check_int(world_size, "world_size", 1)
    if rank is not None:
        rank = check_int(rank, "rank", 0)
    on_c10d = backend == "c10d" or (backend == "auto" and distributed_ready())
    if (world_size is None or rank is None) and not on_c10d:
        import torch_xla

        if not torch_xla._XLAC._xla_runtime_is_initialized():
            raise RuntimeError(
                "a parallel layer built outside a mesh rank needs world_size= and rank= (the "
                "group size and this rank's position); asking the XLA runtime would start it "
                "here and break a later run_on_mesh. Build the layer inside the rank function, "
                "or pass both"
            )
    if world_size is None or rank is None:
        size, position, _ = get_backend(backend).position(groups)
        world_size = size if world_size is None else world_size
        rank = position if rank is None else rank
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    return world_size, rank


def _strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def _shard(size: int, world_size: int, what: str) -> int:
    if size % world_size:
        raise ValueError(
            f"{what} = {size} is not divisible by the {world_size} ranks; choose a multiple "
            f"of {world_size}"
        )
    return size // world_size


class _ParallelLinear(nn.Module):
    """The shared part of the two layers: ``_sharded`` names the feature axis split over ranks
    (``"out"``: column parallel, ``"in"``: row parallel)."""

    _sharded: str
    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        dim: int = 1,
        strategy: str = "ring",
        bidirectional: bool = False,
        sequence_parallel: bool = True,
        groups: GroupsLike = None,
        backend: str = "auto",
        world_size: int | None = None,
        rank: int | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        in_features = check_int(in_features, "in_features", 1)
        out_features = check_int(out_features, "out_features", 1)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        check_int(dim, "dim")
        self.strategy = _strategy(strategy)
        self.groups = None if groups is None else [list(g) for g in groups]
        self.backend = backend
        world_size, rank = _world(world_size, rank, self.groups, backend)
        if self._sharded == "out":
            out_local = _shard(out_features, world_size, "out_features")
            shape, bias_features = (out_local, in_features), out_local
        else:
            in_local = _shard(in_features, world_size, "in_features")
            shape, bias_features = (out_features, in_local), out_features
        self.in_features, self.out_features = in_features, out_features
        self.dim, self.world_size, self.rank = dim, world_size, rank
        self.bidirectional = bool(bidirectional)
        self.sequence_parallel = bool(sequence_parallel)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(bias_features, dtype=dtype)) if bias else None
        self.reset_parameters(generator)  # on the CPU (a CPU generator), then moved
        if device is not None:
            self.to(device)

    def _method(self, x: torch.Tensor, weights: int = 1) -> str:
        """Check x against this layer (device, mesh) and pick ``"ring"`` or ``"baseline"``
        (``weights``: how many weights of this shape share the ring)."""
        name = type(self).__name__
        if isinstance(x, torch.Tensor) and x.device != self.weight.device:
            if self.weight.device.type == "cpu":  # the module was never moved
                fix = f"move the module to the input's device first: {name}.to(x.device)"
            else:  # the layer is on this rank's device: the input must join it
                fix = f"move the input to the layer's device first: x = x.to({name}.weight.device)"
                if self.weight.device.type == "xla":
                    fix += " (this rank's torch_xla.device())"
            raise ValueError(
                f"{name}.weight is on {self.weight.device} but the input is on {x.device}; {fix}"
            )
        comm = get_backend(self.backend, x if isinstance(x, torch.Tensor) else None)
        size, position, _ = comm.position(self.groups)
        if (size, position) != (self.world_size, self.rank):
            raise ValueError(
                f"{name} was built for rank {self.rank} of {self.world_size} but runs on rank "
                f"{position} of a group of {size}; build it inside the rank function (or pass "
                f"the right world_size=, rank=, groups=)"
            )
        expected = self.weight.shape[1]  # in_features (column) or in_features/N (row)
        if isinstance(x, torch.Tensor) and (x.dim() < 2 or x.shape[-1] != expected):
            what = "in_features" if self._sharded == "out" else "in_features/N"
            raise ValueError(
                f"{name} takes x [..., {what} = {expected}] on every rank, got x of shape "
                f"{tuple(x.shape)}"
            )
        if self.strategy == "xla" and comm.name != "c10d":
            from xla_permute.hardware.tpu import warn_recipe_incomplete

            warn_recipe_incomplete(comm.device_type)
        if self.strategy != "auto":
            return "ring" if self.strategy == "ring" else "baseline"
        op = "all_gather_matmul" if self._sharded == "out" else "matmul_reduce_scatter"
        local = x.shape[self.dim] // (1 if self._sharded == "out" else size)
        rows = x.numel() // max(x.shape[-1], 1) // max(x.shape[self.dim], 1) * local
        from xla_permute.cost.strategy import choose_strategy, detected_chip

        return choose_strategy(
            op,
            m=rows,
            k=self.weight.shape[1],
            n=self.weight.shape[0] * weights,
            n_devices=size,
            dtype_bytes=x.element_size(),
            bidirectional=self.bidirectional,
            chip=None if comm.name == "c10d" else detected_chip(),
        )

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """``nn.Linear``'s initialisation (uniform in +-1/sqrt(in_features) of the full layer).

        Pass a per-rank ``generator``: on the CPU mesh the ranks are threads sharing torch's
        global RNG, so without one their draws interleave unpredictably.
        """
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound, generator=generator)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound, generator=generator)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> Self:
        """This rank's shard of a full ``nn.Linear`` (together, the same result as it), in its
        dtype."""
        kwargs.setdefault("dtype", linear.weight.dtype)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **kwargs)
        axis = 0 if cls._sharded == "out" else 1
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(layer.world_size, axis)[layer.rank])
            if layer.bias is not None:
                bias = (
                    linear.bias.chunk(layer.world_size)[layer.rank] if axis == 0 else (linear.bias)
                )
                layer.bias.copy_(bias)
        return layer

    def extra_repr(self) -> str:
        return (
            f"weight={tuple(self.weight.shape)}, rank={self.rank}/{self.world_size}, "
            f"dim={self.dim}, strategy={self.strategy!r}, bidirectional={self.bidirectional}"
            + ("" if self.sequence_parallel else ", sequence_parallel=False")
            + ("" if self.groups is None else f", groups={self.groups}")
        )


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the output features sharded over ranks.

    Input: this rank's sequence shard ``[..., S/N, in_features]``; output: the whole sequence,
    this rank's ``out_features/N`` columns. See the module docstring for the equation.
    """

    _sharded = "out"
    ring: _SharedRing | None = None

    def __init__(self, *args: Any, gather_output: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gather_output = bool(gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``AllGather(x, dim) @ W_r.T + b_r``: ``[..., S/N, K] -> [..., S, F/N]``
        (``[..., S, K] -> [..., S, F/N]`` without sequence parallelism; ``[..., S, F]`` with
        ``gather_output``)."""
        y = _column([self], x)[0] if self.ring is None else self.ring.output(self, x)
        if self.gather_output:
            comm = dict(groups=self.groups, backend=self.backend)
            y = gather_replicated(y, y.dim() - 1, self.rank, **comm)
        return y


def _column(
    layers: Sequence[ColumnParallelLinear],
    x: torch.Tensor,
    params: Sequence[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Column-parallel layers of one shape and setting on one input: one ring for all.

    ``params``: the ``(weight, bias)`` of each output, ``nn.Linear`` layout (default: the
    layers' own; the first layer's settings apply to all)."""
    first = layers[0]
    if params is None:
        params = [(layer.weight, layer.bias) for layer in layers]
    ws = [w.T for w, _ in params]
    kw = dict(dim=first.dim, groups=first.groups, backend=first.backend)
    if not first.sequence_parallel:  # replicated x: local matmuls; dx summed over ranks
        first._method(x, len(ws))  # the checks of device, rank and shape
        x = sum_gradients(x, groups=first.groups, backend=first.backend)
        ys = tuple(x @ w for w in ws)
    elif first._method(x, len(ws)) == "ring":
        ys = all_gather_matmul(x, ws, bidirectional=first.bidirectional, **kw)
    else:
        ys = all_gather_then_matmul(x, ws, **kw)
    return tuple(y if b is None else y + b for y, (_, b) in zip(ys, params, strict=True))


class _SharedRing:
    """Column-parallel layers that read one input, computed on one ring (:func:`share_ring`).

    The first member called with ``x`` runs the ring for all and keeps the others' outputs
    (and ``x`` itself, so that its identity cannot pass to another tensor) until each is taken;
    a member called with any other tensor, or twice, computes its own.
    """

    def __init__(self, layers: Sequence[ColumnParallelLinear]) -> None:
        self.layers = list(layers)
        self.x: torch.Tensor | None = None
        self.version = -1
        self.pending: dict[int, torch.Tensor] = {}

    def output(self, layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        key = id(layer)
        if x is self.x and x._version == self.version and key in self.pending:
            y = self.pending.pop(key)
            if not self.pending:
                self.x = None
            return y
        if self.pending:  # outputs left untaken: the members read different inputs
            import warnings

            names = [type(m).__name__ for m in self.layers]
            warnings.warn(
                f"share_ring: {len(self.layers)} layers ({names}) sharing a ring were called "
                f"with different inputs; each now runs its own ring",
                stacklevel=3,
            )
            for m in self.layers:
                m.ring = None
            self.x, self.pending = None, {}
            return _column([layer], x)[0]
        ys = _column(self.layers, x)
        self.x, self.version = x, x._version
        self.pending = {id(m): y for m, y in zip(self.layers, ys, strict=True) if m is not layer}
        return ys[self.layers.index(layer)]


def share_ring(layers: Sequence[ColumnParallelLinear]) -> None:
    """Let column-parallel layers that read the same input share one ring (module docstring).

    They must agree on every setting but ``out_features`` (raises ``ValueError`` naming the
    ones that differ). Their results are those of each layer alone.
    """
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, ColumnParallelLinear):
            raise TypeError(
                f"share_ring: layers[{i}] is a {type(layer).__name__}, not a ColumnParallelLinear"
            )
    same = (
        "in_features",
        "dim",
        "strategy",
        "bidirectional",
        "sequence_parallel",
        "groups",
        "backend",
        "world_size",
        "rank",
    )
    first = layers[0]
    differ = [a for a in same for m in layers[1:] if getattr(m, a) != getattr(first, a)]
    if differ:
        raise ValueError(
            f"share_ring: the layers must agree on {sorted(set(differ))} to share a ring"
        )
    ring = _SharedRing(layers) if len(layers) > 1 else None
    for layer in layers:
        layer.ring = ring


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the input features sharded over ranks.

    Input: the whole sequence, this rank's ``in_features/N`` columns ``[..., S, in/N]``;
    output: this rank's sequence shard ``[..., S/N, out_features]`` of the summed product.
    """

    _sharded = "in"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``ReduceScatter(x @ W_r.T, dim) + b``: ``[..., S, K/N] -> [..., S/N, F]``
        (without sequence parallelism ``AllReduce(x @ W_r.T) + b``, ``[..., S, F]``)."""
        w = self.weight.T
        kw = dict(dim=self.dim, groups=self.groups, backend=self.backend)
        if not self.sequence_parallel:
            self._method(x)  # the checks of device, rank and shape
            y = reduce_replicated(x @ w, groups=self.groups, backend=self.backend)
            return y if self.bias is None else y + self.bias
        if self._method(x) == "ring":
            y = matmul_reduce_scatter(x, w, bidirectional=self.bidirectional, **kw)
        else:  # baseline, or "xla": its reduce-scatter in the input dtype, as the PoC's
            reduce_dtype = x.dtype if self.strategy == "xla" else None
            y = matmul_then_reduce_scatter(x, w, reduce_dtype=reduce_dtype, **kw)
        if self.bias is None or y.numel() == 0:
            return y if self.bias is None else y + self.bias
        # The bias is whole on every rank but each rank adds it to its own rows only.
        return y + sum_gradients(self.bias, groups=self.groups, backend=self.backend)
