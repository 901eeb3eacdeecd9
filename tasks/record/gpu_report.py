"""report.md's GPU lines for one lane (the manifest's `gpu` section: nvidia-smi before boot, once
booted and after teardown) and the line under the decode curve on its bandwidth share: which GPU,
what the server held on it, clocks and power, and a CPU-declared lane that held GPU memory.
"""

from __future__ import annotations

from tasks.record.manifest import Bandwidth, GpuSection, JsonObject


def _one(v: float | None, unit: str = "") -> str:
    return "?" if v is None else f"{v:.0f} {unit}".rstrip()


def gpu_lines(gpu: GpuSection, boot_facts: JsonObject) -> list[str]:
    """Markdown bullet lines; none for a lane whose host had no nvidia-smi."""
    before = gpu.before
    if before is None:
        return []
    if not before.ok:
        return [f"- GPU: nvidia-smi gave nothing ({before.reason or 'no reason given'})"]
    out = []
    for g in before.gpus:
        cuda = f", CUDA {before.cuda_version}" if before.cuda_version else ""
        out.append(f"- GPU {g.index}: **{g.name}**, {_one(g.memory_total_mib)} MiB, driver {g.driver_version}{cuda}")
        same = {phase: x for phase, facts in (("before", before), ("booted", gpu.booted), ("after", gpu.after))
                if (x := next((x for x in (facts.gpus if facts else []) if x.index == g.index), None))}
        out.append(f"  - memory in use, MiB: {', '.join(f'{p} {_one(x.memory_used_mib)}' for p, x in same.items())}")
        if booted := same.get("booted"):
            out.append(f"  - booted: SM {_one(booted.clock_sm_mhz, 'MHz')} (max {_one(booted.clock_max_sm_mhz, 'MHz')}), "
                       f"memory {_one(booted.clock_mem_mhz, 'MHz')} (max {_one(booted.clock_max_mem_mhz, 'MHz')}), "
                       f"power {_one(booted.power_draw_w, 'W')} of {_one(booted.power_limit_w, 'W')}, "
                       f"utilization {_one(booted.utilization_pct, '%')}, {_one(booted.temperature_c, 'C')}, "
                       f"{booted.pstate or '?'}")
        if after := same.get("after"):
            out.append(f"  - after teardown: SM {_one(after.clock_sm_mhz, 'MHz')}, "
                       f"power {_one(after.power_draw_w, 'W')}, utilization {_one(after.utilization_pct, '%')}")
    if gpu.booted is not None:  # the server's memory is read whenever the booted server was
        held = gpu.server_memory_mib
        out.append(f"- the server's own GPU memory (nvidia-smi, by process): "
                   f"{'none' if not held else f'{held:.0f} MiB'}")
    layers = [f"{role.replace('_', ' ')} {boot_facts[role]}" for role in ("offloaded_layers", "draft_offloaded_layers")
              if boot_facts.get(role)]
    buffers = [f"{role.replace('_', ' ')} {value:.0f}" for role in ("gpu_model_buffer_mib", "draft_gpu_model_buffer_mib")
               if isinstance(value := boot_facts.get(role), (int, float))]
    if layers or buffers:
        out.append(f"- offload, as the server logged it: {', '.join(layers + buffers)}")
    if gpu.cpu_lane_holds_gpu:
        out.append(f"- **FLAG** {gpu.cpu_lane_holds_gpu}")
    return out


def bandwidth_note(basis: Bandwidth | None) -> str:
    """What the decode curve's bandwidth share counts, with the lane's own numbers."""
    if basis is None:
        return ""
    return (f"Bandwidth share (C=1 rows): per-user tok/s x {basis.model_bytes / 1e9:.3g} GB (the model file: "
            f"every weight read once per decode step) / {basis.memory_gbps:g} GB/s (the host's declared "
            "memory_gbps). KV-cache reads are not counted, so it is a lower bound on the bandwidth asked for; "
            "with a drafter one step yields several tokens and a share above 1 is the drafter's gain.")
