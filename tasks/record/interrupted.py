"""Runs that did not finish: marked interrupted, by themselves on a signal or by the next run.

A run folder names its owner (host, boot id, pid and its start time): a later run on the same
host whose owner is gone marks it `interrupted`, lists the raw records and logs it left, removes a
half-written `manifest.json.tmp` and the reserve. Only passed lanes become baselines.
"""

from __future__ import annotations

import hashlib
import re
import signal
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from tasks.record.manifest import LaneRecord, Outside, Reclaim, inside, scan_manifests
from tasks.record.run_folder import LIVE_GLOBS, RESERVE, SEALS, RunFolder


_STOPS: list[str] = []  # signals received by this process, in order


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, raised where the run is, so it tears down and is marked interrupted."""

    def __init__(self, sig: int) -> None:
        super().__init__(signal.Signals(sig).name)
        self.signal = sig


def stop_requested() -> str | None:
    """The first stop signal received ('SIGINT', 'SIGTERM'), else None: a flag, as Prefect's engine
    may turn the KeyboardInterrupt it catches while starting a task into another error."""
    return _STOPS[0] if _STOPS else None


def _on_stop(signum: int, frame: object) -> None:
    _STOPS.append(signal.Signals(signum).name)
    raise Stopped(signum)


def install_stop_handlers() -> None:
    """Ctrl-C and SIGTERM both stop the run (main thread only). Prefect swaps in its own SIGTERM
    handler while a flow runs (raising TerminationSignal); it is bridged so the stop is recorded too."""
    signal.signal(signal.SIGINT, _on_stop)
    signal.signal(signal.SIGTERM, _on_stop)
    import prefect.utilities.engine as engine
    from prefect.exceptions import TerminationSignal

    if getattr(engine._prefect_sigterm_handler, "_lanebench", False):
        return

    class Terminated(TerminationSignal, KeyboardInterrupt):
        """Prefect's SIGTERM exception as a KeyboardInterrupt, which asyncio re-raises: raised inside an
        event-loop callback, a plain TerminationSignal was logged and dropped, and the lane measured
        on (test_matrix's SIGTERM case, 2026-12-01)."""

    def bridged(sig_num: int, *args: object):
        _STOPS.append(signal.Signals(sig_num).name)
        raise Terminated(signal=sig_num)

    bridged._lanebench = True  # type: ignore[attr-defined]
    engine._prefect_sigterm_handler = bridged


def interrupts() -> tuple[type[BaseException], ...]:
    """What stops a run from outside: Ctrl-C, and SIGTERM as Prefect's engine raises it."""
    from prefect.exceptions import TerminationSignal

    return (KeyboardInterrupt, TerminationSignal)


def signal_name(e: BaseException | None = None) -> str:
    if stopped := stop_requested():
        return stopped
    sig = getattr(e, "signal", None)
    if isinstance(sig, int):
        return signal.Signals(sig).name
    return "SIGINT" if isinstance(e, KeyboardInterrupt) else type(e).__name__


def mark_lanes(lanes: dict[str, LaneRecord], why: str) -> list[str]:
    """Every lane still running becomes interrupted, its stage named; returns their names."""
    names = []
    for name, lane in lanes.items():
        if lane.status == "running":
            stage = lane.stopped_in()
            lane.status, lane.reason = "interrupted", f"{stage}: {why}" if stage else why
            names.append(name)
    return names


def record_stop(run: RunFolder, flow: str, e: BaseException | None, names: Iterable[str] = ()) -> str:
    """A run stopped by a signal records itself: the folder, every running lane at its stage and each
    of `names` never started `interrupted`; the caller still finishes it. Returns the closing line."""
    why = signal_name(e)
    with run.edit() as m:
        m.flow.status, m.flow.interrupted_by = "interrupted", why
        mark_lanes(m.lanes, f"interrupted by {why}")
        for name in names:  # lanes never started are recorded as such, not left out
            if name not in m.lanes:
                run.lane(name).status, run.lane(name).reason = "interrupted", "not started: the run was interrupted"
    return f"{flow} interrupted by {why}"


def raise_if_stopped() -> None:
    """Between lanes, arms or candidates: a stop the lane's error handling swallowed ends the run."""
    if stopped := stop_requested():
        raise KeyboardInterrupt(stopped)


def _last_seal(folder: Path, rel: str) -> tuple[int, str] | None:
    """The last whole `bytes digest` line of a raw file's seal (a torn last line is ignored)."""
    try:
        seals = re.findall(r"^(\d+) (\S{64})\n", (folder / SEALS / f"{rel}.seal").read_text(), re.MULTILINE)
    except OSError:
        return None
    return (int(seals[-1][0]), seals[-1][1]) if seals else None


def _seal_problem(path: Path, size: int, digest: str) -> str | None:
    """How a raw file differs from what lanebench appended to it (None: byte for byte the same)."""
    actual = path.stat().st_size
    if actual < size:
        return f"cut to {actual} of the {size} bytes lanebench wrote"
    if hashlib.sha256(path.read_bytes()[:size]).hexdigest() != digest:
        return "its records differ from what lanebench wrote"
    if actual > size:
        return f"{actual - size} bytes were added after the last record lanebench wrote"
    return None


def _relist(run: RunFolder) -> list[str]:
    """List and hash what a dead run left: logs as found, raw records as their seals say lanebench
    wrote them (one that differs keeps the sealed digest and is named: the lines returned)."""
    folder, m = run.path, run.manifest
    listed: dict[str, str | None] = {a.path: a.sha256 for a in m.artifacts}
    changed = dict(item.split(": ", 1) for item in (m.flow.reclaim.changed_after_crash if m.flow.reclaim else []))
    for pattern in LIVE_GLOBS:  # what it wrote after its last save
        for path in sorted(folder.glob(pattern)):
            rel = str(path.relative_to(folder))
            try:
                inside(folder, path)
            except Outside:
                changed[rel] = "a symlink (or under one), not a file lanebench wrote: not followed"
                run.pin(rel, None)
                continue
            seal = _last_seal(folder, rel) if rel.endswith(".jsonl") else None
            if rel.endswith(".jsonl") and seal is None:
                if rel not in listed:  # nothing says lanebench wrote it: left unlisted, verify names it
                    changed[rel] = "no seal: not written by lanebench"
                run.pin(rel, listed.get(rel))  # listed without a seal: its listed digest stands
            elif seal is not None:
                run.pin(rel, seal[1])
                if problem := _seal_problem(path, *seal):
                    changed[rel] = problem
    m.artifacts = [a for a in m.artifacts if (folder / a.path).is_file()]
    return [f"{rel}: {why}" for rel, why in sorted(changed.items())]


def refresh_marked(root: Path, by: str) -> None:
    """Re-hash the folders `by` marked: the dead run's server wrote on until the reclaiming lane stopped it."""
    for folder, m in scan_manifests(root):
        if m.flow.interrupted_by == by and m.flow.reclaim:
            run, marked_at = RunFolder.reopen(folder), m.flow.reclaim.marked_at
            with run.edit() as m:
                m.flow.reclaim = Reclaim(marked_at=marked_at, changed_after_crash=_relist(run))


def reclaim_dead_runs(root: Path, by: str) -> list[str]:
    """Mark every unfinished run folder under `root` whose owner died; one line per folder."""
    lines = []
    for manifest_path in sorted(Path(root).glob("*/manifest.json")):
        try:
            inside(Path(root), manifest_path)
        except Outside as e:  # not even read: what it points at is not the artifacts folder's
            lines.append(f"run {manifest_path.parent.name}: not reclaimed: {e}")
    for folder, m in scan_manifests(root):
        if m.flow.finished_at or m.flow.status != "running" or m.flow.owner.alive() is not False:
            continue
        pid = m.flow.owner.pid
        run = RunFolder.reopen(folder)
        with run.edit() as m:
            lanes = mark_lanes(m.lanes, f"interrupted: lanebench (pid {pid}) died before the run finished; marked by {by}")
            changed = _relist(run)
            m.flow.status, m.flow.interrupted_by = "interrupted", by
            m.flow.reclaim = Reclaim(marked_at=datetime.now(UTC).isoformat(), changed_after_crash=changed)
            (folder / RESERVE).unlink(missing_ok=True)
        lines.append(f"run {folder.name}: marked interrupted (lanebench pid {pid} died"
                     + (f"; lanes {', '.join(lanes)} did not finish" if lanes else "") + ")"
                     + (f"; changed after the crash, not re-hashed: {', '.join(c.split(': ')[0] for c in changed)}"
                        if changed else ""))
    return sorted(lines)
