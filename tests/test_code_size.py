"""Issue 26's size bar: the features 637441f had take fewer non-test Python lines today than then.

scripts/code-size.sh blames today's lines on their commits and sets aside those of the feature
commits listed in scripts/feature-commits.tsv; a new feature lists its commit there, a refactor
does not (it has to pay for itself).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> str:
    return subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def test_the_features_637441f_had_take_fewer_lines_than_then() -> None:
    if subprocess.run(["git", "cat-file", "-e", "637441f^{commit}"], cwd=ROOT).returncode != 0:
        pytest.skip("a shallow clone: 637441f is not in this checkout's history")
    out = _run("bash", "scripts/code-size.sh")
    base, today, features, same = (int(n) for n in re.findall(r": (\d+)$", out, re.M))
    files = [f for f in _run("git", "ls-tree", "-r", "--name-only", "HEAD").split()
             if f.endswith(".py") and not f.startswith("tests/")]
    assert today == sum(_run("git", "show", f"HEAD:{f}").count("\n") for f in files), out
    assert today - features == same, out
    listed = [line.split("\t")[0] for line in (ROOT / "scripts/feature-commits.tsv").read_text().splitlines()
              if not line.startswith("#")]
    assert features > 0 and len(listed) == len(set(listed)), out
    assert same < base, f"the features of 637441f now take {same} lines, more than its {base}:\n{out}"
