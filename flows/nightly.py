"""The nightly flow: every lane in the inventory (or the named ones), then the morning question:
did anything get worse, and can I trust that it did?

Lanes run under their hosts' locks (flows/lanes.py); one lane's skip or failure never stops the
others. Each lane that passed is compared metric by metric with a baseline window of earlier good
nightlies (tasks/record/regression.py); a regression fails the night like a failed gate does.

`tools` (`lanebench tools`) is the tool gate alone, on freshly booted lanes: the only way to run
the held-out suite, so a held-out score is never looked at by accident (each run is counted in
the manifest).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import State

from flows.lane import NIGHTLY, TOOLS
from flows.lanes import LaneJob, run_lanes
from flows.lifecycle import (NOTIFY, Closing, in_artifacts, lanes_verdict, open_run, run_lifecycle, table_artifact,
                             write_report)
from tasks.correctness import record as correctness
from tasks.engines import engine_for
from tasks.inventory.load import load_inventory
from tasks.record.run_folder import RunFolder
from tasks.record.expectations import warm_up
from tasks.record.progress import progress
from tasks.record.regression import LaneComparison, RegressionPolicy, describe
from tasks.record import plots
from tasks.report.report import embed_images, render

TREND_RUNS = 30  # runs shown in a trend plot
# Every suite a nightly checks, loaded with matplotlib before the first request (warm()).
WARM_KINDS = ["requests", "capacity", "warmup", "decode", "queueing", "prefill", "acceptance", "tools", "needles",
              "accuracy", "regression"]
POLICY_ENV = "LANEBENCH_REGRESSION"  # JSON of RegressionPolicy fields, for runs started from the CLI


def warm() -> None:
    """GX's suites and matplotlib load in a background thread, started while Prefect's API server boots."""
    warm_up(WARM_KINDS, and_then=plots.warm)


def _publish(run: RunFolder, report: str) -> None:
    """The same tables as Prefect artifacts, and the report with its plots inlined, for the UI."""
    import pandas as pd

    from tasks.record.kinds import published_kinds

    published = published_kinds()
    for entry in run.manifest.artifacts:
        if entry.kind in published and entry.validation == "passed":  # a key of lowercase letters, digits and dashes
            table_artifact(re.sub(r"[_.@]", "-", f"{entry.lane}-{entry.kind}".lower()),
                           pd.read_parquet(run.path / entry.path), f"{entry.kind} for lane {entry.lane}")
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
    made: list[Path | None] = []
    for kind, draw, file in (("decode", plots.concurrency_curve, "concurrency"),
                             ("acceptance", plots.acceptance_positions, "acceptance"),
                             ("prefill", plots.prefill_ladder, "prefill"), ("accuracy", plots.accuracy_bars, "accuracy"),
                             ("capacity", plots.capacity_curve, "capacity")):
        if kind in tables:
            made.append(draw(pd.read_parquet(run.path / tables[kind].path), run.lane_dir(name) / f"{file}.png", name))
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
            with run.edit() as m:
                m.flow.comparison_refused[name] = comparison.refused
        if comparison.config_changes:
            record.warnings.append("lane config differs from the newest baseline run: "
                                   + "; ".join(comparison.config_changes))
        record.flags += comparison.suspect_flags()
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


@flow(name="nightly", **NOTIFY)
def nightly(hosts: str = "hosts.yaml", lanes: list[str] | None = None, artifacts_root: str = "artifacts",
            regression: RegressionPolicy | None = None) -> State:
    """Every lane of `hosts` (or `lanes`), then each against its baseline window; `artifacts_root`
    is a folder or a store URL (tasks/record/store.py)."""
    return in_artifacts("nightly", artifacts_root, lambda root: _nightly(hosts, lanes, root, regression))


def _nightly(hosts: str, lanes: list[str] | None, artifacts_root: str, regression: RegressionPolicy | None) -> State:
    policy = regression or RegressionPolicy.model_validate_json(os.environ.get(POLICY_ENV) or "{}")
    inventory_path = Path(hosts).resolve()
    inventory = load_inventory(inventory_path, engine_for)
    names = lanes or list(inventory.lanes)
    warm()  # started by the CLI while the API server booted; here for a run a worker started
    judged = _Judged(artifacts_root, policy)
    closing = Closing(settle=judged.against_baseline, report=judged.report, verdict=judged.verdict)
    run = open_run("nightly", artifacts_root, inventory_path, reclaim=True)
    run.manifest.flow.regression_policy = policy.model_dump(mode="json")
    with run_lifecycle(run, "nightly", names, closing) as life:
        # Lanes on different hosts measure side by side; each host's lanes one at a time.
        run_lanes(run, [LaneJob.of(name, inventory, inventory_path, NIGHTLY) for name in names])
    return life.state


class _Judged:
    """The night against its baselines (on every path, a stopped night included), its report and verdict."""

    def __init__(self, artifacts_root: str, policy: RegressionPolicy) -> None:
        self.artifacts_root, self.policy = artifacts_root, policy
        self.comparisons: dict[str, LaneComparison] = {}
        self.problems: list[str] = []

    def against_baseline(self, run: RunFolder) -> None:
        try:
            self.comparisons = _against_baseline(run, self.artifacts_root, self.policy)
        except Exception as e:  # a night that cannot be judged must not pass as a good one
            get_run_logger().exception("regression check failed")
            self.problems.append(f"regression check could not run: {type(e).__name__}: {e}")
            run.manifest.flow.regression_error = self.problems[-1]

    def report(self, run: RunFolder) -> None:
        try:
            report = render(run)
        except Exception as e:  # the tables and the manifest are the record; a report bug must not hide them
            get_run_logger().exception("report could not be rendered")
            self.problems.append(f"report.md could not be rendered: {type(e).__name__}: {e}")
            report = f"# lanebench nightly run `{run.path.name}`\n\n{self.problems[-1]}\n"
        write_report(run, report)
        _publish(run, report)

    def verdict(self, run: RunFolder, _: None) -> State:
        # Passed, but not silently: each flag names declared value, effective value and fix (safety.py).
        problems = [*self.problems, *(f"regression {describe(r)}" for c in self.comparisons.values()
                                      for r in c.regressions),
                    *(f"comparison refused: {c.refused}" for c in self.comparisons.values() if c.refused)]
        return lanes_verdict(run, "nightly", problems, flagged=True)


@flow(name="tools", flow_run_name="tools", **NOTIFY)
def tools(hosts: str, lanes: list[str], artifacts_root: str = "artifacts", held_out: bool = False) -> State:
    """Each named lane booted under its host lock, its tool gate run, the report written."""
    return in_artifacts("tools", artifacts_root, lambda root: _tools(hosts, lanes, root, held_out))


def _tools(hosts: str, lanes: list[str], artifacts_root: str, held_out: bool) -> State:
    inventory_path = Path(hosts).resolve()
    inventory = load_inventory(inventory_path, engine_for)
    closing = Closing(report=_tools_report, verdict=lambda run, _: lanes_verdict(run, "tools", []))
    run = open_run("tools", artifacts_root, inventory_path)
    run.manifest.flow.held_out_requested = held_out
    stages = TOOLS.model_copy(update={"held_out": held_out})
    with run_lifecycle(run, "tools", lanes, closing) as life:
        run_lanes(run, [LaneJob.of(name, inventory, inventory_path, stages) for name in lanes])
    return life.state


def _tools_report(run: RunFolder) -> None:
    """The lanes' report, each lane's correctness section after it."""
    report = render(run)
    for name in run.manifest.lanes:
        report += "\n" + "\n".join(correctness.section(run, name)) + "\n"
    write_report(run, report)
