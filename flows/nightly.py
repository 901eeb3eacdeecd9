"""The nightly flow: every lane in the inventory (or the named ones), then the morning question:
did anything get worse, and can I trust that it did?

Each lane runs as its own subflow while holding its hosts' global concurrency limit
(`gpu:<host>`, tasks/hosts/lock.py), so a matrix or a second nightly aimed at the same box waits
instead of measuring on top of it; lanes on different hosts run at the same time
(flows/lanes.py). One lane's skip or failure never stops the others. Each
lane that passed is then compared, metric by metric, with a baseline window of earlier good
nightlies of the same lane (tasks/record/regression.py); a regression fails the night like a failed
gate does, and the on-failure hook posts a notification (tasks/record/notify.py). The run folder is
written as the run goes and finished with plots and the report, whatever happened.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from flows.lanes import LaneJob, run_lanes
from tasks.record.run_folder import RunFolder
from tasks.inventory.load import load_inventory
from tasks.record.expectations import warm_up
from tasks.record.notify import on_failure
from tasks.record.interrupted import interrupts, raise_if_stopped, reclaim_dead_runs, record_stop, refresh_marked
from tasks.record.progress import progress, say
from tasks.record.regression import LaneComparison, RegressionPolicy, describe
from tasks.record import plots
from tasks.report.report import embed_images, render
from tasks.record.verdict import STATE_NAMES, night_verdict

TREND_RUNS = 30  # runs shown in a trend plot
# Every suite a nightly checks, loaded with matplotlib before the first request (warm()).
WARM_KINDS = ["requests", "capacity", "warmup", "decode", "queueing", "prefill", "acceptance", "tools", "needles",
              "accuracy", "regression"]
POLICY_ENV = "LANEBENCH_REGRESSION"  # JSON of RegressionPolicy fields, for runs started from the CLI


def warm() -> None:
    """GX's suites and matplotlib load in a background thread: the CLI starts it while Prefect's
    API server boots (its core is idle then), so neither competes with a measured request."""
    warm_up(WARM_KINDS, and_then=plots.warm)


def _artifact_key(*parts: str) -> str:
    return "-".join(parts).lower().replace("_", "-").replace(".", "-").replace("@", "-")


def _publish(run: RunFolder, report: str) -> None:
    """The same tables as Prefect artifacts, and the report with its plots inlined, for the UI."""
    import pandas as pd

    from tasks.record.kinds import published_kinds

    published = published_kinds()
    for entry in run.manifest.artifacts:
        if entry.kind in published and entry.validation == "passed":
            df = pd.read_parquet(run.path / entry.path)
            if "per_position" in df:
                df["per_position"] = [" ".join(f"{p:.3f}" for p in pp) for pp in df.per_position]
            create_table_artifact(key=_artifact_key(entry.lane, entry.kind),
                                  table=df.round(4).astype(object).where(df.notna(), None).to_dict(orient="records"),
                                  description=f"{entry.kind} for lane {entry.lane}")
    create_markdown_artifact(key="nightly-report", markdown=embed_images(report, run.path), description=run.path.name)


def _history(con: Any, lane: str, metrics: list[str]) -> dict[str, Any]:
    """Each metric's last TREND_RUNS passed nightly values, oldest first (one query for all)."""
    df = con.execute("""SELECT metric, run, started_at, value, regressed FROM (
                            SELECT *, row_number() OVER (PARTITION BY metric ORDER BY started_at DESC) AS newest
                            FROM metrics WHERE flow = 'nightly' AND lane = ? AND passed
                            AND list_contains(?, metric))
                        WHERE newest <= ? ORDER BY metric, started_at""", [lane, metrics, TREND_RUNS]).df()
    return {metric: part.drop(columns="metric").reset_index(drop=True) for metric, part in df.groupby("metric")}


def _plots(run: RunFolder, name: str, con: Any, comparison: LaneComparison | None) -> None:
    """Concurrency curve, per-position acceptance and the trend, registered beside the tables."""
    import pandas as pd

    tables = {a.kind: a for a in run.manifest.artifacts if a.lane == name and a.validation == "passed"}
    made = []
    if "decode" in tables:
        made.append(plots.concurrency_curve(pd.read_parquet(run.path / tables["decode"].path),
                                            run.lane_dir(name) / "concurrency.png", name))
    if "acceptance" in tables:
        made.append(plots.acceptance_positions(pd.read_parquet(run.path / tables["acceptance"].path),
                                               run.lane_dir(name) / "acceptance.png", name))
    for kind, draw in (("prefill", plots.prefill_ladder), ("accuracy", plots.accuracy_bars),
                       ("capacity", plots.capacity_curve)):
        if kind in tables:
            made.append(draw(pd.read_parquet(run.path / tables[kind].path), run.lane_dir(name) / f"{kind}.png", name))
    if comparison is not None and con is not None:
        history = _history(con, name, [r.metric for r in comparison.rows])
        made.append(plots.trend(history, comparison.rows, run.path.name, run.lane_dir(name) / "trend.png", name))
    for path in made:
        if path is not None:
            run.register(name, str(path.relative_to(run.path)), "plot")


def _against_baseline(run: RunFolder, artifacts_root: str, policy: RegressionPolicy) -> dict[str, LaneComparison]:
    """Compare every passed lane with its baseline window; write each comparison (GX-validated) and the plots."""
    from tasks.record.history import open_index
    from tasks.record.regression import compare_lane

    run.save_manifest()
    passed = [n for n, r in run.manifest.lanes.items() if r.status == "passed"]
    con = open_index(artifacts_root) if passed else None
    comparisons: dict[str, LaneComparison] = {}
    for name in passed:
        progress(name, "against the baseline")
        comparison = compare_lane(con, run.path.name, name, policy)
        record = run.lane(name)
        if comparison.refused:  # a changed model, engine or plan is no regression, and no "no change" either
            record.warnings.append(comparison.refused)
            run.manifest.flow.setdefault("comparison_refused", {})[name] = comparison.refused
        if comparison.config_changes:
            record.warnings.append("lane config differs from the newest baseline run: "
                                   + "; ".join(comparison.config_changes))
        _, entry = run.write_table(name, "regression", comparison.rows)
        if entry.validation == "failed":
            record.status, record.reason = "failed", "expectations failed for regression; comparison quarantined"
        else:
            comparisons[name] = comparison
    for name in run.manifest.lanes:
        try:
            _plots(run, name, con, comparisons.get(name))
        except Exception as e:  # a plot is a view of the tables; losing it must not lose the night
            run.lane(name).warnings.append(f"plots: {type(e).__name__}: {e}")
    if con is not None:
        con.close()
    return comparisons


@flow(name="nightly", on_failure=[on_failure], on_crashed=[on_failure])
def nightly(hosts: str = "hosts.yaml", lanes: list[str] | None = None, artifacts_root: str = "artifacts",
            regression: RegressionPolicy | None = None) -> State:
    """Every lane of `hosts` (or `lanes`), then each against its baseline window; `artifacts_root`
    is a folder or a store URL (tasks/record/store.py: the run folder is published there)."""
    from tasks.record.store import in_store

    return in_store(artifacts_root, "nightly", str(flow_run.get_id()),
                    lambda root: _nightly(hosts, lanes, root, regression))


def _nightly(hosts: str, lanes: list[str] | None, artifacts_root: str, regression: RegressionPolicy | None) -> State:
    logger = get_run_logger()
    policy = regression or RegressionPolicy.model_validate_json(os.environ.get(POLICY_ENV) or "{}")
    inventory_path = Path(hosts).resolve()
    inventory = load_inventory(inventory_path)
    names = lanes or list(inventory.lanes)
    warm()  # started by the CLI while the API server booted; here for a run a worker started
    run = RunFolder(Path(artifacts_root), "nightly", str(flow_run.get_id()), inventory_path)
    for line in reclaim_dead_runs(Path(artifacts_root), by=run.path.name):
        say(line)
        run.manifest.flow.setdefault("reclaimed", []).append(line)
    run.manifest.flow["regression_policy"] = policy.model_dump()
    logger.info("run folder %s", run.path)
    comparisons: dict[str, LaneComparison] = {}
    problems: list[str] = []
    stopped: BaseException | None = None
    stop_message = ""
    try:
        # Lanes on different hosts measure side by side; each host's lanes one at a time.
        run_lanes(run, [LaneJob(name=name, lane=inventory.lanes[name], host=inventory.hosts[inventory.lanes[name].host],
                                base_dir=str(inventory_path.parent), inventory=inventory) for name in names])
        raise_if_stopped()
    except interrupts() as e:
        stopped = e
        stop_message = record_stop(run, "nightly", e, names)
        raise
    finally:
        try:
            comparisons = _against_baseline(run, artifacts_root, policy)
        except Exception as e:  # a night that cannot be judged must not pass as a good one
            logger.exception("regression check failed")
            problems.append(f"regression check could not run: {type(e).__name__}: {e}")
            run.manifest.flow["regression_error"] = problems[-1]
        run.finish()
        refresh_marked(Path(artifacts_root), by=run.path.name)
        if stopped is not None:  # stop within seconds: the tables and manifest are the record
            return Failed(name="Interrupted", message=stop_message)
        try:
            report = render(run)
        except Exception as e:  # the tables and the manifest are the record; a report bug must not hide them
            logger.exception("report could not be rendered")
            problems.append(f"report.md could not be rendered: {type(e).__name__}: {e}")
            report = f"# lanebench nightly run `{run.path.name}`\n\n{problems[-1]}\n"
        (run.path / "report.md").write_text(report)
        run.register("", "report.md", "report")
        _publish(run, report)
    problems += [f"regression {describe(r)}" for c in comparisons.values() for r in c.regressions]
    problems += [f"comparison refused: {c.refused}" for c in comparisons.values() if c.refused]
    verdict = night_verdict("nightly", run.manifest.lanes, problems)
    run.manifest.flow["verdict"] = {"outcome": verdict.outcome, "exit_code": verdict.exit_code, "line": verdict.line}
    run.save_manifest()
    if verdict.outcome == "failed":
        return Failed(message=verdict.line)
    # Passed, but not silently: each flag names declared value, effective value and fix (safety.py).
    flagged = [f"{n}: {f['message']}" for n, r in run.manifest.lanes.items() for f in r.flags]
    line = verdict.line + ("; FLAGGED: " + " | ".join(flagged) if flagged else "")
    return Completed(name=STATE_NAMES[verdict.outcome], message=line)
