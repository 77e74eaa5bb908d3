from xla_permute.demo import CHECKS, Row, format_table, run_checks


def test_checks_have_unique_names():
    names = [c.name for c in CHECKS]
    assert len(names) == len(set(names))


def test_table_has_a_row_per_check():
    rows = [Row("a", "emulated", True, "ok", 0.5), Row("bb", "native", False, "rank 1: x", 1.0)]
    table = format_table(rows).splitlines()
    assert table[0].split() == ["check", "backend", "result", "time"]
    assert "500 ms" in table[2] and "rank 1: x" in table[3]


def test_every_check_passes_on_a_two_device_mesh():
    rows = run_checks(n=2)
    assert [r.check for r in rows] == [c.name for c in CHECKS]
    assert all(r.ok for r in rows), [(r.check, r.detail) for r in rows if not r.ok]
