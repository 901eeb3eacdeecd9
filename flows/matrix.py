"""The drafter matrix flow: drafters x K x prompt class on one lane, judged against bars set before the run.

    load and check the matrix file -> register the bars (hash of bars + prompt sets, in the
    manifest before any arm boots) -> each arm in turn, booted fresh through the lane flow
    (preflight, boot, gates, warmup, decode rows, acceptance probe, expectations; teardown on
    every path) -> arm x class table, verdict table (GX) -> plots, report.md, Prefect artifacts

An arm that fails a gate (or is skipped by preflight) is recorded with its reason and the matrix
goes on; its bars read `no-data`, which never passes. The matrix is incomplete (exit 1) when an
arm failed or was skipped, a table was quarantined or the registered bars were altered; a drafter
failing its bars is a verdict (exit 0, unless `--require-bars`). Relative paths resolve against
the repository, so a deployment needs only `matrix_file`.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from flows.lanes import LaneJob, run_lane
from flows.lifecycle import NOTIFY, Closing, in_artifacts, open_run, run_lifecycle, table_artifact, write_report
from flows.lane import MATRIX_ARM
from tasks.inventory.paths import REPO, resolve
from tasks.hosts.files import model_sha256, sha256_of
from tasks.hosts.lock import limit_name
from tasks.engines import engine_for
from tasks.inventory.models import Lane
from tasks.kl.config import strip_speculation
from tasks.matrix.bars import EarlierRun, Registration, earlier_run, register
from tasks.matrix.config import Arm, Matrix, arm_lane, arm_port, load_matrix
from tasks.matrix.report import curves_png, k_png, render
from tasks.matrix.verdict import collect, contention, drafter_verdicts, judge, model_drift
from tasks.record.interrupted import raise_if_stopped
from tasks.record.manifest import ArmFacts, FileRef, MatrixSection, MatrixVerdict
from tasks.record.progress import progress
from tasks.report.report import render as render_lanes
from tasks.record.run_folder import RunFolder
MATRIX_DIR = "matrix"  # run-folder folder of the cross-arm tables and plots


def _in_repo(p: str) -> Path:
    return resolve(REPO, p)


def _run_name() -> str:
    return f"matrix-{Path(str(flow_run.parameters.get('matrix_file', 'matrix'))).stem}"


@flow(name="matrix", flow_run_name=_run_name, **NOTIFY)
def matrix(matrix_file: str, artifacts_root: str = "artifacts") -> State:
    """One run of `matrix_file` into a new run folder under `artifacts_root` (a folder or a store URL)."""
    return in_artifacts("matrix", artifacts_root, lambda root: _matrix(matrix_file, root))


def _matrix(matrix_file: str, artifacts_root: str) -> State:
    path = _in_repo(matrix_file)
    m = load_matrix(path)  # a ConfigError fails the flow with its one line
    root = _in_repo(artifacts_root)
    run = open_run("matrix", str(root), path)
    _register_bars(run, m, root)  # before anything is measured: hash, file, manifest
    closing = Closing(report=lambda run: _finish(run, m),
                      verdict=lambda _, judged: (Completed if judged[0] else Failed)(message=judged[1]))
    with run_lifecycle(run, "matrix", [*(a.name for a in m.arms), NO_SPEC], closing) as life:
        for i, arm in enumerate(m.arms, 1):
            progress("matrix", f"arm {i}/{len(m.arms)}: {arm.name} (drafter {arm.drafter} @ {arm.revision}, K={arm.k})")
            _arm(run, m, arm)
            raise_if_stopped()
        # The arm every speculation verdict needs: the same target with no drafter at all.
        _no_speculation_arm(run, m)
    return life.state


def _register_bars(run: RunFolder, m: Matrix, root: Path) -> None:
    """Bars and prompt sets hashed and written into the manifest, with the bytes they are about and any earlier run."""
    logger = get_run_logger()
    reg = register(m.name, m.path, m.bars, m.spec.baseline, m.prompt_sets, m.prompt_counts, m.spec.prompts_per_class)
    (run.path / "registration.json").write_text(reg.model_dump_json(indent=2))
    reg_entry = run.register("", "registration.json", "registration")
    # What the bars are about, by content: the target's and drafters' bytes, whatever the names.
    drafter_shas = {name: model_sha256(drafter.path) if (drafter := arm_lane(m, next(a for a in m.arms if a.drafter == name)).drafter)
                    else f"method:{m.spec.drafters[name].method}" for name in sorted({a.drafter for a in m.arms})}
    target_sha = model_sha256(m.target.model.path)
    subject = hashlib.sha256(json.dumps({"target": target_sha, "drafters": sorted(drafter_shas.values())}).encode()).hexdigest()
    earlier = earlier_run(root, reg, run.path, subject, drafter_shas, target_sha)
    same_bytes = [f"drafters {a} and {b} have identical bytes (sha256 {sa[:12]}): one drafter measured twice, "
                  "not two; fix: point one of them at its own file"
                  for i, (a, sa) in enumerate(drafter_shas.items()) for b, sb in list(drafter_shas.items())[i + 1:]
                  if sa == sb]
    for line in same_bytes:
        progress("matrix", f"FLAG: {line}")
        logger.warning(line)
    with run.edit() as manifest:
        manifest.flow.matrix = MatrixSection(
            subject=subject, target_sha256=target_sha, drafter_sha256=drafter_shas, identical_drafters=same_bytes,
            name=m.name, file=str(m.path), file_sha256=sha256_of(m.path),
            inventory=FileRef(path=str(m.inventory_path), sha256=sha256_of(m.inventory_path)),
            target=m.spec.target, registration_sha256=reg.sha256, registration_file_sha256=reg_entry.sha256,
            registration=reg.model_dump(mode="json"), earlier_run=earlier.model_dump() if earlier else None,
            host_lock=limit_name(m.host_name), arms={a.name: ArmFacts.model_validate(a.model_dump(mode="json"))
                                                     for a in m.arms})
    progress("matrix", f"{m.name}: {len(m.arms)} arms x {len(m.prompt_sets)} classes, bars registered "
                       f"(sha256 {reg.sha256[:12]})")
    for line in earlier.lines() if earlier else [f"first registered run of matrix {m.name} here"]:
        progress("matrix", line)
        if "CHANGED" in line:
            logger.warning(line)


def _arm(run: RunFolder, m: Matrix, arm: Arm) -> None:
    """One arm booted fresh through the lane flow under the host lock, its facts beside it."""
    facts = _facts(run).arms[arm.name]

    def on_port(job: LaneJob) -> LaneJob:
        port, why = arm_port(m.host.address, m.target.port)
        with run.edit():
            facts.started_at, facts.port, facts.port_note = datetime.now(UTC).isoformat(), port, why
            facts.load_at_start = round(os.getloadavg()[0], 2)
        if why:
            progress(job.name, why)
        return _on(job, port)

    job = LaneJob(name=arm.name, lane=arm_lane(m, arm), host=m.host, base_dir=str(m.inventory_path.parent),
                  stages=MATRIX_ARM)
    message = run_lane(str(run.path), job, before=on_port)
    record = run.lane(arm.name)
    with run.edit():
        facts.finished_at, facts.load_at_end = datetime.now(UTC).isoformat(), round(os.getloadavg()[0], 2)
        facts.host_lock, facts.state, facts.message = record.host_lock, record.status, message


NO_SPEC = "no-speculation"


def _no_speculation_arm(run: RunFolder, m: Matrix) -> None:
    """Boot the target without a drafter (speculation flags dropped) and measure the same speed
    rows: "speculation is slower than none" can only be said against this arm."""
    progress("matrix", f"arm {NO_SPEC}: the target without a drafter (the baseline speculation must beat)")
    data = arm_lane(m, m.arms[0]).model_dump()
    flags, _ = strip_speculation(list(m.target.flags))
    # No drafter, so no draft counter gate (a declared one would fail by construction).
    data.update(drafter=None, speculative=None, flags=flags, bench={**data["bench"], "acceptance": None},
                gates=[g for g in data["gates"] if g.get("kind") != "counter"])
    lane = Lane.model_validate(data, context={"engine_for": engine_for})
    job = LaneJob(name=NO_SPEC, lane=lane, host=m.host, base_dir=str(m.inventory_path.parent),
                  stages=MATRIX_ARM)
    run_lane(str(run.path), job, before=lambda job: _on(job, arm_port(m.host.address, m.target.port)[0]))


def _on(job: LaneJob, port: int) -> LaneJob:
    """The job with its lane on `port` (picked under the host lock: only then does a free port stay free)."""
    return job.model_copy(update={"lane": job.lane.model_copy(update={"port": port})})


def against_no_speculation(run: RunFolder, speed: list) -> list[str]:
    """One line per arm and concurrency where speculation is slower than none (or no baseline)."""
    record = run.manifest.lanes.get(NO_SPEC)
    entry = next((a for a in run.manifest.artifacts if a.lane == NO_SPEC and a.kind == "decode"
                  and a.validation == "passed"), None)
    if record is None or record.status != "passed" or entry is None:
        return [f"no verdict against no speculation: the {NO_SPEC} arm did not pass"
                f"{': ' + record.reason if record and record.reason else ''}"]
    base = {int(r.concurrency): float(r.aggregate_tok_s) for r in pd.read_parquet(run.path / entry.path).itertuples()}
    out = []
    # Only speculation may differ: another model, engine, slot count or host makes the comparison loud.
    from tasks.record.fingerprint import beyond_speculation, describe_differences

    for arm in sorted({row.arm for row in speed}):
        mine = run.manifest.lanes.get(arm)
        if mine is not None and mine.fingerprint and record.fingerprint and \
                (diffs := beyond_speculation(mine.fingerprint, record.fingerprint)):
            out.append(f"NOT COMPARABLE: {arm} differs from {NO_SPEC} beyond speculation: {describe_differences(diffs)}")
    for row in speed:
        b = base.get(row.concurrency)
        if b is not None and row.aggregate_tok_s < b:
            out.append(f"SPECULATION LOSES: {row.arm} {row.aggregate_tok_s:.1f} tok/s at C={row.concurrency} against "
                       f"{b:.1f} tok/s with no drafter ({100 * (row.aggregate_tok_s / b - 1):+.0f}%)")
    return out


def _registered_copy(run: RunFolder) -> tuple[Registration, str]:
    """The registration as written before the first boot, checked against the hashes in the manifest."""
    facts = _facts(run)
    path = run.path / "registration.json"
    reg = Registration.model_validate_json(path.read_text())
    problems = []
    if sha256_of(path) != facts.registration_file_sha256:
        problems.append("registration.json changed after it was registered")
    if reg.sha256 != facts.registration_sha256 or reg.recomputed() != (reg.bars_sha256, reg.prompt_sets_sha256):
        problems.append("the registered bars no longer match their hash")
    return reg, "; ".join(problems)


def _finish(run: RunFolder, m: Matrix) -> tuple[bool, str]:
    """Tables (GX), plots, report and Prefect artifacts from whatever the arms left; (complete, message)."""
    facts = _facts(run)
    reg, altered = _registered_copy(run)
    if sha256_of(m.path) != facts.file_sha256:
        facts.file_changed_during_run = f"sha256 now {sha256_of(m.path)[:12]}, registered {facts.file_sha256[:12]}"
    rows, speed, warnings = collect(run, m)
    facts.against_no_speculation = losing = against_no_speculation(run, speed)
    drift = model_drift(run, m)
    warnings[:0] = [*drift, *contention(run, m), *losing, *(f"FLAG: {line}" for line in facts.identical_drafters)]
    for c, f in reg.prompt_sets.items():
        if sha256_of(f.path) != f.sha256:
            warnings.append(f"prompt set {c} ({f.path}) changed during the run: later arms may have probed other prompts")
    verdict = [] if altered else judge(reg, m, rows, speed)
    drafters = drafter_verdicts(m, verdict)
    run.lane_dir(MATRIX_DIR)
    tables = [("matrix_arms", rows)] + ([("matrix_verdict", verdict)] if verdict else [])
    quarantined = [entry.path for kind, table in tables
                   if (entry := run.write_table(MATRIX_DIR, kind, table)[1]).validation == "failed"]
    plots = {}
    for title, name, draw in (("Per-position acceptance per class", "per_position.png", lambda p: curves_png(m, rows, p)),
                              ("Acceptance, draft efficiency and tok/s against K", "k_sweep.png",
                               lambda p: k_png(m, rows, speed, p))):
        rel = f"{MATRIX_DIR}/{name}"
        if draw(run.path / rel):
            run.register(MATRIX_DIR, rel, "plot")
            plots[title] = rel
    incomplete = [a.name for a in m.arms if run.lane(a.name).status != "passed"]
    complete = not incomplete and not quarantined and not altered and not drift
    facts.verdict = MatrixVerdict(
        complete=complete, incomplete_arms=incomplete, quarantined=quarantined, registration_altered=altered,
        model_drift=drift,
        drafters={d.drafter: {"verdict": d.verdict, **d.model_dump(exclude={"drafter"})} for d in drafters},
        bars_failed=sum(v.outcome == "fail" for v in verdict), bars_passed=sum(v.outcome == "pass" for v in verdict),
        bars_no_data=sum(v.outcome == "no-data" for v in verdict))
    run.save_manifest()
    if altered:
        warnings.insert(0, f"NO VERDICT: {altered}")
    earlier = EarlierRun.model_validate(facts.earlier_run) if facts.earlier_run else None
    report = render(run.path.name, run.manifest, m, reg, earlier, rows, speed, verdict, drafters, plots, warnings,
                    quarantined, render_lanes(run))
    write_report(run, report)
    _publish(rows, verdict, report, run.path.name)
    summary = "; ".join(f"{d.drafter} {d.verdict} ({d.failed}/{d.checks} failed)" for d in drafters if d.checks)
    if complete:
        return True, f"verdict: {summary}"
    why = [*([f"arms not passed: {', '.join(incomplete)}"] if incomplete else []),
           *([f"quarantined: {', '.join(quarantined)}"] if quarantined else []), *([altered] if altered else []), *drift]
    return False, f"incomplete matrix ({'; '.join(why)}); verdict so far: {summary}"


def _facts(run: RunFolder) -> MatrixSection:
    assert run.manifest.flow.matrix is not None
    return run.manifest.flow.matrix


def _publish(rows: list, verdict: list, report: str, run_name: str) -> None:
    """The verdict and arm tables and the report as Prefect artifacts, for the UI."""
    if verdict:
        table_artifact("matrix-verdict", pd.DataFrame([v.model_dump() for v in verdict]).drop(columns=["bars_sha256"]),
                       f"bars x arms ({run_name})")
    table_artifact("matrix-arms", pd.DataFrame([r.model_dump() for r in rows]), f"arm x prompt class ({run_name})")
    create_markdown_artifact(key="matrix-report", markdown=report, description=run_name)
