"""One run's lifecycle, the same for every flow (nightly, tools, matrix, KL):

    [store: mirror synced] -> run folder created [-> dead runs reclaimed]
        -> the flow's own body (lanes, arms, candidates)
        -> settle (what the records need on every path: the nightly's comparison against baselines)
        -> finish the folder -> report (report.md, tables, Prefect artifacts) -> verdict
                                                                          [-> store: published]

How a run ends decides what is written, here only:
- the body returned: settle, finish, report, verdict (the flow run's final state);
- Ctrl-C or SIGTERM: folder and lanes marked interrupted; settle and finish, no report and no
  verdict (a stopped run ends within seconds); state `Interrupted`, exit 130;
- any other exception: settle, finish and report (a crashed run keeps its report), no verdict,
  then raised again so Prefect fails the run (and notifies).
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
    """`body` on a local artifacts root: a store URL's mirror, published afterwards whatever the outcome."""
    from tasks.record.store import in_store

    return in_store(artifacts_root, kind, str(flow_run.get_id()), body)


R = TypeVar("R")


@dataclass
class Lifecycle:
    """The run folder for the body of the `with` block; `state` once the block has ended."""

    run: RunFolder
    state: State = field(default_factory=lambda: Failed(message="the run did not end"))


@dataclass
class Closing(Generic[R]):
    """How a flow closes its run: `report(run)` (also after a crash) returns what `verdict(run,
    reported)` judges into the final state; `settle(run)` runs on every path before the folder is finished."""

    report: Callable[[RunFolder], R]
    verdict: Callable[[RunFolder, R], State]
    settle: Callable[[RunFolder], None] = lambda run: None
    # The KL gate's report also sets its candidates' end states: the folder is finished after it,
    # so a run killed while it reports is left unfinished (and reclaimed), not finished half-judged.
    finish_after_report: bool = False


def open_run(kind: str, artifacts_root: str, source: Path, reclaim: bool = False) -> RunFolder:
    """A new run folder of flow `kind` under `artifacts_root`; `reclaim`: mark dead runs there first."""
    # Nothing secret to Prefect from here on, in a worker too: a failed boot quotes the server's log.
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
    """The `with` block measures into `run`; its end closes it. `lanes`: every lane the run means
    to serve, so a stop records those never started."""
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
    """The verdict from the lanes' end states and `problems` beyond them, kept in the manifest;
    `flagged`: a pass names every flag."""
    verdict = night_verdict(kind, run.manifest.lanes, problems)
    run.manifest.flow.verdict = verdict.recorded()
    run.save_manifest()
    if verdict.outcome == "failed":
        return Failed(message=verdict.line)
    flags = [f"{n}: {f.message}" for n, r in run.manifest.lanes.items() for f in r.flags] if flagged else []
    line = verdict.line + ("; FLAGGED: " + " | ".join(flags) if flags else "")
    return Completed(name=STATE_NAMES[verdict.outcome], message=line)
