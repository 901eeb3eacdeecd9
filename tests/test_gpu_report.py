"""report.md of a GPU lane, and a CPU-declared lane that holds GPU memory, on CPU (issue 23).

One `lanebench nightly` with real CPU llama-servers, while an `nvidia-smi` on PATH replays the
H200 recordings of tests/fixtures/engines/llamacpp-cuda/: the idle GPU while no server of this
test runs, and the recording made while a CUDA llama-server held 808 MiB once one does. The lane
on a `gpus: 1` host gets its GPU facts and the bandwidth share in report.md; the lane on a
`gpus: 0` host gets its GPU facts recorded too (the host has nvidia-smi), the flag for GPU memory
held by a CPU-declared lane, and its server starts with CUDA_VISIBLE_DEVICES empty.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import manifest_of, no_llama_server_left, run_cli, run_folder_of, shipped_inventory, write_inventory
from tasks.hosts.gpu import APPS, QUERY

REPO = Path(__file__).resolve().parents[1]
CUDA = REPO / "tests" / "fixtures" / "engines" / "llamacpp-cuda"
PORTS = (18541, 18542)


def _replaying_nvidia_smi(folder: Path) -> Path:
    """An nvidia-smi that answers from the H200 recordings: the idle GPU while no server of this
    test runs; while some do, the busy recording, its llama-server row once per running server
    of this test under that server's own pid (as a CUDA build that saw the GPU would appear)."""
    folder.mkdir()
    apps = (CUDA / "nvidia-smi-apps-busy.csv").read_text().strip()
    recorded_pid = apps.split(",")[1].strip()
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        "ours=\n"
        "for d in /proc/[0-9]*; do\n"
        '  c=$(tr "\\0" " " < "$d/cmdline" 2>/dev/null)\n'
        f'  case "$c" in *"--port {PORTS[0]} "*|*"--port {PORTS[1]} "*) ours="$ours ${{d#/proc/}}" ;; esac\n'
        "done\n"
        'if [ -n "$ours" ]; then s=busy; else s=idle; fi\n'
        'case "$1" in\n'
        f'  "--query-gpu={QUERY}") cat "{CUDA}/nvidia-smi-query-$s.csv" ;;\n'
        f'  "--query-compute-apps={APPS}") for p in $ours; do echo "{apps}" | sed "s/, {recorded_pid}, /, $p, /"; done ;;\n'
        '  --*) echo "not recorded: $*" >&2; exit 9 ;;\n'
        f'  *) cat "{CUDA}/nvidia-smi-banner.txt" ;;\n'
        "esac\n")
    script.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def nightly(tmp_path_factory, llama_bin):
    tmp = tmp_path_factory.mktemp("gpureport")
    inv = shipped_inventory()
    base = inv["lanes"]["rehearsal"]
    lane = {k: base[k] for k in ("engine", "model", "slots", "context", "threads", "boot_timeout_s")}
    lane["bench"] = {"repeats": 1, "decode": {"concurrency": [1, 2], "max_tokens": 16, "requests_per_stream": 1,
                                              "prompts": "testbed/prompts/prose.jsonl"}}
    lane["gates"] = [{"kind": "capacity"}]
    inv["hosts"] = {"gpu": {"address": "127.0.0.1", "transport": "local", "gpus": 1, "memory_gbps": 4800},
                    "cpu": {"address": "127.0.0.1", "transport": "local", "gpus": 0}}
    inv["lanes"] = {"on-gpu": {**lane, "host": "gpu", "port": PORTS[0]},
                    "cpu-only": {**lane, "host": "cpu", "port": PORTS[1]}}
    smi = _replaying_nvidia_smi(tmp / "bin")
    import os
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{smi}:{old}"
    try:
        result = run_cli("nightly", "--hosts", str(write_inventory(tmp / "inv", inv)),
                         "--artifacts", str(tmp / "artifacts"), timeout=600)
    finally:
        os.environ["PATH"] = old
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    folder = run_folder_of(result)
    assert no_llama_server_left(PORTS[0]) and no_llama_server_left(PORTS[1])
    return manifest_of(folder), (folder / "report.md").read_text()


def _section(report: str, lane: str) -> str:
    return report.split(f"\n## {lane}\n", 1)[1].split("\n## ", 1)[0]


def test_a_gpu_lanes_report_shows_its_gpu_and_bandwidth_share(nightly):
    m, report = nightly
    gpu = m["lanes"]["on-gpu"]["gpu"]
    assert gpu["booted"]["gpus"][0]["memory_used_mib"] == 817
    assert gpu["server_memory_mib"] == 808 and gpu.get("cpu_lane_holds_gpu") is None  # typed: null, not absent
    text = _section(report, "on-gpu")
    assert "- GPU 0: **NVIDIA H200**, 143771 MiB, driver 580.159.04, CUDA 13.0" in text
    # after: idle, or busy while the other lane's server runs (lanes on two hosts may overlap)
    assert re.search(r"memory in use, MiB: before (0|817), booted 817, after (0|817)\n", text), text
    assert "booted: SM 1980 MHz (max 1980 MHz), memory 3201 MHz (max 3201 MHz), power 129 W of 700 W" in text
    assert "the server's own GPU memory (nvidia-smi, by process): 808 MiB" in text
    decode = text.split("### Decode curve\n", 1)[1].splitlines()
    header = next(line for line in decode if line.startswith("| C |"))
    assert header.rstrip("|").split("|")[-1].strip() == "bandwidth share"
    c1 = next(line for line in decode if line.startswith("| 1 |"))
    share = float(c1.rstrip("|").split("|")[-1])
    assert 0 < share < 1  # 3.8 MB per step at CPU speed against 4800 GB/s
    assert "Bandwidth share (C=1 rows): per-user tok/s x 0.00378 GB" in text and "/ 4800 GB/s" in text


def test_a_cpu_declared_lane_holding_gpu_memory_is_flagged(nightly):
    m, report = nightly
    lane = m["lanes"]["cpu-only"]
    assert lane["status"] == "passed"
    assert lane["gpu"]["before"]["ok"] and lane["gpu"]["server_memory_mib"] == 808
    assert lane["gpu"]["cpu_lane_holds_gpu"].startswith("GPU memory held by a lane declared CPU-only: its server holds 808 MiB")
    assert any(w.startswith("GPU memory held by a lane declared CPU-only") for w in lane["warnings"])
    assert "- **FLAG** GPU memory held by a lane declared CPU-only" in _section(report, "cpu-only")
    assert "bandwidth share" not in _section(report, "cpu-only")  # no memory_gbps declared there


def test_a_cpu_declared_host_starts_its_server_without_gpus():
    from tasks.inventory.models import Host, Lane
    from tasks.stages.boot import process_env

    lane = Lane.model_validate({"host": "h", "engine": "llamacpp", "port": 18000, "model": {"path": "/m.gguf"},
                                "bench": {"decode": {"prompts": "p.jsonl"}}})
    assert process_env(lane, Host(gpus=0), lane.env) == {"CUDA_VISIBLE_DEVICES": ""}
    assert process_env(lane, Host(gpus=1), lane.env) == {}
    own = lane.model_copy(update={"env": {"CUDA_VISIBLE_DEVICES": "1"}})
    assert process_env(own, Host(gpus=0), own.env) == {"CUDA_VISIBLE_DEVICES": "1"}  # the lane's own word wins
