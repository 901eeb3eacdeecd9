"""Host noise beside every measured wave: load average before, CPU busy and steal during.

The rehearsal nightly on a busy machine once reported C=2 at 106 tok/s with a 447% spread,
and passed its expectations. A row is only as good as the quiet it was measured in, so the
host's own counters (/proc/loadavg, /proc/stat) travel with the row, and a spread above the
declared bound marks the row unstable (not a regression baseline; the nightly says "re-run on
a quiet host"). Read on the machine running the bench client (the lane's host for local lanes).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

# Repeats of a level that disagree by more than this (max - min over the median) are noise, not
# a measurement. On the idle 2-core VM the rehearsal's worst level spread 31.8% (docs/benchmarks.md),
# so 50% passes an idle night and catches the 447% of a busy one.
DEFAULT_UNSTABLE_SPREAD_PCT = 50.0


class CpuTimes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    total: float
    idle: float
    steal: float
    load_1m: float | None


class Noise(BaseModel):
    """What the host was doing around one wave."""

    model_config = ConfigDict(extra="forbid")
    load_1m_before: float | None
    busy_pct: float | None  # all CPUs busy, any process (ours included), during the wave
    steal_pct: float | None  # the hypervisor took this share of CPU time during the wave


def sample(proc: Path = Path("/proc")) -> CpuTimes | None:
    try:
        fields = [float(x) for x in (proc / "stat").read_text().splitlines()[0].split()[1:]]
        load = float((proc / "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user)
    steal = fields[7] if len(fields) > 7 else 0.0
    return CpuTimes(total=sum(fields[:8]), idle=fields[3] + fields[4], steal=steal, load_1m=load)


def between(before: CpuTimes | None, after: CpuTimes | None) -> Noise:
    if before is None or after is None or after.total <= before.total:
        return Noise(load_1m_before=before.load_1m if before else None, busy_pct=None, steal_pct=None)
    span = after.total - before.total
    return Noise(load_1m_before=before.load_1m, busy_pct=100.0 * (1 - (after.idle - before.idle) / span),
                 steal_pct=100.0 * (after.steal - before.steal) / span)
