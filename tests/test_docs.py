"""The docs build (-n -W) without executing the tutorials: structure, references, the API
pages, the search index; the cache through which the docs show what the test run executed; the
per-rank table.

The tutorials' cells themselves run as test items (conftest.py), which save each executed
tutorial for ``make docs`` to render (tests/notebook_cells.py); it executes only pages that
are not in that cache.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site built with ``-n -W`` (every reference resolves, no warning), tutorials not
    executed."""
    tmp_path = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "sphinx", "-n", "-W", "--keep-going", "-q", "-b", "html"]
    cmd += ["-D", "nb_execution_mode=off", "-d", str(tmp_path / "doctrees")]
    # page 13's caveat anchors are written by its cells, which this build does not run; the
    # executed build (make docs-check, -n -W) resolves every label
    cmd += ["-D", "suppress_warnings=ref.ref"]
    cmd += [str(ROOT / "docs"), str(tmp_path / "html")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return tmp_path / "html"


def test_docs_build_without_warnings(built_site):
    assert (built_site / "api.html").exists()


def test_api_pages_document_each_object_once_under_the_name_users_type(built_site):
    """Every page of docs/api/ is built and in the reference's toctree; ``xp``'s names are
    entries ``xla_permute.<name>``, each on one page only."""
    import re

    import xla_permute

    pages = sorted(p.stem for p in (ROOT / "docs" / "api").glob("*.md"))
    toctree = (ROOT / "docs" / "api.md").read_text().split("```{toctree}")[1].split("```")[0]
    assert sorted(re.findall(r"^api/(\w+)$", toctree, re.M)) == pages
    where: dict[str, list[str]] = {}
    for page in pages:
        html = (built_site / "api" / f"{page}.html").read_text()
        for entry in re.findall(r'<dt class="sig sig-object py" id="([^"]+)"', html):
            where.setdefault(entry, []).append(page)
    assert {k: v for k, v in where.items() if len(v) > 1} == {}
    missing = [n for n in xla_permute.__all__ if f"xla_permute.{n}" not in where]
    # Constants are documented where their ``#:`` comment is (autodoc reads it only there).
    assert missing == ["SCHEDULES"], missing


def test_search_index_leaves_out_the_tests_page(built_site):
    """docs/tests.md (its test sources make it the largest page) is out of the search index:
    the words of the sources find the API pages and the tutorials, not it."""
    import json

    text = (built_site / "searchindex.js").read_text()
    index = json.loads(text[text.index("(") + 1 : text.rindex(")")])
    tests = index["docnames"].index("tests")
    found = index["terms"]["all_gather_matmul"]
    found = found if isinstance(found, list) else [found]
    assert tests not in found
    assert {index["docnames"][i] for i in found} & {"api/matmul", "tutorials/03_collective_matmul"}


PAGE = """---
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

# A page

```{code-cell} ipython3
x = 6 * 7
```

Text between the cells.

```{code-cell} ipython3
print("x is", x)
```
"""


def test_the_docs_build_reads_what_the_test_run_executed(tmp_path):
    """The collector's cache (tests/notebook_cells.py) is keyed as the docs build reads pages:
    the executed outputs come back for the same cells, and a changed cell misses."""
    import pytest
    from jupyter_cache import get_cache
    from notebook_cells import CellRunner, cache_executed, code_cells, read_notebook

    page, cache_path = tmp_path / "page.md", tmp_path / "cache"
    page.write_text(PAGE)
    runner = CellRunner(page)
    try:
        first = code_cells(page)[0]
        runner.run(first.index)
        with pytest.raises(ValueError, match="not every cell ran"):
            cache_executed(runner, cache_path)
        for cell in code_cells(page)[1:]:
            runner.run(cell.index)
    finally:
        runner.close()
    cache_executed(runner, cache_path)

    cache = get_cache(str(cache_path))
    _, merged = cache.merge_match_into_notebook(read_notebook(page))
    outputs = [cell.outputs for cell in merged.cells if cell.cell_type == "code"]
    assert outputs[0] == [] and outputs[1][0]["text"] == "x is 42\n"
    assert cache.list_cache_records()[0].data["execution_seconds"] > 0

    page.write_text(PAGE.replace("6 * 7", "6 * 8"))
    with pytest.raises(KeyError):
        cache.match_cache_notebook(read_notebook(page))


def test_rank_table_shows_each_rank_as_a_row():
    import pytest
    import torch

    from xla_permute_tools.figures import rank_table

    table = rank_table([{"x": torch.arange(3.0), "<b>": "a"}, {"x": torch.zeros(4, 4), "<b>": 1}])
    html = table._repr_html_()
    assert html.count("<tr>") == 3 and "&lt;b&gt;" in html and "<b>" not in html
    assert [line.split("  ")[0] for line in str(table).splitlines()] == ["rank", "0", "1"]
    assert "[0, 1, 2]" in str(table).splitlines()[1]  # a small tensor: its values
    assert "[4, 4] float32" in str(table).splitlines()[2]  # a larger one: shape and dtype
    with pytest.raises(ValueError, match="rank 1 has 1 cells for 2 columns"):
        rank_table([[1, 2], [3]], ["a", "b"])
