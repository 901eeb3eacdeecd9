"""report.md's GPU lines for one lane, from the manifest's `lanes.<lane>.gpu` (nvidia-smi before
boot, right after boot and after teardown, tasks/stages/serve.py) and the boot facts; and the
line under the decode curve that says what its bandwidth share counts.

A GPU number read only from parquet or the manifest is a number nobody reads: the report shows
which GPU ran the lane, what the server held on it (the offload that happened, whatever the
flags asked), the clocks and power it ran at, and a CPU-declared lane that held GPU memory.
"""

from __future__ import annotations

from typing import Any


def _mib(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}"


def _one(v: float | None, unit: str) -> str:
    return "?" if v is None else f"{v:.0f} {unit}"


def _gpus(facts: dict | None) -> list[dict]:
    return list((facts or {}).get("gpus") or [])


def gpu_lines(gpu: dict[str, Any], boot_facts: dict[str, Any]) -> list[str]:
    """Markdown bullet lines; none for a lane whose host had no nvidia-smi."""
    before = gpu.get("before") or {}
    if not before:
        return []
    if not before.get("ok"):
        return [f"- GPU: nvidia-smi gave nothing ({before.get('reason', 'no reason given')})"]
    out = []
    phases = [(p, _gpus(gpu.get(p))) for p in ("before", "booted", "after")]
    for g in _gpus(before):
        i = g["index"]
        cuda = f", CUDA {before['cuda_version']}" if before.get("cuda_version") else ""
        out.append(f"- GPU {i}: **{g['name']}**, {_mib(g['memory_total_mib'])} MiB, driver {g['driver_version']}{cuda}")
        used = []
        for phase, gs in phases:
            same = [x for x in gs if x["index"] == i]
            if same:
                used.append(f"{phase} {_mib(same[0]['memory_used_mib'])}")
        out.append(f"  - memory in use, MiB: {', '.join(used)}")
        booted = next((x for x in _gpus(gpu.get("booted")) if x["index"] == i), None)
        if booted:
            out.append(f"  - booted: SM {_one(booted.get('clock_sm_mhz'), 'MHz')} (max {_one(booted.get('clock_max_sm_mhz'), 'MHz')}), "
                       f"memory {_one(booted.get('clock_mem_mhz'), 'MHz')} (max {_one(booted.get('clock_max_mem_mhz'), 'MHz')}), "
                       f"power {_one(booted.get('power_draw_w'), 'W')} of {_one(booted.get('power_limit_w'), 'W')}, "
                       f"utilization {_one(booted.get('utilization_pct'), '%')}, {_one(booted.get('temperature_c'), 'C')}, "
                       f"{booted.get('pstate') or '?'}")
        after = next((x for x in _gpus(gpu.get("after")) if x["index"] == i), None)
        if after:
            out.append(f"  - after teardown: SM {_one(after.get('clock_sm_mhz'), 'MHz')}, "
                       f"power {_one(after.get('power_draw_w'), 'W')}, utilization {_one(after.get('utilization_pct'), '%')}")
    if "server_memory_mib" in gpu:
        held = gpu["server_memory_mib"]
        out.append(f"- the server's own GPU memory (nvidia-smi, by process): "
                   f"{'none' if not held else f'{held:.0f} MiB'}")
    layers = [f"{role.replace('_', ' ')} {boot_facts[role]}" for role in ("offloaded_layers", "draft_offloaded_layers")
              if boot_facts.get(role)]
    buffers = [f"{role.replace('_', ' ')} {boot_facts[role]:.0f}" for role in ("gpu_model_buffer_mib", "draft_gpu_model_buffer_mib")
               if isinstance(boot_facts.get(role), (int, float))]
    if layers or buffers:
        out.append(f"- offload, as the server logged it: {', '.join(layers + buffers)}")
    if gpu.get("cpu_lane_holds_gpu"):
        out.append(f"- **FLAG** {gpu['cpu_lane_holds_gpu']}")
    return out


def bandwidth_note(basis: dict[str, Any]) -> str:
    """What the decode curve's bandwidth share counts, with the lane's own numbers."""
    if not basis:
        return ""
    return (f"Bandwidth share (C=1 rows): per-user tok/s x {basis['model_bytes'] / 1e9:.3g} GB (the model file: "
            f"every weight read once per decode step) / {basis['memory_gbps']:g} GB/s (the host's declared "
            "memory_gbps). KV-cache reads are not counted, so it is a lower bound on the bandwidth asked for; "
            "with a drafter one step yields several tokens and a share above 1 is the drafter's gain.")
