"""strategy="auto" on the cost model: never predicted slower than the better of ring and
baseline (within 2%) over a token sweep 32..16384 on every modelled chip (pure, no mesh)."""

import pytest

from xla_permute import cost
from xla_permute.layers import STRATEGIES, choose_strategy

TOKENS = [32 * 2**i for i in range(10)]  # 32 .. 16384


@pytest.mark.parametrize("chip", sorted(cost.CHIPS))
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("n", [4, 8])
def test_auto_is_never_worse(chip, op, n):
    ratios = []
    for tokens in TOKENS:
        m, k, f = tokens // n, 8192, 28672 // n  # the PoC's hidden and intermediate sizes
        work = cost.Workload(m=m, k=k, n=f, n_devices=n, op=op)
        ring = cost.predict(cost.CHIPS[chip], work, "uni").total
        base = cost.predict(cost.CHIPS[chip], work, "baseline").total
        pick = choose_strategy(op, m=m, k=k, n=f, n_devices=n, chip=chip)
        ratios.append((ring if pick == "ring" else base) / min(ring, base))
    assert max(ratios) <= 1.02, ratios
    assert {"ring", "baseline", "xla", "auto"} == set(STRATEGIES)


def test_unmodelled_chip_or_empty_shape_keeps_the_ring():
    assert choose_strategy("all_gather_matmul", m=8, k=8, n=8, n_devices=4) == "ring"
    assert choose_strategy("all_gather_matmul", m=0, k=8, n=8, n_devices=4, chip="tpu-v5p") == (
        "ring"
    )
