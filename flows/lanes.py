"""Running many lanes: each under its hosts' lock, lanes on different hosts at the same time.

Every flow that measures lanes hands them here. Per-host queues run concurrently as Prefect
tasks; inside a queue lanes run one at a time, each holding the global concurrency limit
`gpu:<host>` of every host it touches (`every_host`) from preflight to teardown
(tasks/hosts/lock.py). Whatever happens inside a lane, it ends with a status and a reason.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from flows.lane import NIGHTLY, StagePlan, lane_flow
from tasks.hosts.lock import Hold, host_lock
from tasks.inventory import secrets
from tasks.record.interrupted import interrupts, mark_lanes, raise_if_stopped, signal_name, stop_requested
from tasks.inventory.lane_hosts import every_host
from tasks.inventory.models import Host, Inventory, Lane
from tasks.record.progress import progress
from tasks.record.run_folder import RunFolder


class LaneJob(BaseModel):
    """One lane to serve and measure: what the lane flow needs, in values Prefect can show."""

    name: str
    lane: Lane
    host: Host
    base_dir: str
    stages: StagePlan = NIGHTLY
    inventory: Inventory | None = None

    @classmethod
    def of(cls, name: str, inventory: Inventory, inventory_path: Path, stages: StagePlan) -> LaneJob:
        """Lane `name` of an inventory file, its paths resolved against the file's folder."""
        lane = inventory.lanes[name]
        return cls(name=name, lane=lane, host=inventory.hosts[lane.host], base_dir=str(inventory_path.parent),
                   stages=stages, inventory=inventory)


def run_lane(run_dir: str, job: LaneJob, before: Callable[[LaneJob], LaneJob] | None = None) -> str:
    """One lane under its hosts' lock; returns its final state's message. `before` runs once the
    lock is held and may adjust the job (the matrix picks its arm's port: only then does a free port stay free)."""
    run = RunFolder.opened(run_dir)
    record = run.lane(job.name)
    hold: Hold | None = None
    message = "did not finish"
    stopped: BaseException | None = None
    try:
        with host_lock(every_host(job.lane), on_wait=lambda m: progress(job.name, m)) as hold:
            record.started_at = datetime.now(UTC).isoformat()
            if before is not None:
                job = before(job)
            # Parameters Prefect stores: secret values redacted (the lane flow takes the real ones back).
            state = lane_flow(job.name, secrets.keep(job.name, job.lane), job.host, Path(job.base_dir), run_dir,
                              stages=job.stages,
                              inventory=secrets.keep_inventory(job.inventory) if job.inventory else None,
                              return_state=True)
            message = str(state.message)
    except interrupts() as e:
        stopped = e
        raise
    except Exception as e:  # the lock itself failed (timeout, lease lost, server gone)
        message = f"host lock {', '.join(every_host(job.lane))}: {type(e).__name__}: {e}"
    finally:
        record.finished_at = datetime.now(UTC).isoformat()
        if hold is not None:
            record.host_lock = hold.model_copy()  # as acquired
        if stopped is not None or stop_requested():
            mark_lanes({job.name: record}, f"interrupted by {signal_name(stopped)}")
        elif record.status == "running":  # the lane flow died outside its own error handling
            record.status, record.reason = "failed", f"{record.stage}: {message}" if record.stage else message
        run.save_manifest(quiet=True)
        progress(job.name, f"{record.status}{': ' + record.reason if record.reason else ''}")
    return message


@task(name="host queue", task_run_name="host-queue-{host}", cache_policy=NO_CACHE)
def host_queue(run_dir: str, host: str, jobs: list[LaneJob]) -> list[str]:
    """The lanes of one host, one after another."""
    return [run_lane(run_dir, job) for job in jobs]


def run_lanes(run: RunFolder, jobs: list[LaneJob]) -> None:
    """Every job, lanes of one host in order, hosts side by side."""
    queues: dict[str, list[LaneJob]] = {}
    for job in jobs:
        queues.setdefault(job.lane.host, []).append(job)
    if len(queues) <= 1:  # one host: no thread needed, lanes in the order given
        for job in jobs:
            run_lane(str(run.path), job)
            raise_if_stopped()
        return
    futures = [host_queue.submit(str(run.path), host, queue) for host, queue in queues.items()]
    for future in futures:
        future.wait()
