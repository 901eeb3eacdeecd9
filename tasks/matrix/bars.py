"""Bars: what a drafter must meet, written down before anything is measured (the seeds set theirs
before training, "prose >= 2.6 at K=4; code within -0.2 of incoai at K=7", and published the verdict,
negative as it was). One structured line of the matrix file each:

    {metric: acceptance_length, class: prose, k: 4, op: ">=", value: 2.6}
    {metric: acceptance_length, class: code, k: 7, relative_to: baseline, within: -0.2}
    {metric: aggregate_tok_s, concurrency: 1, relative_to: baseline, op: ">="}

Bars and prompt sets are hashed (`Registration`) into the manifest before any arm boots; the verdict
judges the registered copy and refuses one that no longer matches its hash, so no bar moves once
measuring started. A rerun whose bars differ from the latest earlier run's says so, bar by bar.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tasks.record.manifest import scan_manifests

from tasks.hosts.files import file_sha256

# metric -> (words, unit, what selects the measurement)
METRICS: dict[str, tuple[str, str, str]] = {
    "acceptance_length": ("acceptance length", "", "class"),
    "position_rate": ("acceptance rate at draft position", "", "class"),
    "draft_efficiency": ("draft efficiency (accepted / drafted)", "", "class"),
    "single_stream_tok_s": ("single-stream tok/s", " tok/s", "class"),
    "aggregate_tok_s": ("aggregate tok/s", " tok/s", "concurrency"),
}
Metric = Literal["acceptance_length", "position_rate", "draft_efficiency", "single_stream_tok_s", "aggregate_tok_s"]


class Bar(BaseModel):
    """One pass bar: `measured op value`, or relative `measured op baseline + value`. `drafter` and `k`
    select the arms judged (default every arm; never the baseline's own for a relative bar).
    `within: -0.2` (the seeds' words) is `op: ">=", value: -0.2` with `relative_to: baseline`."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=80)] | None = None
    metric: Metric
    prompt_class: str | None = Field(default=None, alias="class")
    position: Annotated[int, Field(ge=1, le=64)] | None = None  # 1 = the first drafted token
    concurrency: Annotated[int, Field(ge=1, le=1024)] | None = None
    drafter: str | None = None
    k: Annotated[int, Field(ge=1, le=64)] | None = None
    op: Literal[">=", "<="] = ">="
    value: float | None = None
    relative_to: Literal["baseline"] | None = None
    within: Annotated[float, Field(le=0)] | None = None

    @model_validator(mode="after")
    def _shape(self) -> Bar:
        if METRICS[self.metric][2] == "class":
            if self.prompt_class is None:
                raise ValueError(f"metric {self.metric} is per prompt class: give 'class'")
            if self.concurrency is not None:
                raise ValueError(f"metric {self.metric} is measured one request at a time: remove 'concurrency'")
        elif self.concurrency is None:
            raise ValueError("metric aggregate_tok_s is per concurrency level: give 'concurrency'")
        elif self.prompt_class is not None:
            raise ValueError("aggregate_tok_s is measured on the speed prompt set: remove 'class'")
        if (self.metric == "position_rate") != (self.position is not None):
            raise ValueError("'position' goes with metric position_rate, and only with it")
        if self.relative_to is None:
            if self.value is None:
                raise ValueError("an absolute bar needs 'value' (or add relative_to: baseline)")
            if self.within is not None:
                raise ValueError("'within' needs relative_to: baseline")
        elif self.within is not None and (self.value is not None or "op" in self.model_fields_set):
            raise ValueError("give either 'within' or 'op'/'value', not both")
        return self

    @property
    def margin(self) -> float:
        """The bound's offset: the absolute value, or the allowance against the baseline."""
        return self.within if self.within is not None else self.value if self.value is not None else 0.0

    def canonical(self) -> dict[str, Any]:
        """The bar as registered: normalized (`within` folded into op/value), no empty fields."""
        data = self.model_dump(by_alias=True, exclude_none=True, exclude={"within", "name"})
        data["op"] = ">=" if self.within is not None else self.op
        data["value"] = self.margin
        if self.name:
            data["name"] = self.name
        return data

    def words(self, baseline: str | None = None) -> str:
        """The bar in the field's words, e.g. `prose acceptance length at K=4 >= 2.6`."""
        what, unit, _ = METRICS[self.metric]
        if self.metric == "position_rate":
            what = f"{what} {self.position}"
        subject = f"{self.prompt_class} {what}" if self.prompt_class else what
        where = [f"C={self.concurrency}"] if self.concurrency is not None else []
        where += [f"K={self.k}"] if self.k is not None else []
        head = f"{self.drafter + ': ' if self.drafter else ''}{subject}{' at ' + ' and '.join(where) if where else ''}"
        if self.relative_to is None:
            return f"{head} {self.op} {self.margin:g}{unit}"
        base = f"baseline ({baseline})" if baseline else "baseline"
        if self.within is not None:
            return f"{head} within {self.within:g} of {base}"
        offset = f" {'+' if self.margin >= 0 else '-'} {abs(self.margin):g}" if self.margin else ""
        return f"{head} {self.op} {base}{offset}"

    def label(self, index: int, baseline: str | None = None) -> str:
        return self.name or f"bar {index + 1}: {self.words(baseline)}"


def _sha(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class PromptSetFacts(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    sha256: str  # of the file's bytes
    prompts: int  # prompts in the file (the probe uses the first `prompts_per_class`)


class Registration(BaseModel):
    """The bars and prompt sets as they stood before the first arm booted (frozen)."""

    model_config = ConfigDict(frozen=True)

    matrix: str
    matrix_file: str
    registered_at: str
    baseline: str
    bars: tuple[dict[str, Any], ...]  # canonical bars, in file order
    bars_text: tuple[str, ...]
    prompt_sets: dict[str, PromptSetFacts]
    prompts_per_class: int
    bars_sha256: str
    prompt_sets_sha256: str
    sha256: str  # of both: the one hash the manifest carries

    def parsed_bars(self) -> tuple[Bar, ...]:
        return tuple(Bar.model_validate(b) for b in self.bars)

    def recomputed(self) -> tuple[str, str]:
        """(bars hash, prompt sets hash) recomputed from this copy's own content."""
        return _hashes(self.baseline, self.bars, self.prompts_per_class, self.prompt_sets)


def _hashes(baseline: str, bars: tuple[dict[str, Any], ...], per_class: int, sets: dict[str, PromptSetFacts]) -> tuple[str, str]:
    return (_sha({"baseline": baseline, "bars": list(bars)}),
            _sha({"prompts_per_class": per_class, "sets": {c: f.sha256 for c, f in sets.items()}}))


def register(name: str, matrix_file: Path, bars: tuple[Bar, ...], baseline: str, prompt_sets: dict[str, Path],
             prompt_counts: dict[str, int], prompts_per_class: int) -> Registration:
    """Hash the bars and the prompt sets' bytes: the registration written before any arm boots."""
    canonical = tuple(b.canonical() for b in bars)
    sets = {c: PromptSetFacts(path=str(p), sha256=file_sha256(p), prompts=prompt_counts[c])
            for c, p in prompt_sets.items()}
    bars_sha, sets_sha = _hashes(baseline, canonical, prompts_per_class, sets)
    return Registration(
        matrix=name, matrix_file=str(matrix_file), registered_at=datetime.now(UTC).isoformat(), baseline=baseline,
        bars=canonical, bars_text=tuple(b.words(baseline) for b in bars), prompt_sets=sets,
        prompts_per_class=prompts_per_class, bars_sha256=bars_sha, prompt_sets_sha256=sets_sha,
        sha256=hashlib.sha256(f"{bars_sha}:{sets_sha}".encode()).hexdigest(),
    )


class EarlierRun(BaseModel):
    """How this run's registration compares with the latest earlier run of the same matrix name."""

    run: str  # the earlier run folder's name
    matrix: str = ""  # its matrix name (another name, same target and drafter bytes, is still history)
    started_at: str
    bars_sha256: str
    same_bars: bool
    same_prompt_sets: bool
    removed: list[str] = []  # bars (in words) the earlier run had and this one does not
    added: list[str] = []
    prompt_set_changes: list[str] = []
    # The bars' subject under the same label, other bytes (`drafter good: sha256 aaaa -> bbbb`):
    # a drafter re-made under its old name was once reported "same as the earlier run".
    subject_changes: list[str] = []

    def lines(self) -> list[str]:
        out = []
        if self.subject_changes:
            out.append(f"BYTES CHANGED under the same label since the earlier run {self.run}: "
                       f"{'; '.join(self.subject_changes)}; the comparison with it is refused (its bars were "
                       "registered for other bytes); fix: give new bytes a new label, or restore the old file")
        if self.same_bars and self.same_prompt_sets:
            return out or [f"bars and prompt sets are the same as in the earlier run {self.run}"]
        if not self.same_bars:
            of = f"of matrix {self.matrix}, same target and drafter bytes" if self.matrix else "of this matrix"
            out.append(f"BARS CHANGED since the earlier run {self.run} {of} "
                       f"(registered {self.bars_sha256[:12]} there)")
            out += [f"removed: {b}" for b in self.removed] + [f"added: {b}" for b in self.added]
            if not self.removed and not self.added:
                out.append("same bars in other words or order, or a different baseline")
        if not self.same_prompt_sets:
            out.append(f"PROMPT SETS CHANGED since the earlier run {self.run}")
            out += self.prompt_set_changes
        return out


def _subject_changes(manifest: Any, drafters: dict[str, str], target: str | None) -> list[str]:
    """Labels the earlier run shares with this one whose bytes differ (target, then each drafter)."""
    cut = lambda v: f"{str(v)[:16]}..."  # noqa: E731
    facts = manifest.flow.matrix
    before_target = facts.target_sha256 or next(
        (m.sha256 for lane in manifest.lanes.values() for m in lane.models if m.role == "model"), None)
    out = [f"target: sha256 {cut(before_target)} -> {cut(target)}"] if target and before_target and \
        before_target != target else []
    before = facts.drafter_sha256
    return out + [f"drafter {d}: sha256 {cut(before[d])} -> {cut(sha)}" for d, sha in sorted(drafters.items())
                  if d in before and before[d] != sha]


def earlier_run(artifacts_root: Path, now: Registration, exclude: Path, subject: str | None = None,
                drafters: dict[str, str] | None = None, target: str | None = None) -> EarlierRun | None:
    """The latest earlier `*_matrix_*` run with bars for the same matrix name or the same target and
    drafter bytes (lower bars under a new name must not read as a "first registered run"); `drafters`
    (label -> sha256) and `target`: what this run measures, so a label whose bytes changed refuses."""
    found: list[tuple[str, Path, Registration, Any]] = []
    for folder, manifest in scan_manifests(artifacts_root, "*_matrix_*"):
        facts = manifest.flow.matrix
        if folder.resolve() == exclude.resolve() or facts is None:
            continue
        try:
            reg = Registration.model_validate(facts.registration)
        except ValidationError:  # registered by a lanebench whose bars this one cannot read
            continue
        if reg.matrix == now.matrix or (subject is not None and facts.subject == subject):
            found.append((manifest.flow.started_at, folder, reg, manifest))
    if not found:
        return None
    started, folder, reg, earlier = max(found, key=lambda f: (f[0], f[1].name))
    changes = []
    for c in sorted(set(reg.prompt_sets) | set(now.prompt_sets)):
        a, b = reg.prompt_sets.get(c), now.prompt_sets.get(c)
        if a is None:
            changes.append(f"prompt set {c} added")
        elif b is None:
            changes.append(f"prompt set {c} removed")
        elif a.sha256 != b.sha256:
            changes.append(f"prompt set {c}: file bytes differ (sha256 {a.sha256[:12]} -> {b.sha256[:12]})")
    if reg.prompts_per_class != now.prompts_per_class:
        changes.append(f"prompts per class {reg.prompts_per_class} -> {now.prompts_per_class}")
    return EarlierRun(run=folder.name, matrix=reg.matrix, started_at=started, bars_sha256=reg.bars_sha256,
                      same_bars=reg.bars_sha256 == now.bars_sha256,
                      same_prompt_sets=reg.prompt_sets_sha256 == now.prompt_sets_sha256,
                      removed=[t for t in reg.bars_text if t not in now.bars_text],
                      added=[t for t in now.bars_text if t not in reg.bars_text], prompt_set_changes=changes,
                      subject_changes=_subject_changes(earlier, drafters or {}, target))
