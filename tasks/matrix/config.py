"""The matrix file: drafters x K x prompt class on one target lane, with bars set before the run
(the seeds' October evaluation by hand, stated once; fields in matrix/README.md, example
matrix/rehearsal.yaml). `load_matrix` checks every field and cross-reference before anything runs;
any problem is one `ConfigError`. Paths are relative to the matrix file."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tasks.engines import engine_for
from tasks.inventory.models import _NAME, AcceptancePlan, BenchPlan, ConfigError, DecodePlan, FileRef, Host, Lane, Speculative
from tasks.inventory.flag_conflicts import flag_values
from tasks.inventory.base import _Strict
from tasks.inventory.config_file import config_error, load_model
from tasks.inventory.load import DEFAULT_INVENTORY, load_inventory
from tasks.inventory.paths import resolve
from tasks.matrix.bars import METRICS, Bar

_DOC = "matrix/README.md"


class DrafterRef(_Strict):
    """A drafter checkpoint (file or folder) and the revision it was cut from (recorded, never guessed);
    `method` overrides the matrix's, and a model-free one (vLLM's `ngram`) has no `path`."""

    path: str | None = None
    revision: Annotated[str, Field(min_length=1, max_length=80)]
    method: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,40}$")] | None = None
    bytes: Annotated[int, Field(gt=0)] | None = None
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None

    @model_validator(mode="after")
    def _file_or_method(self) -> DrafterRef:
        if self.path is None and self.method is None:
            raise ValueError("a drafter needs 'path' (its checkpoint), or 'method' for a model-free one (e.g. ngram)")
        if self.path is None and (self.bytes is not None or self.sha256 is not None):
            raise ValueError("bytes and sha256 describe a drafter's file: give 'path' too, or drop them")
        return self


Width = Annotated[int, Field(ge=1, le=64)]


class ArmSpec(_Strict):
    """One drafter at one or more draft widths K; each K is its own arm, booted fresh."""

    drafter: str
    k: Width | Annotated[list[Width], Field(min_length=1)]
    name: str | None = None  # default `<drafter>-k<K>`; only with a single K
    flags: list[str] = []  # appended to the target lane's flags for this arm only


class SpeedPlan(_Strict):
    """The speed rows: the lane's decode curve on one prompt set at these concurrency levels."""

    prompt_set: str | None = None  # default: the first prompt set
    concurrency: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1)] = [1]
    max_tokens: Annotated[int, Field(ge=1)] = 64
    requests_per_stream: Annotated[int, Field(ge=1)] = 2


class MatrixFile(_Strict):
    name: str | None = None  # default: the file's stem; reruns of one name are compared
    inventory: str | None = None
    target: str
    method: str | None = None  # speculative method; default the target lane's
    drafters: Annotated[dict[str, DrafterRef], Field(min_length=1)]
    baseline: str
    arms: Annotated[list[ArmSpec], Field(min_length=1)]
    prompt_sets: Annotated[dict[str, str], Field(min_length=1)]
    prompts_per_class: Annotated[int, Field(ge=1)] = 8
    max_tokens: Annotated[int, Field(ge=1)] = 96  # per acceptance-probe request
    repeats: Annotated[int, Field(ge=1, le=50)] = 3
    speed: SpeedPlan = SpeedPlan()
    # The target's correctness gates on every arm; off by default: verification keeps every answer the
    # target's own ("a weaker drafter never changes an answer"). Boot gates and agentic flags apply anyway.
    correctness: bool = False
    bars: Annotated[list[Bar], Field(min_length=1)]


class Arm(_Strict):
    """One arm as it runs: a drafter at one K on the target lane."""

    name: str
    drafter: str
    revision: str
    k: int
    flags: tuple[str, ...] = ()
    baseline: bool = False


class Matrix(BaseModel):
    """A checked matrix file, made concrete: the target lane, its host, the arms in order."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    path: Path
    spec: MatrixFile
    name: str
    inventory_path: Path
    target: Lane  # the inventory's lane, model path absolute
    host_name: str
    host: Host
    arms: tuple[Arm, ...]
    prompt_sets: dict[str, Path]  # class -> absolute file
    prompt_counts: dict[str, int]
    speed_set: str
    bars: tuple[Bar, ...]

    @property
    def base_dir(self) -> Path:
        return self.path.parent


_FIXES = {"extra_forbidden": f"remove it, or check its spelling against the fields documented in {_DOC}",
          "bars.value_error": f"write the bar in one of the forms documented in {_DOC}"}


def _known(path: Path, field: str, what: str, name: str | None, under: str, known: dict) -> None:
    """A cross-reference (a drafter, a prompt class ...) names an entry of `under`, or it is a ConfigError."""
    if name is not None and name not in known:
        raise ConfigError(path, field, f"names {what} {name!r}, which is not under '{under}'", f"use one of: {', '.join(known)}")


def _count_prompts(path: Path, field: str, matrix_path: Path) -> list[tuple[str, str]]:
    """(class, id) of every prompt in a JSONL prompt set; a malformed file is a ConfigError."""
    if not path.is_file():
        raise ConfigError(matrix_path, field, f"prompt file {path} does not exist",
                          "point it at a JSONL file of {id, class, prompt} lines (paths are relative to the matrix file)")
    keys = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            keys.append((str(row["class"]), str(row["id"])))
            str(row["prompt"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(matrix_path, field, f"{path} line {n} is not a JSON object with id, class and prompt ({e})",
                              "one JSON object per line with those keys") from None
    return keys


def _arms(spec: MatrixFile, path: Path) -> tuple[Arm, ...]:
    arms: list[Arm] = []
    for i, a in enumerate(spec.arms):
        field = f"arms[{i}]"
        _known(path, f"{field}.drafter", "drafter", a.drafter, "drafters", spec.drafters)
        ks = [a.k] if isinstance(a.k, int) else list(a.k)
        if a.name is not None and len(ks) > 1:
            raise ConfigError(path, f"{field}.name", "a name needs a single K (each K is its own arm)",
                              "drop 'name' (arms are then called <drafter>-k<K>) or split the entry per K")
        if len(set(ks)) != len(ks):
            raise ConfigError(path, f"{field}.k", "lists a K twice", "list each K once")
        for k in ks:
            name = a.name or f"{a.drafter}-k{k}"
            if not _NAME.fullmatch(name):
                raise ConfigError(path, f"{field}.name", f"arm name {name!r} is not a valid name",
                                  "letters, digits, '_', '.', '-' (at most 63), starting with a letter or digit")
            if any(x.name == name for x in arms):
                raise ConfigError(path, field, f"arm {name!r} is declared twice",
                                  "give one of them its own 'name' (e.g. good-k4-noflags)")
            arms.append(Arm(name=name, drafter=a.drafter, revision=spec.drafters[a.drafter].revision, k=k,
                            flags=tuple(a.flags), baseline=a.drafter == spec.baseline))
    return tuple(arms)


def judged_arms(bar: Bar, arms: tuple[Arm, ...]) -> list[Arm]:
    """The arms a bar judges: its drafter/K selectors; a relative bar skips the baseline's own arms."""
    return [a for a in arms if (bar.drafter is None or a.drafter == bar.drafter) and (bar.k is None or a.k == bar.k)
            and not (bar.relative_to and a.baseline)]


def baseline_arm(arm: Arm, arms: tuple[Arm, ...]) -> Arm | None:
    """The baseline drafter's arm at the same K (the first one, if the baseline has several)."""
    return next((a for a in arms if a.baseline and a.k == arm.k), None)


def _check_bars(spec: MatrixFile, arms: tuple[Arm, ...], path: Path, speed_levels: list[int]) -> None:
    for i, bar in enumerate(spec.bars):
        field = f"bars[{i}]"
        _known(path, f"{field}.class", "prompt class", bar.prompt_class, "prompt_sets", spec.prompt_sets)
        if bar.concurrency is not None and bar.concurrency not in speed_levels:
            raise ConfigError(path, f"{field}.concurrency", f"C={bar.concurrency} is not a speed level",
                              f"use one of {speed_levels}, or add it to speed.concurrency")
        _known(path, f"{field}.drafter", "drafter", bar.drafter, "drafters", spec.drafters)
        if bar.relative_to and bar.drafter == spec.baseline:
            raise ConfigError(path, f"{field}.drafter", f"a bar relative to the baseline judges the baseline {bar.drafter!r} itself",
                              "name another drafter, or make the bar absolute (op and value)")
        judged = judged_arms(bar, arms)
        if not judged:
            raise ConfigError(path, field, f"judges no arm ({METRICS[bar.metric][0]}, drafter {bar.drafter or 'any'}, "
                              f"K {bar.k if bar.k is not None else 'any'})",
                              "select a drafter and K that some arm has")
        for arm in judged:
            if bar.position is not None and bar.position > arm.k:
                raise ConfigError(path, f"{field}.position", f"position {bar.position} is beyond arm {arm.name}'s K={arm.k}",
                                  "select arms with a larger K ('k') or a smaller position")
            if bar.relative_to and baseline_arm(arm, arms) is None:
                raise ConfigError(path, field, f"arm {arm.name} has no baseline arm at K={arm.k}",
                                  f"add an arm {{drafter: {spec.baseline}, k: {arm.k}}} or select K with 'k'")


def arm_lane(m: Matrix, arm: Arm) -> Lane:
    """The target lane as this arm runs it (drafter, K, the matrix's prompt sets and speed rows), every
    path absolute, validated as any Lane (arm flags get the same safe-character check)."""
    drafter = m.spec.drafters[arm.drafter]
    method = drafter.method or m.spec.method or (m.target.speculative.method if m.target.speculative else "draft-simple")
    data = m.target.model_dump()
    # An arm's own slot count is its declaration (the lane's would contradict the flag: a config error).
    slots_flags = engine_for(m.target.engine).slots_flags
    if slots_flags and (slots := flag_values(list(arm.flags), slots_flags)):
        data["slots"] = int(slots[-1]) if slots[-1].isdigit() else data["slots"]
    data.update(
        drafter=FileRef(path=str(resolve(m.base_dir, drafter.path)), bytes=drafter.bytes, sha256=drafter.sha256,
                        revision=drafter.revision).model_dump() if drafter.path is not None else None,
        speculative=Speculative(method=method, k=arm.k).model_dump(),
        flags=[*m.target.flags, *arm.flags],
        correctness=data.get("correctness") if m.spec.correctness else None,
        bench=BenchPlan(
            repeats=m.spec.repeats,
            decode=DecodePlan(**m.spec.speed.model_dump(exclude={"prompt_set"}), prompts=str(m.prompt_sets[m.speed_set])),
            acceptance=AcceptancePlan(classes={c: str(p) for c, p in m.prompt_sets.items()},
                                      max_tokens=m.spec.max_tokens, prompts_per_class=m.spec.prompts_per_class),
        ).model_dump(),
    )
    return Lane.model_validate(data, context={"engine_for": engine_for})


def load_matrix(path: str | Path) -> Matrix:
    """Read and check a matrix file and everything it names; any problem is one ConfigError."""
    path = Path(path).resolve()
    spec = load_model(path, MatrixFile, missing_fix="pass an existing matrix file, e.g. matrix/rehearsal.yaml",
                      keys="'target', 'drafters', 'arms', 'prompt_sets' and 'bars'", example="matrix/rehearsal.yaml",
                      fixes=_FIXES)
    name = spec.name or path.stem
    if not _NAME.fullmatch(name):
        raise ConfigError(path, "name", f"{name!r} is not a valid matrix name", "letters, digits, '_', '.', '-' (at most 63)")
    inv_path = resolve(path.parent, spec.inventory) if spec.inventory else DEFAULT_INVENTORY
    inventory = load_inventory(inv_path, engine_for)
    if spec.target not in inventory.lanes:
        raise ConfigError(path, "target", f"no lane {spec.target!r} in {inv_path}", f"use one of: {', '.join(inventory.lanes)}")
    target = inventory.lanes[spec.target]
    target = target.model_copy(update={"model": target.model.model_copy(
        update={"path": str(resolve(inv_path.parent, target.model.path))})})
    unmethodical = [n for n, d in spec.drafters.items() if d.method is None]
    if spec.method is None and target.speculative is None and unmethodical:
        raise ConfigError(path, "method", f"target lane {spec.target} declares no speculative method for drafter "
                          f"{unmethodical[0]!r}", "add 'method:' (e.g. draft-simple for llama.cpp), or a method per drafter")
    _known(path, "baseline", "drafter", spec.baseline, "drafters", spec.drafters)
    arms = _arms(spec, path)
    if not any(a.baseline for a in arms):
        raise ConfigError(path, "baseline", f"drafter {spec.baseline!r} has no arm", "add an arm for the baseline drafter")
    for c in spec.prompt_sets:
        if not _NAME.fullmatch(c):
            raise ConfigError(path, f"prompt_sets.{c}", f"class name {c!r} is not a valid name", "letters, digits, '_', '.', '-'")
    sets = {c: resolve(path.parent, p) for c, p in spec.prompt_sets.items()}
    seen: dict[tuple[str, str], str] = {}
    counts = {}
    for c, p in sets.items():
        keys = _count_prompts(p, f"prompt_sets.{c}", path)
        if len(keys) < spec.prompts_per_class:
            raise ConfigError(path, f"prompt_sets.{c}", f"{p} has {len(keys)} prompts, prompts_per_class asks for {spec.prompts_per_class}",
                              "lower prompts_per_class or add prompts")
        for key in keys[: spec.prompts_per_class]:
            if key in seen and seen[key] != c:
                raise ConfigError(path, f"prompt_sets.{c}",
                                  f"holds prompt {key[1]!r} (class {key[0]}) that prompt set {seen[key]} holds too",
                                  "give every prompt set its own prompts (ids or class fields must differ)")
            seen[key] = c
        counts[c] = len(keys)
    speed_set = spec.speed.prompt_set or next(iter(spec.prompt_sets))
    _known(path, "speed.prompt_set", "prompt set", speed_set, "prompt_sets", sets)
    _check_bars(spec, arms, path, list(spec.speed.concurrency))
    m = Matrix(path=path, spec=spec, name=name, inventory_path=inv_path, target=target, host_name=target.host,
               host=inventory.hosts[target.host], arms=arms, prompt_sets=sets, prompt_counts=counts,
               speed_set=speed_set, bars=tuple(spec.bars))
    for i, a in enumerate(spec.arms):
        arm = next(x for x in arms if x.drafter == a.drafter and x.flags == tuple(a.flags))
        try:
            arm_lane(m, arm)
        except ValidationError as e:
            raise config_error(path, e, under=f"arms[{i}]") from None
    return m


def prompt_class_of(m: Matrix) -> dict[tuple[str, str], str]:
    """(class field, prompt id) of each probed prompt -> its prompt set (a held-out kit may reuse a class word)."""
    return {key: c for c, p in m.prompt_sets.items()
            for key in _count_prompts(p, f"prompt_sets.{c}", m.path)[: m.spec.prompts_per_class]}


def _listening(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def arm_port(address: str, port: int, span: int = 16) -> tuple[int, str]:
    """The lane's port, or the next free one above (recorded) when only TIME_WAIT connections hold it: a stopped
    llama-server leaves them for 60 s, the server binds over them (cpp-httplib sets SO_REUSEPORT), preflight's plain
    bind() does not. A port someone listens on is left to preflight, which skips the arm."""
    from tasks.stages.preflight import port_free

    if port_free(address, port) or _listening(address, port):
        return port, ""
    for p in range(port + 1, min(port + span, 65535) + 1):
        if port_free(address, p) and not _listening(address, p):
            return p, f"port {port} was held only by TIME_WAIT connections of an earlier server; this arm ran on {p}"
    return port, ""
