"""GPU host facts, read from `nvidia-smi` on the host, and the idle-GPU gate.

The seeds measured lanes on GPUs other jobs were using and only found out from the numbers. So a
GPU host's facts (model, memory, driver and CUDA versions, clocks, power) go into the manifest
before and after each lane, and preflight refuses to boot while others hold more than the host's
declared share of a GPU's memory. The CUDA version is only in the plain `nvidia-smi` banner.
"""

from __future__ import annotations

import csv
import io
import re

from pydantic import BaseModel

from tasks.hosts.transport import Transport, TransportError

QUERY = ("index,name,uuid,memory.total,memory.used,driver_version,pstate,clocks.sm,clocks.mem,"
         "clocks.max.sm,clocks.max.mem,power.draw,power.limit,utilization.gpu,temperature.gpu")
APPS = "gpu_uuid,pid,process_name,used_memory"
_CUDA = re.compile(r"CUDA Version:\s*([0-9.]+)")


class GpuApp(BaseModel):
    pid: int
    name: str
    used_mib: float | None = None


class Gpu(BaseModel):
    index: int
    name: str
    uuid: str
    memory_total_mib: float
    memory_used_mib: float
    driver_version: str
    pstate: str | None = None
    clock_sm_mhz: float | None = None
    clock_mem_mhz: float | None = None
    clock_max_sm_mhz: float | None = None
    clock_max_mem_mhz: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    utilization_pct: float | None = None
    temperature_c: float | None = None
    apps: list[GpuApp] = []

    @property
    def used_share(self) -> float:
        return self.memory_used_mib / self.memory_total_mib if self.memory_total_mib else 0.0


class GpuHostFacts(BaseModel):
    ok: bool
    reason: str = ""
    cuda_version: str | None = None
    gpus: list[Gpu] = []


def _num(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_query(text: str) -> list[Gpu]:
    """The rows of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`."""
    gpus, fields = [], tuple(Gpu.model_fields)[:-1]  # QUERY's columns are Gpu's fields but apps, in order
    for row in csv.reader(io.StringIO(text)):
        if not row or not row[0].strip():
            continue
        if len(row) != len(fields):
            raise ValueError(f"nvidia-smi gave {len(row)} fields, expected {len(fields)}: {row}")
        f = dict(zip(fields, (c.strip() for c in row), strict=True))
        gpus.append(Gpu(**f | {"pstate": f["pstate"] or None} | {k: _num(f[k]) for k in fields[7:]}))
    return gpus


def gpu_facts(t: Transport) -> GpuHostFacts:
    """The host's GPUs as nvidia-smi reports them now; ok=False (with the reason) when it cannot."""
    try:
        q = t.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"], deadline_s=30, idempotent=True)
        if q.exit_code != 0:
            return GpuHostFacts(ok=False, reason=f"nvidia-smi failed (exit {q.exit_code}): {(q.stderr or q.stdout).strip()[:200]}")
        gpus = parse_query(q.stdout)
        apps = t.run(["nvidia-smi", f"--query-compute-apps={APPS}", "--format=csv,noheader,nounits"],
                     deadline_s=30, idempotent=True)
        by_uuid = {g.uuid: g for g in gpus}
        for row in csv.reader(io.StringIO(apps.stdout if apps.exit_code == 0 else "")):
            f = [c.strip() for c in row]
            if len(f) == 4 and f[0] in by_uuid and f[1].isdigit():  # the processes holding memory, by GPU uuid
                by_uuid[f[0]].apps.append(GpuApp(pid=int(f[1]), name=f[2], used_mib=_num(f[3])))
        banner = t.run(["nvidia-smi"], deadline_s=30, idempotent=True)
    except (TransportError, OSError) as e:  # OSError: no nvidia-smi on a local host
        return GpuHostFacts(ok=False, reason=f"nvidia-smi could not run: {e}")
    except ValueError as e:
        return GpuHostFacts(ok=False, reason=str(e))
    cuda = _CUDA.search(banner.stdout or "")
    return GpuHostFacts(ok=bool(gpus), reason="" if gpus else "nvidia-smi lists no GPU",
                        cuda_version=cuda[1] if cuda else None, gpus=gpus)


def idle_gpu_gate(facts: GpuHostFacts, declared_gpus: int, max_busy_share: float) -> str | None:
    """Why the lane must not boot on this host, or None. Checked before our server starts, so
    every byte in use belongs to someone else."""
    if not facts.ok:
        return f"GPU host: {facts.reason}"
    if len(facts.gpus) < declared_gpus:
        return f"the host declares {declared_gpus} GPUs, nvidia-smi lists {len(facts.gpus)}"
    for g in facts.gpus:
        if g.used_share > max_busy_share:
            holders = ", ".join(f"{a.name} (pid {a.pid}, {a.used_mib:.0f} MiB)" for a in g.apps) or "processes nvidia-smi cannot name"
            return (f"GPU {g.index} ({g.name}) has {g.memory_used_mib:.0f} of {g.memory_total_mib:.0f} MiB in use "
                    f"({100 * g.used_share:.1f}% > the host's gpu_max_busy_share {100 * max_busy_share:.0f}%) by "
                    f"{holders}: measuring on a shared GPU gives numbers that are not the lane's")
    return None


def server_gpu_memory(facts: GpuHostFacts, binary: str, pids: set[int] | None = None) -> float | None:
    """MiB the lane's server holds on the host's GPUs (what was offloaded, whatever the flags asked);
    None when no such process does. With `pids` (its process group) only those count: another
    lane of the same binary may run on the same box. Without, nvidia-smi's process name decides."""
    name = binary.rsplit("/", 1)[-1]
    held = [a.used_mib or 0.0 for g in facts.gpus for a in g.apps
            if (a.pid in pids if pids else a.name == binary or a.name.rsplit("/", 1)[-1] == name)]
    return sum(held) if held else None


def group_pids(t: Transport, pgid: int) -> set[int]:
    """The processes of one process group on the host, from /proc/PID/stat (`pid (comm) state ppid
    pgrp ...`; procps may be absent); empty when unreadable."""
    try:
        r = t.run(["sh", "-c", "cat /proc/[0-9]*/stat 2>/dev/null; true"], deadline_s=30, idempotent=True)
    except (TransportError, OSError):
        return set()
    pids = set()
    for line in (r.stdout or "").splitlines():
        head, _, rest = line.rpartition(")")
        fields = rest.split()
        if head and len(fields) >= 3 and fields[2] == str(pgid):
            pids.add(int(head.split(" (", 1)[0]))
    return pids


def cpu_lane_on_gpu(held_mib: float) -> str:
    """The flag for a lane on a `gpus: 0` host whose server holds GPU memory anyway: not a CPU lane's numbers."""
    return (f"GPU memory held by a lane declared CPU-only: its server holds {held_mib:.0f} MiB on the host's GPUs "
            "although the host says gpus: 0 (a CUDA build that saw the GPU; set CUDA_VISIBLE_DEVICES= or "
            "declare the GPUs)")
