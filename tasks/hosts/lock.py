"""One job per GPU host: a Prefect global concurrency limit `gpu:<host>` of one slot, held strict.

Two lanes on one GPU box measure each other, so a lane holds its host's limit from before
preflight to after teardown, and another flow aimed at that host waits in line.

`strict=True`: in Prefect 3.9 `concurrency()` on a missing limit silently does nothing. The limit
is created here on first use, and strict makes a missing one an error; a lost lease (server
unreachable past the lease) then stops the lane instead of letting it run unguarded.

A holder that dies (SIGKILL, power) keeps its slot. A full server's repossessor frees it when the
lease expires; the ephemeral server runs none, and Prefect 3.9 keeps leases in memory by default,
so the slot would stay taken in PREFECT_HOME's database forever. Hence leases on disk
(tasks/hosts/lock_storage.py), and a waiting lane releases, through Prefect's release-with-lease
call, the expired leases on this PREFECT_HOME (the repossessor's job). A holder's process (host,
boot id, pid, start time) is written beside the lease files: one dead on this host is released
at once, with a line saying so (`reclaim_expired`).

An operator may raise a host's limit (GPUs running independent lanes); an existing limit is never reset.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from uuid import UUID, uuid4

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
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.runtime import flow_run

    run_id = flow_run.get_id() or str(uuid4())
    folder = _holders()
    with suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{run_id}.json").write_text(Owner.here().model_dump_json())
    return ConcurrencyLeaseHolder(type="flow_run", id=UUID(run_id))


def limit_name(host: str) -> str:
    return f"gpu:{host}"


def _now() -> str:
    return datetime.now(UTC).isoformat()


def ensure_limit(name: str) -> bool:
    """Create the limit if it is missing; True when it is busy right now (someone holds it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with suppress(ObjectAlreadyExists):  # another flow created it between our read and our write
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            return False
        return limit.active_slots >= limit.limit


def _holders() -> Path:
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home) / "lanebench_holders"


def _holder_dead(holder: str | None) -> bool:
    """The lease's holder (a flow run of this host) has no process any more."""
    try:
        return Owner.model_validate_json((_holders() / f"{holder}.json").read_text()).alive() is False
    except (OSError, ValueError):  # a pydantic ValidationError is a ValueError
        return False


def reclaim_expired(names: list[str], grace_s: float = 5.0, on_line: Callable[[str], None] | None = None) -> int:
    """Hand back the slots of expired leases on `names`, and at once those whose holder died on this
    host. Only lease files under this PREFECT_HOME are seen (the ephemeral server's or `lanebench serve`'s)."""
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
            with suppress(Exception):
                ids.add(str(client.read_global_concurrency_limit_by_name(name).id))
        for path in folder.glob("*-*-*-*-*.json"):
            try:
                lease = json.loads(path.read_text())
                expired = datetime.fromisoformat(lease["expiration"]).timestamp() < now - grace_s
            except (OSError, ValueError, KeyError):
                continue
            if not ids & set(lease.get("resource_ids", [])):
                continue
            holder = ((lease.get("metadata") or {}).get("holder") or {}).get("id")
            dead = not expired and _holder_dead(holder)
            if expired or dead:
                client.release_concurrency_slots_with_lease(UUID(lease["id"]))
                reclaimed += 1
                if on_line is not None:
                    on_line(f"reclaimed: {', '.join(names)} lease of "
                            + (f"dead flow run {holder} released at once" if dead else "an expired holder released"))
    return reclaimed


@contextmanager
def host_lock(host: str | list[str], timeout_s: float | None = None,
              on_wait: Callable[[str], None] | None = None) -> Iterator[Hold]:
    """Hold `gpu:<host>` for the body, waiting (up to `timeout_s`, or forever; then TimeoutError).

    A lane over several hosts passes them all: Prefect takes every slot or none, so two such lanes
    cannot deadlock. `hold` records wait and interval for the manifest; `released_at` is stamped
    before the slot goes back, so two jobs' recorded intervals never overlap when the lock works."""
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
