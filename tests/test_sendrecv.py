"""Reading torch_xla's send/recv code path and counting a step's programs from their HLO.

The counts on the mesh (one pipeline step traced both ways) are in test_pipeline.py, which
traces them in its one launch.
"""

from xla_permute.sendrecv import sendrecv_code_path, step_cost


def test_sendrecv_code_path_of_the_installed_backend():
    path = sendrecv_code_path()
    for method in ("send", "recv"):
        calls = path[method].per_tensor
        assert calls["xm.collective_permute"] == 1 and calls["torch_xla.sync"] == 1, calls
    assert "pairs=[[xr.global_ordinal(), dst_rank]]" in path["send"].source
    assert "pairs=[[src_rank, xr.global_ordinal()]]" in path["recv"].source


def test_step_cost_reads_hlo():
    text = """
ENTRY %m (p0: f32[2,4]) -> f32[2,4] {
  %p0 = f32[2,4]{1,0} parameter(0)
  ROOT %cp = f32[2,4]{1,0} collective-permute(f32[2,4]{1,0} %p0), source_target_pairs={{0,1},{1,2}}
}"""
    cost = step_cost([text, text], rank=1, group_size=4)
    assert (cost.programs, cost.collectives, cost.bytes_sent) == (2, 2, 64)
    assert step_cost([text], rank=2, group_size=4).bytes_sent == 0
