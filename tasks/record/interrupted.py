"""Runs that did not finish: marked interrupted, by themselves on a signal or by the next run.

A run folder names its owner (host, boot id, pid and the pid's start time): a later run on the
same host whose owner process is gone marks the folder `interrupted`, lists the raw records and
logs it left (hashes refreshed, so `lanebench verify` passes), removes a half-written
`manifest.json.tmp` and the disk reserve, and says so in one line. `history` and the regression
baseline count only passed lanes, so an interrupted lane never becomes a baseline.
"""

from __future__ import annotations

import hashlib
import json
import signal
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tasks.hosts.owner import owner_alive
from tasks.record.confined import Outside, inside

LIVE_GLOBS = ("*/*.jsonl", "*/*.log")
SEALS = ".seals"  # per-append digests of raw record files (tasks/record/run_folder.py)


_STOPS: list[str] = []  # signals received by this process, in order


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, raised where the run is, so it tears down and is marked interrupted."""

    def __init__(self, sig: int) -> None:
        super().__init__(signal.Signals(sig).name)
        self.signal = sig


def stop_requested() -> str | None:
    """The first stop signal this process received ('SIGINT', 'SIGTERM'), else None.

    A flag as well as an exception: Prefect's engine may turn the KeyboardInterrupt it catches
    while starting a task into another error, so stages ask the flag, not the exception type."""
    return _STOPS[0] if _STOPS else None


def _on_stop(signum: int, frame: object) -> None:
    _STOPS.append(signal.Signals(signum).name)
    raise Stopped(signum)


def install_stop_handlers() -> None:
    """Ctrl-C and SIGTERM both stop the run (main thread only). Prefect swaps in its own SIGTERM
    handler while a flow runs (raising TerminationSignal); it is bridged so the stop is recorded too."""
    signal.signal(signal.SIGINT, _on_stop)
    signal.signal(signal.SIGTERM, _on_stop)
    try:
        import prefect.utilities.engine as engine
        from prefect.exceptions import TerminationSignal
    except ImportError:
        return
    original = engine._prefect_sigterm_handler
    if getattr(original, "_lanebench", False):
        return

    class Terminated(TerminationSignal, KeyboardInterrupt):
        """Prefect's SIGTERM exception, which asyncio lets through. A signal handler raises in
        whatever code runs when the signal lands; inside an event-loop callback (a wave reading
        its sockets) asyncio logged a plain TerminationSignal and dropped it, and the lane
        measured on (test_matrix's SIGTERM case, 2026-12-01). asyncio re-raises a
        KeyboardInterrupt; Prefect's engine still catches it as the TerminationSignal it is."""

    def bridged(sig_num: int, *args: object):  # type: ignore[no-untyped-def]
        _STOPS.append(signal.Signals(sig_num).name)
        raise Terminated(signal=sig_num)

    bridged._lanebench = True  # type: ignore[attr-defined]
    engine._prefect_sigterm_handler = bridged


def interrupts() -> tuple[type[BaseException], ...]:
    """What stops a run from outside: Ctrl-C, and SIGTERM as Prefect's engine raises it."""
    from prefect.exceptions import TerminationSignal

    return (KeyboardInterrupt, TerminationSignal)


def signal_name(e: BaseException | None = None) -> str:
    if stop_requested():
        return stop_requested() or ""
    sig = getattr(e, "signal", None)
    if isinstance(sig, int):
        return signal.Signals(sig).name
    return "SIGINT" if isinstance(e, KeyboardInterrupt) else type(e).__name__


def mark_lanes(lanes: dict[str, Any], why: str) -> list[str]:
    """Every lane still running becomes interrupted, its stage named; returns their names."""
    names = []
    for name, lane in lanes.items():
        status = lane.get("status") if isinstance(lane, dict) else lane.status
        if status == "running":
            stage = lane.get("stage", "") if isinstance(lane, dict) else lane.stage
            timeline = lane.get("timeline", []) if isinstance(lane, dict) else lane.timeline
            marks = [m.get("stage") if isinstance(m, dict) else m.stage for m in timeline or []]
            marks = [m for m in marks if m not in ("teardown", "done")]
            stage = marks[-1] if marks else stage  # where it was stopped, not the teardown that followed
            reason = f"{stage}: {why}" if stage else why
            if isinstance(lane, dict):
                lane["status"], lane["reason"] = "interrupted", reason
            else:
                lane.status, lane.reason = "interrupted", reason
            names.append(name)
    return names


def record_stop(run: Any, flow: str, e: BaseException | None, names: list[str] | tuple[str, ...] = ()) -> str:
    """A run stopped by a signal records itself: the run folder `interrupted` (by which signal),
    every running lane `interrupted` at its stage, every lane of `names` never started said so.
    The caller still finishes the folder (`run.finish()` keeps this status). Returns the closing
    message, `<flow> interrupted by SIGINT`, which every flow command prints and maps to 130."""
    why = signal_name(e)
    run.manifest.flow["status"] = "interrupted"
    run.manifest.flow["interrupted_by"] = why
    mark_lanes(run.manifest.lanes, f"interrupted by {why}")
    for name in names:  # lanes never started are recorded as such, not left out
        if name not in run.manifest.lanes:
            run.lane(name).status, run.lane(name).reason = "interrupted", "not started: the run was interrupted"
    return f"{flow} interrupted by {why}"


def raise_if_stopped() -> None:
    """Between lanes, arms or candidates: a stop the lane's own error handling swallowed (Prefect
    may turn the KeyboardInterrupt into another error) still ends the run here."""
    if stop_requested():
        raise KeyboardInterrupt(stop_requested())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _last_seal(folder: Path, rel: str) -> tuple[int, str] | None:
    """The last whole `bytes digest` line of a raw file's seal (a torn last line is ignored)."""
    try:
        text = (folder / SEALS / f"{rel}.seal").read_text()
    except OSError:
        return None
    last = None
    for line in text.split("\n")[:-1]:
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and len(parts[1]) == 64:
            last = (int(parts[0]), parts[1])
    return last


def _prefix_sha256(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(f.read(size))
    return h.hexdigest()


def _seal_problem(path: Path, size: int, digest: str) -> str | None:
    """How a raw file differs from what lanebench appended to it (None: byte for byte the same)."""
    actual = path.stat().st_size
    if actual < size:
        return f"cut to {actual} of the {size} bytes lanebench wrote"
    if _prefix_sha256(path, size) != digest:
        return "its records differ from what lanebench wrote"
    if actual > size:
        return f"{actual - size} bytes were added after the last record lanebench wrote"
    return None


def _list_live_files(folder: Path, m: dict) -> list[str]:
    """List and hash what a dead run left. Logs (its server wrote on) are hashed as found; a raw
    record file only as its seal says lanebench wrote it: one that differs keeps the sealed digest
    (so `verify` fails on it) and is named in `flow.changed_after_crash`. Returns those names."""
    listed = {a["path"]: a for a in m.get("artifacts", [])}
    changed: dict[str, str] = dict(item.split(": ", 1) for item in (m.get("flow") or {}).get("changed_after_crash", []))
    for pattern in LIVE_GLOBS:  # what it wrote after its last save
        for path in sorted(folder.glob(pattern)):
            rel = str(path.relative_to(folder))
            try:
                inside(folder, path)
            except Outside:
                changed[rel] = "a symlink (or under one), not a file lanebench wrote: not followed"
                continue
            entry = listed.get(rel) or {"path": rel, "kind": "boot-log" if rel.endswith(".log") else "raw",
                                        "lane": rel.split("/", 1)[0], "rows": None, "validation": "not-validated",
                                        "failed_expectations": []}
            if rel.endswith(".jsonl"):
                seal = _last_seal(folder, rel)
                if seal is None:
                    if rel not in listed:  # nothing says lanebench wrote it: left unlisted, verify names it
                        changed[rel] = "no seal: not written by lanebench"
                    continue  # listed without a seal: its listed digest stands
                problem = _seal_problem(path, *seal)
                entry["sha256"] = seal[1]
                if problem:
                    changed[rel] = problem
            else:
                entry["sha256"] = _sha256(path)
            if rel not in listed:
                m.setdefault("artifacts", []).append(entry)
                listed[rel] = entry
    m["artifacts"] = [a for a in m.get("artifacts", []) if (folder / a["path"]).is_file()]
    if changed:
        m.setdefault("flow", {})["changed_after_crash"] = [f"{rel}: {why}" for rel, why in sorted(changed.items())]
    return sorted(changed)


def _sign(folder: Path) -> None:
    """The reclaimed manifest enters the signed ledger, as a finished one does (tasks/record/ledger.py)."""
    from tasks.record import ledger

    try:
        ledger.record(folder)
    except (OSError, ValueError):
        pass


def _write(folder: Path, m: dict) -> None:
    tmp = folder / "manifest.json.tmp"
    tmp.write_text(json.dumps(m, indent=2))
    tmp.replace(folder / "manifest.json")


def refresh_marked(root: Path, by: str) -> None:
    """Hash again the logs of the folders `by` marked: the dead run's server wrote on until the
    lane that reclaimed it stopped it."""
    for manifest_path in sorted(Path(root).glob("*/manifest.json")):
        try:
            inside(Path(root), manifest_path)
            m = json.loads(manifest_path.read_text())
        except (OSError, ValueError):  # Outside is a ValueError: a symlinked folder is never rewritten
            continue
        if (m.get("flow") or {}).get("interrupted_by") == by and (m.get("flow") or {}).get("marked_at"):
            _list_live_files(manifest_path.parent, m)
            _write(manifest_path.parent, m)
            _sign(manifest_path.parent)


def reclaim_dead_runs(root: Path, by: str) -> list[str]:
    """Mark every unfinished run folder under `root` whose owner died; one line per folder."""
    lines = []
    for manifest_path in sorted(Path(root).glob("*/manifest.json")):
        folder = manifest_path.parent
        try:
            inside(Path(root), manifest_path)
        except Outside as e:  # not even read: what it points at is not the artifacts folder's
            lines.append(f"run {folder.name}: not reclaimed: {e}")
            continue
        try:
            m = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(m, dict):
            continue
        flow = m.get("flow") or {}
        if flow.get("finished_at") or flow.get("status") not in (None, "running"):
            continue
        if owner_alive(flow.get("owner") or {}) is not False:
            continue
        pid = (flow.get("owner") or {}).get("pid")
        why = f"interrupted: lanebench (pid {pid}) died before the run finished; marked by {by}"
        lanes = mark_lanes(m.get("lanes") or {}, why)
        changed = _list_live_files(folder, m)
        flow.update(status="interrupted", interrupted_by=by, marked_at=datetime.now(UTC).isoformat())
        m["flow"] = flow
        _write(folder, m)
        (folder / ".reserve").unlink(missing_ok=True)
        _sign(folder)
        lines.append(f"run {folder.name}: marked interrupted (lanebench pid {pid} died"
                     + (f"; lanes {', '.join(lanes)} did not finish" if lanes else "") + ")"
                     + (f"; changed after the crash, not re-hashed: {', '.join(changed)}" if changed else ""))
    return lines
