"""The `lab` session fixture: GB300 and a Spark pair as network namespaces on this machine.

Use it from a test module with `pytest_plugins = ["lab_fixture"]` (or once in conftest.py),
never by importing the fixture: an imported session fixture is a separate lab per module.
The lab comes up once per session (a leftover of a crashed run is torn down first) and is
torn down at the end; the teardown fails the session if anything of the lab is left behind.
Needs root and the tools `./setup` installs (CI has both): no skip.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.lab import HOLDER_ENV, LAB_DIR, Lab, lab_lock


def residue(lab_dir: Path = LAB_DIR) -> list[str]:
    """What of a lab is still on this machine, read independently of the lab's own records."""
    import json
    import subprocess

    from lab.lab import BRIDGE, HOSTS, _root_end

    left = []
    done = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, check=True)
    names = [e["name"] for e in json.loads(done.stdout or "[]")]
    left += [f"namespace {n}" for n in HOSTS if n in names]
    links = [e["ifname"] for e in json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True,
                                                            text=True, check=True).stdout)]
    left += [f"link {i}" for i in [BRIDGE, *(_root_end(h) for h in HOSTS)] if i in links]
    needle = str(lab_dir).encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                line = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in line:
                argv = line.replace(b"\0", b" ").decode(errors="replace")
                left.append(f"process {proc.name}: {argv[:120]}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if line.split()[4].startswith(str(lab_dir)):
            left.append(f"mount {line.split()[4]}")
    return left


@pytest.fixture(scope="session")
def lab() -> Iterator[Lab]:
    handle = Lab(say=lambda line: print(line, file=sys.stderr))
    # another session (or `lanebench lab`) using the lab: wait for it rather than pull it away
    with lab_lock(wait_s=1800):
        os.environ[HOLDER_ENV] = str(os.getpid())  # `lanebench lab ...` run by the tests may act
        try:
            handle.up()
            yield handle
            handle.down()
        finally:
            os.environ.pop(HOLDER_ENV, None)
    left = residue(handle.dir)
    assert not left, f"lab down left: {left}"
