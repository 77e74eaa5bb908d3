"""Reading HLO text: instructions, collectives, attributes, bytes, dependencies."""

import pytest

from xla_permute import all_gather_schedule, hlo, reduce_scatter_schedule
from xla_permute_tools import accounting

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
        "all-gather",
        "collective-permute",
        "all-reduce",
        "reduce-scatter",
    ]
    ag, cp, ar, rs = cs
    assert (ag.channel_id, ag.replica_groups, ag.operand_bytes, ag.result_bytes) == (
        7,
        ((0, 1),),
        128,
        256,
    )
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


# ---------------------------------------------------------------- ring accounting


def permute(name: str, source: str, shift: int, n: int = 4, order=None) -> str:
    ring = list(range(n)) if order is None else list(order)
    pairs = ",".join(f"{{{ring[i]},{ring[(i + shift) % n]}}}" for i in range(n))
    return (
        f"  %{name} = f32[2,4]{{1,0}} collective-permute(f32[2,4]{{1,0}} %{source}), "
        f"source_target_pairs={{{pairs}}}"
    )


def module(*lines: str) -> str:
    head = ["ENTRY %e (p: f32[2,4]) -> f32[2,4] {", "  %p = f32[2,4]{1,0} parameter(0)"]
    return "\n".join([*head, *lines, "}"])


UNI = all_gather_schedule(4, 0)
BI = all_gather_schedule(4, 0, bidirectional=True)


def test_byte_accounting_follows_the_schedule():
    ring = [permute("a", "p", 1), permute("b", "a", 1), permute("c", "b", 1)]
    account = accounting.account_bytes(module(*ring), 4, UNI)
    assert account.per_step == (32, 32, 32, 0) and account.total == 96
    assert account.per_collective == (("collective-permute", 32),) * 3
    assert account.gathered_bytes is None
    # matmul-reduce-scatter's ring has the same shape of schedule
    assert accounting.account_bytes(module(*ring), 4, reduce_scatter_schedule(4, 0)) == account
    with pytest.raises(ValueError, match="uni: permutes per direction .* do not match"):
        accounting.account_bytes(module(*ring[:2]), 4, UNI, name="uni")
    with pytest.raises(ValueError, match="do not match the schedule"):  # all three go one way
        accounting.chain_report(module(*ring), 4, BI)
    with pytest.raises(ValueError, match="expected only collective-permutes"):
        accounting.account_bytes(TEXT, 2, UNI)


def test_byte_accounting_of_blocking_collectives():
    gather = "  %ag = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %p), channel_id=1, dimensions={0}"
    account = accounting.account_bytes(module(gather), 4)
    assert (account.per_step, account.total, account.gathered_bytes) == ((32, 32, 32), 96, 128)
    parsed = hlo.parse(module(gather))  # a parsed program works as well as its text
    assert accounting.account_bytes(parsed, 4) == account
    with pytest.raises(ValueError, match="expected blocking collectives and no permute"):
        accounting.account_bytes(module(permute("a", "p", 1)), 4)
    with pytest.raises(ValueError, match="expected blocking collectives"):
        accounting.account_bytes(module(), 4)


def test_chain_report_reads_directions_and_dependencies_not_text_order():
    # Step 0 sends both ways, step 1 one way; the text lists the -1 permute first.
    free = module(permute("down", "p", -1), permute("up0", "p", 1), permute("up1", "up0", 1))
    assert accounting.permute_steps(free, 4, BI) == [["up0", "down"], ["up1"], []]
    assert accounting.chain_report(free, 4, BI) == {
        "permutes": 3,
        "chained": 0,
        "same_step": 1,
        "same_step_chained": 0,
    }
    # A token-like dependency of the -1 permute on the +1 one serialises the step.
    tied = module(
        permute("up0", "p", 1),
        "  %tok = f32[2,4]{1,0} add(f32[2,4]{1,0} %p, f32[2,4]{1,0} %up0)",
        permute("down", "tok", -1),
        permute("up1", "up0", 1),
    )
    assert accounting.account_bytes(tied, 4, BI).per_step == (64, 32, 0)
    assert accounting.chain_report(tied, 4, BI)["same_step_chained"] == 1
    uni = module(permute("a", "p", 1), permute("b", "a", 1), permute("c", "b", 1))
    assert accounting.chain_report(uni, 4, UNI)["chained"] == 2
    assert accounting.chain_report(uni, 4, None) == dict.fromkeys(
        ("permutes", "chained", "same_step", "same_step_chained"), 0
    )


def test_ring_order_sets_the_directions():
    order = (0, 2, 3, 1)
    ring = module(*(permute(a, b, 1, order=order) for a, b in (("a", "p"), ("b", "a"), ("c", "b"))))
    with pytest.raises(ValueError, match="is not a ring shift"):
        accounting.permute_steps(ring, 4, UNI)
    assert accounting.permute_steps(ring, 4, UNI, order=order) == [["a"], ["b"], ["c"], []]
    with pytest.raises(ValueError, match="order must be a permutation"):
        accounting.permute_steps(ring, 4, UNI, order=(0, 1, 2, 2))
