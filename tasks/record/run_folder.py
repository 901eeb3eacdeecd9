"""The run folder: the auditable record of one run.

`artifacts/<UTC time>_<flow>_<short id>/` holds the manifest, each lane's raw JSONL and
boot log, tables as Parquet, GX validation results and report.md. Raw records are appended
as they arrive, so an interrupted run keeps everything measured up to that point. A table
that fails its expectations is written under `quarantine/` and never counts as a result.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict

from tasks.engines.build import REPO
from tasks.hosts.files import file_sha256
from tasks.record.expectations import validate


class ArtifactEntry(BaseModel):
    path: str  # relative to the run folder
    kind: str
    lane: str
    sha256: str
    rows: int | None = None
    validation: Literal["passed", "failed", "not-validated"] = "not-validated"
    failed_expectations: list[str] = []
    validation_seconds: float | None = None  # time spent in its GX suite (overhead, not measurement)


class StageMark(BaseModel):
    """A lane entered a stage at this moment (seconds since the epoch): the lane's timeline."""

    stage: str
    at: float


class LaneRecord(BaseModel):
    status: Literal["passed", "failed", "skipped", "running"] = "running"
    reason: str = ""
    stage: str = ""
    config: dict[str, Any] = {}
    launch_command: str = ""
    engine_identity: dict[str, str] = {}
    models: list[dict[str, Any]] = []
    preflight: dict[str, Any] = {}  # links, hosts and RPC workers as preflight found them
    image: dict[str, Any] = {}  # container lanes: the pinned reference, digest and image id as pulled
    boot_seconds: float | None = None
    boot_facts: dict[str, Any] = {}
    gates: list[dict[str, Any]] = []
    warnings: list[str] = []
    started_at: str | None = None  # when the lane got its hosts (UTC ISO); lanes of two hosts overlap
    finished_at: str | None = None
    host_lock: dict[str, Any] = {}  # the hold on `gpu:<host>`: asked, got, let go
    timeline: list[StageMark] = []  # every stage entered, in order; "done" when teardown ended
    capacity: dict[str, Any] = {}  # the capacity plan's check before the curve (tasks/stages/capacity.py)


class FlowRecord(BaseModel):
    """What ran: the flow and its run, when, and the sections a flow adds (typed where every flow
    writes them; a flow's own section, such as `matrix` or `kl`, is kept as it writes it).

    Mapping-style access (`flow["kl"] = ...`, `.get`, `.setdefault`) reads and writes the same
    fields, so a section is one line to add wherever a flow builds it."""

    model_config = ConfigDict(extra="allow")

    name: str
    flow_run_id: str
    started_at: str
    finished_at: str | None = None
    status: Literal["running", "finished", "interrupted"] = "running"
    regression_policy: dict[str, Any] | None = None
    regression_error: str | None = None
    held_out_requested: bool | None = None
    correctness: dict[str, Any] = {}  # per lane: agentic, tool-gate and needle verdicts, protocol, ledger
    matrix: dict[str, Any] | None = None
    kl: dict[str, Any] | None = None

    def __getitem__(self, key: str) -> Any:
        if key not in self.model_fields and key not in (self.model_extra or {}):
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, key, value)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and getattr(self, key, None) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = getattr(self, key, None)
        return default if value is None else value

    def setdefault(self, key: str, default: Any) -> Any:
        if getattr(self, key, None) is None or (key == "correctness" and not self.correctness):
            setattr(self, key, default)
        return getattr(self, key)


class Manifest(BaseModel):
    lanebench: dict[str, Any]
    flow: FlowRecord
    host: dict[str, Any]
    inventory: dict[str, Any]
    lanes: dict[str, LaneRecord] = {}
    artifacts: list[ArtifactEntry] = []


def git_identity() -> dict[str, Any]:
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"git_sha": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain"))}


def host_facts() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem, 1), "python": platform.python_version()}


class RunFolder:
    """Owns one run folder and its manifest; every write goes through here.

    Flows receive the folder's path (a plain parameter Prefect can record) and look the
    open RunFolder up with `RunFolder.opened(path)`.
    """

    _open: dict[str, RunFolder] = {}

    @classmethod
    def opened(cls, path: str | Path) -> RunFolder:
        return cls._open[str(path)]

    def __init__(self, root: Path, flow_name: str, flow_run_id: str, inventory_path: Path) -> None:
        now = datetime.now(UTC)
        self.path = root / f"{now:%Y%m%dT%H%M%SZ}_{flow_name}_{flow_run_id[:8]}"
        self.path.mkdir(parents=True, exist_ok=False)
        self._lock = threading.RLock()
        self.manifest = Manifest(
            lanebench=git_identity(),
            flow=FlowRecord(name=flow_name, flow_run_id=flow_run_id, started_at=now.isoformat()),
            host=host_facts(),
            inventory={"path": str(inventory_path), "sha256": file_sha256(inventory_path)},
        )
        self.save_manifest()
        RunFolder._open[str(self.path)] = self

    def lane(self, name: str) -> LaneRecord:
        return self.manifest.lanes.setdefault(name, LaneRecord())

    def stage(self, lane: str, name: str) -> None:
        """The lane enters a stage: recorded with its time (the overhead benchmark reads the
        timeline), saved, and shown on the terminal."""
        from tasks.record.progress import progress

        record = self.lane(lane)
        record.stage = name
        record.timeline.append(StageMark(stage=name, at=time.time()))
        self.save_manifest()
        progress(lane, name)

    def lane_dir(self, lane: str) -> Path:
        d = self.path / lane
        d.mkdir(exist_ok=True)
        return d

    def append_jsonl(self, lane: str, name: str, record: BaseModel) -> None:
        with self._lock, (self.lane_dir(lane) / name).open("a") as f:
            f.write(record.model_dump_json() + "\n")

    def save_manifest(self) -> None:
        """Write the manifest atomically. Lanes of different hosts run in threads and update their
        own records while another thread saves: a dump that met a record mid-change is retried."""
        with self._lock:
            for attempt in range(5):
                try:
                    text = self.manifest.model_dump_json(indent=2)
                    break
                except RuntimeError:  # "dictionary changed size during iteration"
                    if attempt == 4:
                        raise
            tmp = self.path / "manifest.json.tmp"
            tmp.write_text(text)
            tmp.replace(self.path / "manifest.json")

    def register(self, lane: str, rel: str, kind: str, rows: int | None = None) -> ArtifactEntry:
        entry = ArtifactEntry(path=rel, kind=kind, lane=lane, sha256=file_sha256(self.path / rel), rows=rows)
        with self._lock:
            self.manifest.artifacts = [a for a in self.manifest.artifacts if a.path != rel] + [entry]
            self.save_manifest()
        return entry

    def write_table(self, lane: str, kind: str, records: list[BaseModel]) -> tuple[pd.DataFrame, ArtifactEntry]:
        """Validate a table against its GX suite, then write it as a result or into quarantine."""
        df = pd.DataFrame([r.model_dump() for r in records])
        t0 = time.perf_counter()
        outcome = validate(kind, df)
        seconds = time.perf_counter() - t0
        sub = "" if outcome.success else "quarantine/"
        (self.lane_dir(lane) / "validation").mkdir(exist_ok=True)
        if sub:
            (self.lane_dir(lane) / "quarantine").mkdir(exist_ok=True)
        rel = f"{lane}/{sub}{kind}.parquet"
        df.to_parquet(self.path / rel, index=False)
        vrel = f"{lane}/validation/{kind}.json"
        (self.path / vrel).write_text(json.dumps(outcome.result, indent=2, default=str))
        self.register(lane, vrel, "validation")
        entry = self.register(lane, rel, kind, rows=len(df))
        entry.validation = "passed" if outcome.success else "failed"
        entry.failed_expectations = outcome.failed
        entry.validation_seconds = round(seconds, 3)
        self.save_manifest()
        return df, entry

    def validate_raw(self, lane: str, name: str, kind: str) -> ArtifactEntry | None:
        """Validate a raw JSONL file in place (raw records are kept even when they fail)."""
        path = self.lane_dir(lane) / name
        if not path.exists():
            return None
        df = pd.read_json(path, lines=True, convert_dates=False)
        t0 = time.perf_counter()
        outcome = validate(kind, df)
        seconds = time.perf_counter() - t0
        vrel = f"{lane}/validation/{kind}.json"
        (self.lane_dir(lane) / "validation").mkdir(exist_ok=True)
        (self.path / vrel).write_text(json.dumps(outcome.result, indent=2, default=str))
        self.register(lane, vrel, "validation")
        entry = self.register(lane, f"{lane}/{name}", kind, rows=len(df))
        entry.validation = "passed" if outcome.success else "failed"
        entry.failed_expectations = outcome.failed
        entry.validation_seconds = round(seconds, 3)
        self.save_manifest()
        return entry

    def finish(self) -> None:
        self.manifest.flow.finished_at = datetime.now(UTC).isoformat()
        self.manifest.flow.status = "finished"
        self.save_manifest()
