"""Running-request caps computed from a lane's config, before anything boots.

Each is an upper bound (the KV pool, known only at boot, may allow fewer), so a bench concurrency
above it fails the capacity gate for sure: better said at config time than after an image pull and
a ten-minute boot (the shipped GB300 example once asked 48 of a server its own
`--max-mamba-cache-size 48` capped at 9).
"""

from __future__ import annotations

from tasks.engines.facts import PlannedCap
from tasks.inventory.flag_conflicts import flag_values
from tasks.inventory.models import Lane


def flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last of `names` in an argv (`--x v` or `--x=v`); argparse keeps the last."""
    return next(reversed(flag_values(argv, names)), None)


def int_flag(argv: list[str], *names: str) -> int | None:
    value = flag_value(argv, *names)
    return int(value) if value is not None and value.isdigit() else None


def check(lane: Lane, planned: PlannedCap | None) -> str | None:
    """A one-line reason when the lane's capacity gate cannot pass its own bench, else None (levels
    declared `beyond_cap: queue` are let through, as the gate lets them)."""
    wanted = max(lane.bench.decode.gated_levels())
    if planned is None or planned.cap >= wanted or not any(g.kind == "capacity" for g in lane.gates):
        return None
    return (f"running requests are capped at {planned.cap} by the config ({planned.reason}), below bench "
            f"concurrency {wanted}. Fix: {planned.fix}, or lower bench.decode.concurrency")
