"""The attention bench on a small shape: ring vs all-gather bytes and peak memory, N=2."""

from xla_permute_tools.bench.attention import format_attention_report, run_attention_bench


def test_ring_sends_the_same_forward_bytes_and_holds_less():
    shape = (1, 2, 1, 1024, 16)  # B, Hq, Hkv, S, D
    result = run_attention_bench((2,), shape)
    rows = result["n"][2]
    block = 2 * 1 * 1 * (1024 // 2) * 16 * 4  # K and V of one rank, float32
    assert rows["ring|forward"]["bytes_sent"] == rows["all_gather|forward"]["bytes_sent"] == block
    assert rows["ring|forward"]["collectives"] == ["collective-permute"]
    assert rows["all_gather|forward"]["collectives"] == ["all-gather"]
    # training: N-1 + N permutes (dK/dV travel the whole ring) vs all-gather + reduce-scatter
    assert rows["ring|forward+backward"]["bytes_sent"] == 4 * block
    assert rows["all_gather|forward+backward"]["bytes_sent"] == 2 * block
    for mode in ("forward", "forward+backward"):
        ring, ag = rows[f"ring|{mode}"]["peak_bytes"], rows[f"all_gather|{mode}"]["peak_bytes"]
        assert 0 < ring < ag
    assert "N=2" in format_attention_report(result)
