"""What a run folder's manifest says about where it ran: the lanebench commit and this machine.

A copy without .git (the GPU bundle, scripts/gpu-run.sh) carries the commit it was made from in
`.lanebench-git.json`."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
from pathlib import Path

from tasks.inventory.paths import REPO
from tasks.record.manifest import GitIdentity, HostFacts


def git_identity() -> GitIdentity:
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    sha = git("rev-parse", "HEAD")
    if not sha and (carried := REPO / ".lanebench-git.json").is_file():
        # A copy without .git (the GPU bundle, scripts/gpu-run.sh): the commit it was made from.
        known = json.loads(carried.read_text())
        return GitIdentity(git_sha=str(known.get("git_sha") or "unknown"), dirty=bool(known.get("dirty")),
                           git_from=".lanebench-git.json")
    return GitIdentity(git_sha=sha or "unknown", dirty=bool(git("status", "--porcelain")))


def host_facts() -> HostFacts:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return HostFacts(hostname=socket.gethostname(), platform=platform.platform(), machine=platform.machine(),
                     cpu=cpu, cores=os.cpu_count(), memory_gib=round(mem, 1), python=platform.python_version())
