"""Reading HLO text: instructions, collectives, attributes, bytes, dependencies."""

import pytest

from xla_permute import hlo

TEXT = """
HloModule IrToHlo.9, entry_computation_layout={(f32[4,8]{1,0})->(bf16[8,8]{1,0})}

%AddComputation.3 (x.4: f32[], y.5: f32[]) -> f32[] {
  %x.4 = f32[] parameter(0)
  %y.5 = f32[] parameter(1)
  ROOT %add.6 = f32[] add(f32[] %x.4, f32[] %y.5)
}

ENTRY %IrToHlo.9 (p0.1: f32[4,8]) -> (f32[8,8], f32[2,8]) {
  %p0.1 = f32[4,8]{1,0} parameter(0)
  %all-gather.2 = f32[8,8]{1,0} all-gather(f32[4,8]{1,0} %p0.1), channel_id=7, replica_groups={{0,1}}, dimensions={0}, use_global_device_ids=true
  %collective-permute.3 = f32[4,8]{1,0} collective-permute(f32[4,8]{1,0} %p0.1), source_target_pairs={{0,1},{1,0}}
  %dot.4 = f32[4,4]{1,0} dot(f32[4,8]{1,0} %p0.1, f32[4,8]{1,0} %p0.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %all-reduce.5 = (f32[4,8]{1,0}, f32[]) all-reduce(f32[4,8]{1,0} %collective-permute.3, f32[] %x), replica_groups={}, constrain_layout=true, to_apply=%AddComputation.3
  %reduce-scatter.6 = f32[2,8]{1,0} reduce-scatter(f32[4,8]{1,0} %p0.1), channel_id=8, replica_groups={{0,1}}, dimensions={0}, to_apply=%AddComputation.3
  ROOT %tuple.7 = (f32[8,8]{1,0}, f32[2,8]{1,0}) tuple(f32[8,8]{1,0} %all-gather.2, f32[2,8]{1,0} %reduce-scatter.6)
}
"""  # noqa: E501


@pytest.fixture(scope="module")
def program():
    return hlo.parse(TEXT)


def test_collectives_in_text_order(program):
    cs = program.collectives()
    assert [c.kind for c in cs] == [
        "all-gather", "collective-permute", "all-reduce", "reduce-scatter"
    ]  # fmt: skip
    ag, cp, ar, rs = cs
    assert (ag.channel_id, ag.replica_groups, ag.operand_bytes, ag.result_bytes) == (
        7, ((0, 1),), 128, 256
    )  # fmt: skip
    assert cp.pairs == ((0, 1), (1, 0)) and cp.channel_id is None
    assert ar.constrain_layout and ar.channel_id is None and ar.replica_groups == ()
    assert (rs.channel_id, rs.result_bytes) == (8, 64) and not rs.constrain_layout


def test_bytes_sent_per_rank_assumes_rings(program):
    ag, cp, ar, rs = program.collectives()
    assert hlo.bytes_sent_per_rank(ag, 2) == 128  # one shard to the neighbour
    assert hlo.bytes_sent_per_rank(rs, 2) == 64
    assert hlo.bytes_sent_per_rank(cp, 2) == 128
    assert hlo.bytes_sent_per_rank(cp, 4, rank=3) == 0  # rank 3 is no source
    assert hlo.bytes_sent_per_rank(ar, 2) == ar.operand_bytes


def test_dependencies(program):
    assert program.depends_on("all-reduce.5", "collective-permute.3")
    assert program.depends_on("tuple.7", "p0.1")
    assert not program.depends_on("dot.4", "collective-permute.3")
    assert program.independent_of("collective-permute.3") == ["dot.4"]
    assert program.independent_of("all-gather.2") == ["dot.4"]


def test_subcomputations_are_parsed_too(program):
    assert [i.name for i in program.ops("add")] == ["add.6"]
    assert program.instructions["dot.4"].attribute("lhs_contracting_dims") == "{1}"


def test_shape_bytes():
    assert hlo.shape_bytes("pred[3]") == 3 and hlo.shape_bytes("s64[2,2]") == 32
    assert hlo.shape_bytes("(bf16[2], (f32[1], u8[4]))") == 12


def test_not_a_collective():
    c = hlo.Collective("x", "dot", None, None, (), 0, 0, False)
    with pytest.raises(ValueError, match="not a collective kind"):
        hlo.bytes_sent_per_rank(c, 2)
