"""The docs build (-n -W) without executing the tutorials: structure, references, API page.

The tutorials' cells themselves run as test items (conftest.py); ``make docs`` runs them again,
with execution forced, to render their outputs.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_without_warnings(tmp_path):
    cmd = [sys.executable, "-m", "sphinx", "-n", "-W", "--keep-going", "-q", "-b", "html"]
    cmd += ["-D", "nb_execution_mode=off", "-d", str(tmp_path / "doctrees")]
    out = subprocess.run(
        [*cmd, str(ROOT / "docs"), str(tmp_path / "html")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "html" / "api.html").exists()
