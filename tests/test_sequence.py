"""Host helpers of context parallelism: shard_sequence / unshard_sequence (pure torch)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xla_permute.sequence import layout_chunks, shard_sequence, unshard_sequence


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5),
    chunk=st.integers(0, 3),
    dim=st.integers(0, 2),
    layout=st.sampled_from(["contiguous", "zigzag"]),
)
def test_round_trip_and_positions(n, chunk, dim, layout):
    chunks = n if layout == "contiguous" else 2 * n
    shape = [2, 3, 2]
    shape[dim] = chunks * chunk
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    shards = shard_sequence(x, dim=dim, n=n, layout=layout)
    assert shards.shape[0] == n and shards.shape[1 + dim] == shape[dim] // n
    assert torch.equal(unshard_sequence(shards, dim=dim, layout=layout), x)
    assert torch.equal(unshard_sequence(list(shards), dim=dim, layout=layout), x)
    pos = torch.arange(shape[dim])  # every rank holds exactly the positions of its chunks
    for r in range(n):
        held = shard_sequence(pos, dim=0, n=n, layout=layout)[r]
        want = [p for c in layout_chunks(n, r, layout) for p in range(c * chunk, (c + 1) * chunk)]
        assert held.tolist() == want


def test_zigzag_is_head_tail():
    assert shard_sequence(torch.arange(8), dim=0, n=2, layout="zigzag").tolist() == [
        [0, 1, 6, 7],
        [2, 3, 4, 5],
    ]
    assert layout_chunks(4, 0, "zigzag") == (0, 7) and layout_chunks(4, 3, "zigzag") == (3, 4)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: shard_sequence(torch.ones(6), dim=0, n=4), ValueError, "not divisible by 4"),
        (
            lambda: shard_sequence(torch.ones(6), dim=0, n=2, layout="zigzag"),
            ValueError,
            r"not divisible by 4 \(2n chunks",
        ),
        (lambda: shard_sequence(torch.ones(4), dim=0, n=2, layout="ring"), ValueError, "layout"),
        (lambda: shard_sequence(torch.ones(4), dim=1, n=2), ValueError, "dim=1"),
        (
            lambda: shard_sequence(torch.ones(4), dim=0, n=0),
            ValueError,
            r"n \(the number of ranks\) must be an int >= 1",
        ),
        (lambda: shard_sequence([1, 2], dim=0, n=1), TypeError, "torch.Tensor"),
        (
            lambda: unshard_sequence(torch.ones(2, 3), dim=0, layout="zigzag"),
            ValueError,
            "odd length 3",
        ),
        (
            lambda: unshard_sequence([torch.ones(2), torch.ones(3)], dim=0),
            ValueError,
            "different shapes",
        ),
        (lambda: unshard_sequence([], dim=0), TypeError, "non-empty list"),
    ],
)
def test_bad_input_raises_clearly(call, error, match):
    with pytest.raises(error, match=match):
        call()
