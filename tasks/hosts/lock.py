"""One job per GPU host: a Prefect global concurrency limit `gpu:<host>` of one slot, held strict.

Two lanes on one GPU box measure each other: both boot, both fight for memory and compute, and
both report numbers that belong to neither. So every lane holds its host's limit from before
preflight (the port check, the boot) to after teardown, and a second flow aimed at the same host
waits in line.

Why `strict=True`: in Prefect 3.9 `concurrency()` on a limit that does not exist silently does
nothing, which would turn this lock into a no-op after a fresh server install. The limit is
created here on first use, so no setup step is needed, and strict makes a missing one an error
rather than a silent pass. Strict also means a lost lease (the server unreachable for longer than
the lease) stops the lane instead of letting it run on unguarded.

A holder that dies without letting go (SIGKILL, power) leaves its slot taken. A full Prefect
server's repossessor service frees it once the lease expires; the ephemeral server runs no such
service, and Prefect 3.9 keeps leases in the server's memory by default, so the slot would stay
taken forever in PREFECT_HOME's database and every later nightly would wait for nothing. Hence:
leases are kept on disk (`PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE`, defaulted below before any
server starts), and a waiting lane hands back, through Prefect's own release-with-lease call,
the slots of leases on this host's PREFECT_HOME that expired: what the repossessor would do.

A holder that died on this host is not waited for at all: each lease names its holder (the
flow run), and the holder's process (host, boot id, pid and start time) is written beside the
lease files; a waiting lane whose holder's process is gone releases that lease at once, with a
line saying so (`reclaim_expired`).

An operator may raise a host's limit (a box whose GPUs run independent lanes); an existing limit
is respected as it is, never reset.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel

from tasks.hosts.owner import Owner
from tasks.hosts.lock_storage import FILE_LEASES, LEASE_STORAGE_ENV  # noqa: F401  (sets it on import)

POLL_S = 20.0  # how often a waiting lane looks for expired leases


def lease_seconds() -> float:
    """Lease length: renewed in the background while held; a dead holder's slot frees after it (min 60 s)."""
    return max(60.0, float(os.environ.get("LANEBENCH_HOST_LEASE_S", "300")))


class Hold(BaseModel):
    """When a lane asked for its host, got it and let it go (ISO times, UTC)."""

    limit: str
    requested_at: str
    acquired_at: str | None = None
    released_at: str | None = None
    waited_s: float | None = None
    reclaimed: int = 0  # expired leases of dead holders handed back while waiting


def _register_holder():
    """The lease holder (this flow run, or a fresh id outside one), its process written beside the leases."""
    from uuid import UUID, uuid4

    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.runtime import flow_run

    run_id = flow_run.get_id() or str(uuid4())
    folder = _holders()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{run_id}.json").write_text(Owner.here().model_dump_json())
    except OSError:
        pass
    return ConcurrencyLeaseHolder(type="flow_run", id=UUID(run_id))


def limit_name(host: str) -> str:
    return f"gpu:{host}"


def _now() -> str:
    return datetime.now(UTC).isoformat()


def ensure_limit(name: str, slots: int = 1) -> bool:
    """Create the limit if it is missing; True when it is busy right now (someone holds it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
            except ObjectAlreadyExists:  # another flow created it between our read and our write
                pass
            return False
        return limit.active_slots >= limit.limit


def _holders() -> Path:
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home) / "lanebench_holders"


def _holder_dead(lease: dict) -> bool:
    """The lease's holder (a flow run of this host) has no process any more."""
    holder = (lease.get("metadata") or {}).get("holder") or {}
    try:
        return Owner.model_validate_json((_holders() / f"{holder.get('id')}.json").read_text()).alive() is False
    except (OSError, ValueError):  # a pydantic ValidationError is a ValueError
        return False


def reclaim_expired(names: list[str], grace_s: float = 5.0, on_line: Callable[[str], None] | None = None) -> int:
    """Hand back the slots of expired leases on `names` found in this PREFECT_HOME's lease files,
    and at once those whose holder's process died on this host.

    Only leases stored on disk under the local PREFECT_HOME are visible (the ephemeral server's,
    or a server started by `lanebench serve` with this home); others are the server's business.
    """
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    folder = Path(get_current_settings().home) / "concurrency_leases"
    if not folder.is_dir():
        return 0
    now = datetime.now(UTC).timestamp()
    reclaimed = 0
    with get_client(sync_client=True) as client:
        ids = set()
        for name in names:
            try:
                ids.add(str(client.read_global_concurrency_limit_by_name(name).id))
            except Exception:
                continue
        for path in folder.glob("*-*-*-*-*.json"):
            try:
                lease = json.loads(path.read_text())
                expired = datetime.fromisoformat(lease["expiration"]).timestamp() < now - grace_s
            except (OSError, ValueError, KeyError):
                continue
            if not ids & set(lease.get("resource_ids", [])):
                continue
            dead = not expired and _holder_dead(lease)
            if expired or dead:
                from uuid import UUID

                client.release_concurrency_slots_with_lease(UUID(lease["id"]))
                reclaimed += 1
                if on_line is not None:
                    holder = (lease.get("metadata") or {}).get("holder") or {}
                    on_line(f"reclaimed: {', '.join(names)} lease of "
                            + (f"dead flow run {holder.get('id')} released at once" if dead else "an expired holder released"))
    return reclaimed


@contextmanager
def host_lock(host: str | list[str], timeout_s: float | None = None,
              on_wait: Callable[[str], None] | None = None) -> Iterator[Hold]:
    """Hold `gpu:<host>` for the body; waits (up to `timeout_s`, or forever) while another job has it.

    Usage, in any flow that boots a server on a host (nightly lanes, matrix arms):

        with host_lock(lane.host) as hold:
            lane_flow(...)

    A lane spread over several hosts (tensor parallel over a cable) passes them all; Prefect
    takes every slot or none, so two such lanes cannot deadlock each holding one host.

    `hold` records the wait and the hold interval for the run's manifest. Its `released_at` is
    stamped just before the slot is handed back, so recorded intervals of two jobs never overlap
    when the lock works. Raises TimeoutError when `timeout_s` passes without the host.
    """
    from prefect.concurrency.sync import concurrency

    names = [limit_name(h) for h in ([host] if isinstance(host, str) else host)]
    hold = Hold(limit=",".join(names), requested_at=_now())
    holder = _register_holder()
    busy = [name for name in names if ensure_limit(name)]
    if busy:  # a holder that died here is released now, not after its lease runs out
        hold.reclaimed += reclaim_expired(names, on_line=on_wait)
        busy = [name for name in names if ensure_limit(name)]
    if busy and on_wait is not None:
        on_wait(f"waiting for {', '.join(busy)}: another job holds this host")
    t0 = time.monotonic()
    with ExitStack() as stack:
        while True:
            left = None if timeout_s is None else timeout_s - (time.monotonic() - t0)
            try:
                stack.enter_context(concurrency(names, occupy=1, timeout_seconds=POLL_S if left is None else
                                                max(1.0, min(POLL_S, left)), lease_duration=lease_seconds(),
                                                strict=True, holder=holder))
                break
            except TimeoutError:
                if left is not None and left <= POLL_S:
                    raise TimeoutError(f"{hold.limit} not free after {timeout_s:.0f} s") from None
                hold.reclaimed += reclaim_expired(names, on_line=on_wait)
        hold.acquired_at, hold.waited_s = _now(), round(time.monotonic() - t0, 3)
        try:
            yield hold
        finally:
            hold.released_at = _now()
