"""Small /proc utilities the lab's daemons share: parents and descendants, liveness, killing a set
of pids, and the mounts under a folder. Linux only; every reader tolerates a process that exits
while it is being read (it simply is not found).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Collection, Iterable
from pathlib import Path

_PROC = Path("/proc")
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _stat_tail(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: [0] is the state, [1] the ppid.

    The name is in parentheses and may itself hold spaces and ')' (a process can call itself
    anything), so the fields are split after the *last* ')', never by position from the start.
    Raises OSError when the process is gone."""
    return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def ppid(pid: int) -> int | None:
    """The parent of `pid`, or None when it is gone."""
    try:
        return int(_stat_tail(pid)[1])
    except (OSError, ValueError, IndexError):
        return None


def parent_map() -> dict[int, list[int]]:
    """Every process's children, keyed by parent pid, from one pass over /proc (the kernel keeps
    no child list we can read for all processes at once)."""
    kids: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (parent := ppid(int(entry.name))) is not None:
            kids.setdefault(parent, []).append(int(entry.name))
    return kids


def children(pid: int) -> list[int]:
    """The direct children of `pid`."""
    return parent_map().get(pid, [])


def descendants(roots: Iterable[int]) -> list[int]:
    """Every process below `roots` (not the roots themselves), parents before their children.

    From one snapshot of the parent map: a daemon's sessions and shims are each in their own
    session, so a process group or session kill would miss them; only the ppid chain finds them."""
    kids = parent_map()
    seen = set(roots)
    found: list[int] = []
    todo = list(seen)
    while todo:
        for kid in kids.get(todo.pop(), []):
            if kid not in seen:
                seen.add(kid)
                found.append(kid)
                todo.append(kid)
    return found


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie: a killed child of someone else stays in /proc as 'Z'
    until it is reaped, but it is dead for every purpose of ours."""
    try:
        return _stat_tail(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Send `sig` to each pid; one that is already gone is not an error."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_all(pids: Collection[int], term_grace_s: float, kill_grace_s: float) -> None:
    """SIGTERM first (daemons clean up after themselves: sockets, mounts, their own children),
    then SIGKILL whatever still lives after `term_grace_s`; waits up to `kill_grace_s` for that.
    Returns as soon as none is alive."""
    for sig, wait_s in ((signal.SIGTERM, term_grace_s), (signal.SIGKILL, kill_grace_s)):
        signal_all(pids, sig)
        end = time.monotonic() + wait_s
        while time.monotonic() < end and any(alive(p) for p in pids):
            time.sleep(0.1)
        if not any(alive(p) for p in pids):
            return


def mounts_under(folder: Path) -> list[str]:
    """Mount points at or below `folder` (resolved), deepest first so they can be unmounted in order.

    Read from /proc/self/mountinfo, where the mount point (5th field) has space, tab, newline and
    backslash written as octal escapes (`\\040`...) so the fields stay space-separated."""
    prefix = str(Path(folder).resolve())
    points = []
    for line in (_PROC / "self" / "mountinfo").read_text().splitlines():
        point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)
