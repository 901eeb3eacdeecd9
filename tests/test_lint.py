"""ruff and mypy pass on the code, with the rules pyproject.toml sets ([tool.ruff], [tool.mypy]).

Each check also runs on a planted file with a finding of its kind, so a configuration that
checks nothing (a path that matches no file, a rule set emptied) fails here too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO

CHECKED = ["tasks", "flows", "lab", "benchmarks"]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    r = _run("ruff", "check", "--no-cache", *CHECKED)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_mypy_finds_nothing():
    r = _run("mypy", *CHECKED)
    assert r.returncode == 0 and "Success" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_checks_catch_a_planted_finding(tmp_path: Path):
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n\n\ndef half(n: int) -> str:\n    return n / 2\n")
    ruff = _run("ruff", "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(planted))
    assert ruff.returncode == 1 and "F401" in ruff.stdout, ruff.stdout + ruff.stderr
    mypy = _run("mypy", "--config-file", str(REPO / "pyproject.toml"), str(planted))
    assert mypy.returncode == 1 and "[return-value]" in mypy.stdout, mypy.stdout + mypy.stderr
