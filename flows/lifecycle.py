"""One run's lifecycle, the same for every flow (nightly, tools, matrix, KL):

    [store: mirror synced] -> run folder created [-> dead runs reclaimed]
        -> the flow's own body (lanes, arms, candidates)
        -> settle (what the records need on every path: the nightly's comparison against baselines)
        -> finish the folder -> report (report.md, tables, Prefect artifacts) -> verdict
                                                                          [-> store: published]

How a run ends decides what is written, and it is decided here only:
- the body returned: settle, finish, report, verdict; the verdict is the flow run's final state;
- Ctrl-C or SIGTERM (or a stop a lane's own error handling swallowed, `raise_if_stopped`): the
  folder and every running lane are marked interrupted, the lanes never started said so; settle
  and finish, no report and no verdict (a stopped run ends within seconds: the tables and the
  manifest are the record); the state is `Interrupted`, which every flow command maps to 130;
- any other exception: settle, finish and report (a crashed run keeps its report), no verdict
  (it would judge a run that did not end), then it is raised again, so Prefect fails the run
  (and the notification hook says so).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from prefect import get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from tasks.record.interrupted import interrupts, raise_if_stopped, reclaim_dead_runs, record_stop, refresh_marked
from tasks.record import prefect_redaction
from tasks.record.notify import on_failure
from tasks.record.progress import say
from tasks.record.run_folder import RunFolder
from tasks.record.verdict import STATE_NAMES, night_verdict

# Every flow's failure is heard: `@flow(..., **NOTIFY)` (tasks/record/notify.py says where it goes).
NOTIFY: dict[str, Any] = {"on_failure": [on_failure], "on_crashed": [on_failure]}


def in_artifacts(kind: str, artifacts_root: str, body: Callable[[str], State]) -> State:
    """`body` on a local artifacts root: a store URL's mirror (its earlier runs are the baselines),
    its run folder published afterwards whatever the outcome (tasks/record/store.py)."""
    from tasks.record.store import in_store

    return in_store(artifacts_root, kind, str(flow_run.get_id()), body)


def _nothing(run: RunFolder) -> None:
    return None


R = TypeVar("R")


@dataclass
class Lifecycle:
    """The run folder for the body of the `with` block; `state` once the block has ended."""

    run: RunFolder
    state: State = field(default_factory=lambda: Failed(message="the run did not end"))


@dataclass
class Closing(Generic[R]):
    """How a flow closes its run: `report(run)` writes report.md and the tables (also after a
    crash) and returns what `verdict(run, reported)` judges into the final state; `settle(run)`
    runs on every path before the folder is finished."""

    report: Callable[[RunFolder], R]
    verdict: Callable[[RunFolder, R], State]
    settle: Callable[[RunFolder], None] = _nothing
    # The KL gate's report also sets its candidates' end states: the folder is finished after it,
    # so a run killed while it reports is left unfinished (and reclaimed), not finished half-judged.
    finish_after_report: bool = False


def open_run(kind: str, artifacts_root: str, source: Path, reclaim: bool = False) -> RunFolder:
    """A new run folder of flow `kind` under `artifacts_root`, its config file `source`;
    `reclaim`: mark dead runs under the same root first (tasks/record/interrupted.py)."""
    # Every process that runs a flow (the CLI, a deployment's worker) hands Prefect nothing secret
    # from here on: a failed boot's exception quotes the server's log, which may echo a flag.
    prefect_redaction.install()
    run = RunFolder(Path(artifacts_root), kind, str(flow_run.get_id()), source)
    get_run_logger().info("run folder %s", run.path)
    if reclaim:
        for line in reclaim_dead_runs(Path(artifacts_root), by=run.path.name):
            say(line)
            run.manifest.flow.reclaimed.append(line)
    return run


@contextmanager
def run_lifecycle(run: RunFolder, kind: str, lanes: Sequence[str], closing: Closing[Any]) -> Iterator[Lifecycle]:
    """The body of the `with` block measures into `run`; the block's end closes it the same way
    for every flow. `lanes`: every lane (arm, candidate) the run means to serve, so a stop
    records those never started."""
    life = Lifecycle(run)
    try:
        yield life
        raise_if_stopped()
    except interrupts() as e:
        stopped = record_stop(run, kind, e, list(lanes))
        _end(run, closing, stopped=True)
        life.state = Failed(name="Interrupted", message=stopped)
        return
    except BaseException:
        _end(run, closing)
        raise
    life.state = closing.verdict(run, _end(run, closing))


def _end(run: RunFolder, closing: Closing[R], stopped: bool = False) -> R | None:
    """Settle, finish and (unless stopped) report; returns what the report gives the verdict."""
    closing.settle(run)
    if stopped or not closing.finish_after_report:
        run.finish()
    reported = None if stopped else closing.report(run)
    if not stopped and closing.finish_after_report:
        run.finish()
    if run.manifest.flow.reclaimed:  # the dead runs' servers wrote on until this run stopped them
        refresh_marked(run.path.parent, by=run.path.name)
    return reported


def table_artifact(key: str, df: Any, description: str) -> None:
    """A table (a DataFrame) as a Prefect artifact for the UI: rounded, missing values empty."""
    from prefect.artifacts import create_table_artifact

    if "per_position" in df:
        df["per_position"] = [" ".join(f"{p:.3f}" for p in (pp if pp is not None else [])) for pp in df.per_position]
    create_table_artifact(key=key, table=df.round(4).astype(object).where(df.notna(), None).to_dict(orient="records"),
                          description=description)


def write_report(run: RunFolder, report: str) -> None:
    (run.path / "report.md").write_text(report)
    run.register("", "report.md", "report")


def lanes_verdict(run: RunFolder, kind: str, problems: list[str], flagged: bool = False) -> State:
    """The verdict from the lanes' end states and `problems` beyond them (tasks/record/verdict.py),
    kept in the manifest; `flagged`: a pass names every flag (declared value, effective value, fix)."""
    verdict = night_verdict(kind, run.manifest.lanes, problems)
    run.manifest.flow.verdict = verdict.recorded()
    run.save_manifest()
    if verdict.outcome == "failed":
        return Failed(message=verdict.line)
    flags = [f"{n}: {f['message']}" for n, r in run.manifest.lanes.items() for f in r.flags] if flagged else []
    line = verdict.line + ("; FLAGGED: " + " | ".join(flags) if flags else "")
    return Completed(name=STATE_NAMES[verdict.outcome], message=line)
