"""The run folder, the auditable record of one run, and its one writer (`RunFolder`).

`artifacts/<UTC time>_<flow>_<short id>/` holds the manifest, each lane's raw JSONL and boot log,
tables as Parquet (under `quarantine/` when they fail their expectations: never a result), GX
validation results and report.md. Raw records and logs enter the manifest as soon as they exist,
so an interrupted run keeps what it measured and `lanebench verify` passes on it.

A raw record file is listed with the running digest of what lanebench appended, never the bytes
on disk, and each append adds `bytes digest` to its seal (`.seals/<lane>/<name>.seal`): a dead
run is reclaimed against what it wrote, and a record edited after the crash is named, not
re-hashed (issue 27: an `output_tokens` 64 -> 71 was laundered). A failed write (disk full) frees
a reserve so the manifest can be written once more, consistent with the disk.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
from pydantic import BaseModel

from tasks.hosts.files import file_sha256
from tasks.record.expectations import validate
from tasks.hosts.owner import Owner
from tasks.inventory.paths import REPO
from tasks.record.manifest import (ArtifactEntry, CorrectnessEntry, FileRef, FlowRecord, GitIdentity, HostFacts,
                                   LaneRecord, Manifest, StageMark, read_manifest)

__all__ = ["ArtifactEntry", "LaneRecord", "Manifest", "RunFolder", "RunFolderWriteError"]


RESERVE = ".reserve"  # freed when a write fails, so the manifest can still be written
SEALS = ".seals"  # per-append digests of raw record files: what reclaim checks a dead run against
RESERVE_BYTES = 4 << 20
LIVE_GLOBS = ("*/*.jsonl", "*/*.log")  # raw records and logs: listed as soon as they exist


class RunFolderWriteError(OSError):
    """A write into the run folder failed (disk full, read-only): the lane ends with this one line."""


def git_identity() -> GitIdentity:
    """The lanebench commit; a copy without .git (scripts/gpu-run.sh) names it in `.lanebench-git.json`."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    sha = git("rev-parse", "HEAD")
    if not sha and (carried := REPO / ".lanebench-git.json").is_file():
        known = json.loads(carried.read_text())
        return GitIdentity(git_sha=str(known.get("git_sha") or "unknown"), dirty=bool(known.get("dirty")),
                           git_from=".lanebench-git.json")
    return GitIdentity(git_sha=sha or "unknown", dirty=bool(git("status", "--porcelain")))


def host_facts() -> HostFacts:
    cpu = ""
    with suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return HostFacts(hostname=socket.gethostname(), platform=platform.platform(), machine=platform.machine(),
                     cpu=cpu, cores=os.cpu_count(), memory_gib=round(mem, 1), python=platform.python_version())


class RunFolder:
    """Owns one run folder and its manifest. Flows pass the folder's path (a parameter Prefect
    can record) and look the open RunFolder up with `RunFolder.opened(path)`."""

    _open: dict[str, RunFolder] = {}

    @classmethod
    def opened(cls, path: str | Path) -> RunFolder:
        return cls._open[str(path)]

    def __init__(self, root: Path, flow_name: str, flow_run_id: str, inventory_path: Path) -> None:
        now = datetime.now(UTC)
        self._attach(root / f"{now:%Y%m%dT%H%M%SZ}_{flow_name}_{flow_run_id[:8]}", Manifest(
            lanebench=git_identity(),
            flow=FlowRecord(name=flow_name, flow_run_id=flow_run_id, started_at=now.isoformat(), owner=Owner.here()),
            host=host_facts(),
            inventory=FileRef(path=str(inventory_path), sha256=file_sha256(inventory_path)), artifacts=[],
        ))
        self.path.mkdir(parents=True, exist_ok=False)
        (self.path / RESERVE).write_bytes(b"\0" * RESERVE_BYTES)
        self.save_manifest()
        RunFolder._open[str(self.path)] = self

    def _attach(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self._lock = threading.RLock()
        self._seals: dict[str, hashlib._Hash] = {}  # raw file -> running sha256 of what we appended
        self._pinned: dict[str, str | None] = {}  # file -> the digest to list whatever the disk says (None: unlisted)
        self._ledger_warned = False
        self.write_error: str | None = None

    @classmethod
    def reopen(cls, path: Path) -> RunFolder:
        """The folder of a dead run, for the run that reclaims it (tasks/record/interrupted.py)."""
        run = cls.__new__(cls)
        run._attach(Path(path), read_manifest(path))
        return run

    @contextmanager
    def edit(self) -> Iterator[Manifest]:
        """Change the manifest under the lock, then save it (lanes of different hosts are threads)."""
        with self._lock:
            yield self.manifest
            self.save_manifest()

    def lane(self, name: str) -> LaneRecord:
        with self._lock:
            return self.manifest.lanes.setdefault(name, LaneRecord())

    def correctness(self, lane: str) -> CorrectnessEntry:
        """The lane's correctness entry in the flow record (created on first use)."""
        with self._lock:
            return self.manifest.flow.correctness.setdefault(lane, CorrectnessEntry())

    def stage(self, lane: str, name: str) -> None:
        """The lane enters a stage: timed on its timeline, saved, and shown on the terminal."""
        from tasks.record.progress import progress

        with self.edit():
            record = self.lane(lane)
            record.stage = name
            record.timeline.append(StageMark(stage=name, at=time.time()))
        progress(lane, name)

    def mark(self, lane: str, name: str) -> None:
        """A moment on the timeline that is no stage (teardown, done): `stage` keeps where it ended."""
        with self.edit():
            self.lane(lane).timeline.append(StageMark(stage=name, at=time.time()))

    def lane_dir(self, lane: str) -> Path:
        d = self.path / lane
        d.mkdir(exist_ok=True)
        return d

    def append_jsonl(self, lane: str, name: str, record: BaseModel) -> None:
        """Append one raw record (a new file is listed at once); a failed write cuts the file back to
        its last whole line and raises RunFolderWriteError. The hash is refreshed by the next save,
        not per record: inside a wave's event loop, a save per record held it for milliseconds."""
        rel = f"{lane}/{name}"
        path = self.lane_dir(lane) / name
        data = (record.model_dump_json() + "\n").encode()
        with self._lock:
            size = path.stat().st_size if path.exists() else 0
            # A file this process did not start (never, in a run) is sealed as found.
            sealed = (self._seals.get(rel) or hashlib.sha256(path.read_bytes() if size else b"")).copy()
            sealed.update(data)
            try:
                with path.open("ab") as f:
                    f.write(data)
                seal_path = self.path / SEALS / f"{rel}.seal"
                seal_path.parent.mkdir(parents=True, exist_ok=True)
                with seal_path.open("a") as f:
                    f.write(f"{size + len(data)} {sealed.hexdigest()}\n")
                self._seals[rel] = sealed
            except OSError as e:
                with suppress(OSError):
                    os.truncate(path, size)
                self._failed_write(rel, e)
            if size == 0:
                self._refresh(rel)
                self.save_manifest()

    def _refresh(self, rel: str) -> None:
        """List a live file (or refresh its hash); its kind is kept once a stage has named it."""
        path = self.path / rel
        if not path.is_file() or (rel in self._pinned and self._pinned[rel] is None):
            return
        digest = self._digest(rel)
        for entry in self.manifest.artifacts:
            if entry.path == rel:
                entry.sha256 = digest
                return
        kind = "boot-log" if rel.endswith(".log") else "raw"
        self.manifest.artifacts.append(ArtifactEntry(path=rel, kind=kind, lane=rel.split("/", 1)[0], sha256=digest))

    def _digest(self, rel: str) -> str:
        """A raw record file's digest is what was appended (its seal, reopened); anything else as on disk."""
        if (seal := self._seals.get(rel)) is not None:
            return seal.hexdigest()
        return self._pinned.get(rel) or file_sha256(self.path / rel)

    def pin(self, rel: str, digest: str | None) -> None:
        """List `rel` with this digest whatever is on disk, or never (None): a reclaimed run's records."""
        self._pinned[rel] = digest

    def _write_manifest(self) -> None:
        """Called under the lock, which `lane`, `correctness` and `edit` hold too."""
        text = self.manifest.model_dump_json(indent=2)
        tmp = self.path / "manifest.json.tmp"
        try:
            tmp.write_text(text)
            tmp.replace(self.path / "manifest.json")
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _failed_write(self, what: str, e: OSError, *partial: Path) -> None:
        """Drop the partial files, free the reserve, save a manifest true to the disk, raise one line."""
        for path in partial:
            path.unlink(missing_ok=True)
        (self.path / RESERVE).unlink(missing_ok=True)
        reason = "disk full" if e.errno == errno.ENOSPC else (e.strerror or type(e).__name__)
        line = f"run folder write failed ({reason}) at {what}; every record written before it is kept"
        with self._lock:
            if self.write_error is None:
                self.write_error = self.manifest.flow.write_error = line
            self.manifest.artifacts = [a for a in self.manifest.artifacts if (self.path / a.path).is_file()]
            self.save_manifest(quiet=True)
        raise RunFolderWriteError(e.errno or errno.EIO, line) from None

    def save_manifest(self, quiet: bool = False) -> None:
        """Write the manifest atomically, live files re-hashed; on a full disk the reserve is freed
        for it (`quiet`: never raise)."""
        with self._lock:
            for pattern in LIVE_GLOBS:
                for path in sorted(self.path.glob(pattern)):
                    self._refresh(str(path.relative_to(self.path)))
            try:
                self._write_manifest()
                if self.manifest.flow.finished_at or self.manifest.flow.reclaim:
                    self._sign()
                return
            except OSError as e:
                error = e
            (self.path / RESERVE).unlink(missing_ok=True)
            with suppress(OSError):  # the last manifest written stays; the next save may fit
                self._write_manifest()
            if not quiet and self.write_error is None:
                self._failed_write("manifest.json", error)

    def register(self, lane: str, rel: str, kind: str, rows: int | None = None) -> ArtifactEntry:
        entry = ArtifactEntry(path=rel, kind=kind, lane=lane, sha256=self._digest(rel), rows=rows)
        with self._lock:
            self.manifest.artifacts = [a for a in self.manifest.artifacts if a.path != rel] + [entry]
            self.save_manifest()
        return entry

    def write_table(self, lane: str, kind: str, records: Sequence[BaseModel]) -> tuple[pd.DataFrame, ArtifactEntry]:
        """Validate a table against its GX suite, then write it as a result or into quarantine."""
        df = pd.DataFrame([r.model_dump() for r in records])
        return df, self._validated(lane, kind, df)

    def validate_raw(self, lane: str, name: str, kind: str) -> ArtifactEntry | None:
        """Validate a raw JSONL file in place (raw records are kept even when they fail)."""
        path = self.lane_dir(lane) / name
        if not path.exists():
            return None
        return self._validated(lane, kind, pd.read_json(path, lines=True, convert_dates=False), raw=name)

    def _validated(self, lane: str, kind: str, df: pd.DataFrame, raw: str = "") -> ArtifactEntry:
        """Run the kind's GX suite on `df`; list its result and the table (written, quarantined on failure) or `raw` file."""
        t0 = time.perf_counter()
        outcome = validate(kind, df)
        seconds = time.perf_counter() - t0
        (self.lane_dir(lane) / "validation").mkdir(exist_ok=True)
        rel = f"{lane}/{raw}" if raw else f"{lane}/{'' if outcome.success else 'quarantine/'}{kind}.parquet"
        vrel = f"{lane}/validation/{kind}.json"
        written = [self.path / vrel] + ([] if raw else [self.path / rel])
        try:
            if not raw:
                (self.path / rel).parent.mkdir(exist_ok=True)
                df.to_parquet(self.path / rel, index=False)
            (self.path / vrel).write_text(json.dumps(outcome.result, indent=2, default=str))
        except OSError as e:
            self._failed_write(vrel if raw else rel, e, *written)
        with self.edit():
            self.register(lane, vrel, "validation")
            entry = self.register(lane, rel, kind, rows=len(df))
            entry.validation = "passed" if outcome.success else "failed"
            entry.failed_expectations = outcome.failed
            entry.validation_seconds = round(seconds, 3)
        return entry

    def free_space_problem(self) -> str | None:
        """A lane writes a few MiB: below LANEBENCH_MIN_FREE_MB (default 64) free, it is skipped."""
        need = int(float(os.environ.get("LANEBENCH_MIN_FREE_MB", "64")) * (1 << 20))
        free = shutil.disk_usage(self.path).free
        if free < need:
            return (f"the run folder's disk has {free / (1 << 20):.0f} MiB free, less than the "
                    f"{need / (1 << 20):.0f} MiB a lane may write (LANEBENCH_MIN_FREE_MB)")
        return None

    def finish(self) -> None:
        with self.edit() as m:
            m.flow.finished_at = datetime.now(UTC).isoformat()
            if m.flow.status == "running":
                m.flow.status = "finished"
            (self.path / RESERVE).unlink(missing_ok=True)
        shutil.rmtree(self.path / SEALS, ignore_errors=True)  # the manifest holds every final digest

    def _sign(self) -> None:
        """A finished run's manifest enters the signed ledger (tasks/record/ledger.py), again on each later save."""
        from tasks.record import ledger

        try:
            ledger.record(self.path)
        except (OSError, ValueError) as e:
            if not self._ledger_warned:
                from tasks.record.progress import progress

                progress("run", f"signed ledger not written ({e}): `verify` cannot prove this folder later")
                self._ledger_warned = True
