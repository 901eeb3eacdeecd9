"""/proc utilities the lab's daemons share (Linux only); a process that exits while read is simply not found."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Callable, Collection, Iterable
from contextlib import suppress
from pathlib import Path

from tasks.hosts.retry import retrying

_PROC = Path("/proc")
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _stat_tail(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name ([0] state, [1] ppid): split after the
    *last* ')', as the name may hold spaces and ')'. OSError when the process is gone."""
    return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def ppid(pid: int) -> int | None:
    """The parent of `pid`, or None when it is gone."""
    try:
        return int(_stat_tail(pid)[1])
    except (OSError, ValueError, IndexError):
        return None


def descendants(roots: Iterable[int]) -> list[int]:
    """Every process below `roots`, parents first: by the ppid chain, as a daemon's sessions and
    shims each sit in their own session (a group or session kill would miss them)."""
    kids: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (parent := ppid(int(entry.name))) is not None:
            kids.setdefault(parent, []).append(int(entry.name))
    top = set(roots)
    found = list(top)
    for pid in found:  # grows while walked
        found += [k for k in kids.get(pid, []) if k not in found]
    return found[len(top):]


def cmdline(pid: int) -> bytes:
    """The process's argv, NUL-separated; empty for a kernel thread or a process gone."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def matching(test: Callable[[Path, bytes], bool], skip: Collection[int] = ()) -> set[int]:
    """The pids (not in `skip`, no kernel thread) whose /proc folder and command line pass `test`."""
    pids = {int(e.name) for e in _PROC.iterdir() if e.name.isdigit() and int(e.name) not in skip}
    return {pid for pid in pids if (line := cmdline(pid)) and test(_PROC / str(pid), line)}


def unmount_under(folder: Path) -> list[str]:
    """Lazily unmount everything at or below `folder`; returns the mount points."""
    points = mounts_under(folder)
    for point in points:
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)
    return points


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie (a killed child of someone else stays 'Z' until reaped)."""
    try:
        return _stat_tail(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Send `sig` to each pid; one that is already gone is not an error."""
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_all(pids: Collection[int], term_grace_s: float, kill_grace_s: float) -> None:
    """SIGTERM (daemons clean up their sockets, mounts, children), SIGKILL what lives after
    `term_grace_s`, then wait up to `kill_grace_s`; returns once none is alive."""
    for sig, wait_s in ((signal.SIGTERM, term_grace_s), (signal.SIGKILL, kill_grace_s)):
        signal_all(pids, sig)
        if retrying(within_s=wait_s, wait_s=0.1, until=bool)(lambda: not any(alive(p) for p in pids)):
            return


def mounts_under(folder: Path) -> list[str]:
    """Mount points at or below `folder`, deepest first; mountinfo's 5th field octal-escapes blanks (`\\040`)."""
    prefix = str(Path(folder).resolve())
    points = []
    for line in (_PROC / "self" / "mountinfo").read_text().splitlines():
        point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)
