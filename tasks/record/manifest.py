"""The manifest of a run folder, typed, and the one way to read it.

Every section is a model. A section another module builds from its own model (a lane's config,
the boot facts, the matrix registration) is kept as dumped, a `JsonObject`: the record lies
below those modules. `schema_version` says the shape; v0 folders (up to faf9901, no version;
tests/fixtures/run-folders-v0) migrate in the models' `_v0` validators. `read_manifest` is the only parser,
`RunFolder` (tasks/record/run_folder.py) the only writer.

Paths a run folder names stay inside the artifacts folder (`confined`): a folder is data anyone
with write access can shape, and a symlinked run folder led reclaim to rewrite a manifest
outside it (issue 27). Reclaim, history and verify refuse such a path with one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError, field_validator, model_validator

from tasks.hosts.gpu import GpuHostFacts
from tasks.hosts.lock import Hold
from tasks.hosts.owner import Owner
from tasks.record.rows import Finding, GateResult

SCHEMA_VERSION = 1
JsonObject = dict[str, JsonValue]


class _Section(BaseModel):
    """Assignments are validated: `record.host_lock = hold.model_dump()` stores a Hold."""

    model_config = ConfigDict(validate_assignment=True)


class GitIdentity(_Section):
    git_sha: str = "unknown"
    dirty: bool = False
    git_from: str | None = None  # a copy without .git: the file that names its commit


class HostFacts(_Section):
    hostname: str = ""
    platform: str = ""
    machine: str = ""
    cpu: str = ""
    cores: int | None = None
    memory_gib: float | None = None
    python: str = ""


class FileRef(_Section):
    path: str
    sha256: str


class ArtifactEntry(_Section):
    path: str  # relative to the run folder
    kind: str
    lane: str
    sha256: str
    rows: int | None = None
    validation: Literal["passed", "failed", "not-validated"] = "not-validated"
    failed_expectations: list[str] = []
    validation_seconds: float | None = None  # time spent in its GX suite (overhead, not measurement)


class StageMark(_Section):
    """A lane entered a stage at this moment (seconds since the epoch): the lane's timeline."""

    stage: str
    at: float


class ModelFacts(_Section):
    """A model file the lane served, as preflight found it."""

    role: str  # model, drafter, mmproj, ...
    path: str
    bytes: int
    sha256: str | None = None


class GpuSection(_Section):
    """nvidia-smi on the lane's host before boot, once booted and after teardown (tasks/hosts/gpu.py)."""

    before: GpuHostFacts | None = None
    booted: GpuHostFacts | None = None
    after: GpuHostFacts | None = None
    server_memory_mib: float | None = None
    cpu_lane_holds_gpu: str | None = None


class Bandwidth(_Section):
    """What the decode curve's bandwidth share divides."""

    model_bytes: int
    memory_gbps: float


class LaneRecord(_Section):
    status: Literal["passed", "failed", "skipped", "running", "interrupted"] = "running"
    reason: str = ""
    stage: str = ""
    config: JsonObject = {}  # the lane as declared, secrets redacted (tasks/inventory)
    launch_command: str = ""
    engine_identity: dict[str, str] = {}
    models: list[ModelFacts] = []
    preflight: JsonObject = {}  # links, hosts and RPC workers as preflight found them
    image: JsonObject = {}  # container lanes: the pinned reference, digest and image id as pulled
    boot_seconds: float | None = None
    boot_facts: JsonObject = {}  # the engine's facts from its boot log and API (tasks/engines)
    gates: list[GateResult] = []
    warnings: list[str] = []
    # Safe by default (tasks/stages/safety.py): flags, and the implied gates the lane turned off, with
    # their reasons.
    flags: list[Finding] = []
    waivers: list[JsonObject] = []
    started_at: str | None = None  # when the lane got its hosts (UTC ISO); lanes of two hosts overlap
    finished_at: str | None = None
    host_lock: Hold | None = None  # the hold on `gpu:<host>`: asked, got, let go
    timeline: list[StageMark] = []  # every stage entered, in order; "done" when teardown ended
    gpu: GpuSection = GpuSection()
    bandwidth: Bandwidth | None = None
    capacity: JsonObject = {}  # the capacity plan's check before the curve (tasks/stages/capacity.py)
    fingerprint: dict[str, str] = {}  # what can move a number (tasks/record/fingerprint.py): comparisons hold it equal

    @field_validator("host_lock", "bandwidth", mode="before")
    @classmethod
    def _v0(cls, value: Any) -> Any:
        """v0 wrote `{}` for a section not recorded."""
        return value or None

    def stopped_in(self) -> str:
        """The stage a failure or a stop happened in, not the teardown that followed it."""
        stages = [m.stage for m in self.timeline if m.stage not in ("teardown", "done")]
        return stages[-1] if stages else self.stage


class FlowVerdict(_Section):
    """The run's outcome as its command exits with it (tasks/record/verdict.py)."""

    outcome: str
    exit_code: int
    line: str


class Reclaim(_Section):
    """A later run found this one's writer dead and marked it (tasks/record/interrupted.py)."""

    marked_at: str
    changed_after_crash: list[str] = []  # raw records that differ from their seals: `verify` fails on them


class SuiteRun(_Section):
    """One split of the tool gate: which suite bytes, and (held out) how often they were run here."""

    suite: str
    run: bool = True
    why: str = ""  # a held-out suite not run: why
    sha256: str | None = None
    cases: int | None = None
    run_number: int | None = None
    earlier_runs: list[str] = []
    solved: int | None = None
    seconds: float | None = None


class ToolGateLedger(_Section):
    protocol: JsonObject  # path, sha256 and the protocol's settings (tasks/inventory ToolProtocol)
    dev: SuiteRun | None = None
    held_out: SuiteRun | None = None


class CorrectnessEntry(_Section):
    gates: list[GateResult] = []  # agentic smoke, thinking switch, tool gate, needle ladder
    tool_gate: ToolGateLedger | None = None  # tasks/correctness/tool_gate.py


class ArmFacts(_Section):
    """One matrix arm: as declared (tasks/matrix/config.py Arm), and how its run went."""

    name: str
    drafter: str
    revision: str
    k: int
    flags: list[str] = []
    baseline: bool = False
    started_at: str | None = None
    port: int | None = None
    port_note: str | None = None
    load_at_start: float | None = None
    finished_at: str | None = None
    load_at_end: float | None = None
    host_lock: Hold | None = None
    state: str | None = None
    message: str | None = None


class MatrixVerdict(_Section):
    complete: bool
    incomplete_arms: list[str] = []
    quarantined: list[str] = []
    registration_altered: str = ""
    model_drift: list[str] = []
    drafters: dict[str, JsonObject] = {}
    bars_failed: int = 0
    bars_passed: int = 0
    bars_no_data: int = 0


class MatrixSection(_Section):
    """The matrix flow's registration (written before the first boot) and its verdict."""

    subject: str  # sha256 of the target's and drafters' bytes: what the bars are about
    target_sha256: str | None = None  # by label: a later run names what changed under the same label
    drafter_sha256: dict[str, str] = {}
    identical_drafters: list[str] = []
    name: str
    file: str
    file_sha256: str
    inventory: FileRef
    target: str
    registration_sha256: str
    registration_file_sha256: str
    registration: JsonObject  # tasks/matrix/bars.py Registration
    earlier_run: JsonObject | None = None  # tasks/matrix/bars.py EarlierRun
    host_lock: str = ""
    arms: dict[str, ArmFacts] = {}
    file_changed_during_run: str | None = None
    against_no_speculation: list[str] = []
    verdict: MatrixVerdict | None = None


class KlSection(_Section):
    """The KL gate's facts (tasks/kl/gate.py), its headline and its flags."""

    reference: str
    candidates: list[str]
    prompts: int
    prompt_count_in_file: int | None = None
    tokens_per_prompt: int
    positions: int
    text_sha256: str
    probe_tokens: int
    ignore_eos: bool
    concurrency: int
    resamples: int
    seed: int
    tolerance: float
    bars: JsonObject = {}
    exactness: JsonObject | None = None  # the reference against itself, sampled twice
    headline: str = ""
    flags: list[str] = []


class FlowRecord(_Section):
    """What ran: the flow and its run, when, and the sections each flow adds."""

    name: str
    flow_run_id: str
    started_at: str
    finished_at: str | None = None
    status: Literal["running", "finished", "interrupted"] = "running"
    owner: Owner = Owner()
    interrupted_by: str | None = None  # a signal's name, or the run that reclaimed this one
    reclaim: Reclaim | None = None
    reclaimed: list[str] = []  # the dead runs this one marked, one line each
    write_error: str | None = None
    regression_policy: JsonObject | None = None
    regression_error: str | None = None
    comparison_refused: dict[str, str] = {}  # lane -> why its baseline is not comparable
    held_out_requested: bool | None = None
    correctness: dict[str, CorrectnessEntry] = {}
    matrix: MatrixSection | None = None
    kl: KlSection | None = None
    verdict: FlowVerdict | None = None

    @model_validator(mode="before")
    @classmethod
    def _v0(cls, data: Any) -> Any:
        """v0 kept the KL headline and flags and the reclaim's facts loose in `flow`."""
        if not isinstance(data, dict) or not {"kl_headline", "kl_flags", "marked_at"} & data.keys():
            return data
        data = dict(data)
        headline, flags = data.pop("kl_headline", None), data.pop("kl_flags", None)
        if isinstance(data.get("kl"), dict):
            data["kl"] = {**data["kl"], "headline": headline or "", "flags": flags or []}
        if marked := data.pop("marked_at", None):
            data["reclaim"] = {"marked_at": marked, "changed_after_crash": data.pop("changed_after_crash", None) or []}
        return data


class Manifest(_Section):
    schema_version: int = SCHEMA_VERSION
    lanebench: GitIdentity = GitIdentity()
    flow: FlowRecord
    host: HostFacts = HostFacts()
    inventory: FileRef | None = None
    lanes: dict[str, LaneRecord] = {}
    artifacts: list[ArtifactEntry]  # required: a manifest without it cannot vouch for any file


class Outside(ValueError):
    """A path that is a symlink or leaves its root: the one line that says which and why."""


def confined(root: Path, rel: str | Path) -> Path:
    """`root / rel` when `rel` is relative, has no `..` and no symlink on the way from `root` (which
    the user chose, so may be one). Raises Outside."""
    parts = PurePosixPath(str(rel)).parts
    if not parts or PurePosixPath(str(rel)).is_absolute() or ".." in parts:
        raise Outside(f"{rel}: leaves {root} (absolute or '..'): not followed")
    path = Path(root)
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise Outside(f"{path}: a symlink, not followed (nothing outside {root} is read or written)")
    return path


def inside(root: Path, path: Path) -> Path:
    """`path` (found under `root` by a glob) checked as `confined` does."""
    return confined(root, Path(path).relative_to(root))


class ManifestError(ValueError):
    """A manifest.json that cannot be read as a manifest: one line naming the file and why."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.why = why


def parse_manifest(text: str, where: str = "manifest.json") -> Manifest:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ManifestError(where, f"not valid JSON ({getattr(e, 'msg', e)} at line {getattr(e, 'lineno', '?')}): "
                            "truncated or edited") from None
    if not isinstance(data, dict):
        raise ManifestError(where, "not a JSON object")
    if (version := data.get("schema_version", SCHEMA_VERSION)) != SCHEMA_VERSION:
        raise ManifestError(where, f"schema_version {version} is newer than this lanebench reads "
                            f"({SCHEMA_VERSION}); fix: update lanebench")
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ManifestError(where, f"{field}: {first['msg']} ({e.error_count()} problem(s))") from None


def read_manifest(path: Path) -> Manifest:
    """A run folder's manifest (the folder or its manifest.json), migrated. Raises ManifestError, OSError."""
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    return parse_manifest(path.read_text(), str(path))


def scan_manifests(root: Path, pattern: str = "*") -> Iterator[tuple[Path, Manifest]]:
    """(folder, manifest) of each readable run folder under `root`, oldest first; no symlink followed."""
    for manifest_path in sorted(Path(root).glob(f"{pattern}/manifest.json")):
        try:
            inside(Path(root), manifest_path)
            yield manifest_path.parent, read_manifest(manifest_path)
        except (OSError, ManifestError, Outside):
            continue
