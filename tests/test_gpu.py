"""GPU lanes without a GPU: offload from the inventory, GPU host facts and the idle-GPU gate
from nvidia-smi output recorded on an NVIDIA H200, the CUDA llama-server's recorded boot log,
/slots, /metrics and streams, the bandwidth share, and the pinned-tree build script.

The recordings come from the H200 run of docs/gpu.md (scripts/gpu-remote.sh wrote them);
tests/fixtures/engines/llamacpp-cuda/README.md says which command made each file. nvidia-smi is
replayed by a tiny script on PATH that prints the recording for the exact query it was made
with (a changed query fails here: record again).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tasks.engines import engine_for
from tasks.engines.facts import Metrics
from tasks.engines.llamacpp import LlamaCpp
from tasks.hosts.gpu import APPS, QUERY, gpu_facts, idle_gpu_gate, parse_query, server_gpu_memory
from tasks.hosts.transport import LocalTransport
from tasks.inventory.models import Host, Lane
from tasks.record.rows import DecodeRow
from tasks.stages import topology
from tasks.stages.limits import bandwidth_share, with_bandwidth_share

REPO = Path(__file__).resolve().parents[1]
CUDA = REPO / "tests" / "fixtures" / "engines" / "llamacpp-cuda"


def lane(**over) -> Lane:
    base = {"host": "gpu", "engine": "llamacpp", "port": 18300, "slots": 2, "context": 512,
            "model": {"path": "/m/target.gguf"}, "bench": {"decode": {"prompts": "p.jsonl"}}}
    return Lane.model_validate({**base, **over})


def launch_argv(lane: Lane, binary: str, address: str, host: Host) -> list[str]:
    return topology.launch_argv(lane, engine_for(lane.engine), binary, address, host)


DRAFTED = {"drafter": {"path": "/m/drafter.gguf"}, "speculative": {"method": "draft-simple", "k": 4}}


# ------------------------------------------------------------------------ offload from `gpus`


def test_cpu_host_keeps_target_and_drafter_on_the_cpu():
    argv = launch_argv(lane(**DRAFTED), "llama-server", "127.0.0.1", Host(gpus=0))
    assert argv[-4:] == ["--n-gpu-layers", "0", "--n-gpu-layers-draft", "0"]


def test_gpu_host_offloads_target_and_drafter():
    argv = launch_argv(lane(**DRAFTED), "llama-server", "127.0.0.1", Host(gpus=1))
    assert argv[-4:] == ["--n-gpu-layers", "all", "--n-gpu-layers-draft", "all"]
    assert "--n-gpu-layers-draft" not in launch_argv(lane(), "llama-server", "127.0.0.1", Host(gpus=1))


def test_the_lanes_own_offload_flags_win():
    argv = launch_argv(lane(**DRAFTED, flags=["-ngl", "20"]), "llama-server", "127.0.0.1", Host(gpus=1))
    assert argv.count("-ngl") == 1 and "--n-gpu-layers" not in argv
    assert argv[-2:] == ["--n-gpu-layers-draft", "all"]  # the drafter still follows the host
    argv = launch_argv(lane(**DRAFTED, flags=["--spec-draft-ngl", "0"]), "llama-server", "127.0.0.1", Host(gpus=1))
    assert "--n-gpu-layers-draft" not in argv and argv[argv.index("--n-gpu-layers") + 1] == "all"


def test_an_rpc_lane_leaves_offload_to_its_workers():
    rpc = lane(rpc={"workers": ["w"], "link": "l"})
    assert "--n-gpu-layers" not in launch_argv(rpc, "llama-server", "127.0.0.1", Host(gpus=0))


# ------------------------------------------------------------- nvidia-smi, recorded on the H200


@pytest.fixture
def replay(tmp_path, monkeypatch):
    """Put an `nvidia-smi` on PATH that prints the named H200 recordings."""

    def use(query: str, apps: str) -> None:
        script = tmp_path / "nvidia-smi"
        script.write_text(
            "#!/bin/sh\n"
            f'case "$1" in\n'
            f'  "--query-gpu={QUERY}") cat "{CUDA / query}" ;;\n'
            f'  "--query-compute-apps={APPS}") cat "{CUDA / apps}" ;;\n'
            f'  --*) echo "not recorded: $*" >&2; exit 9 ;;\n'
            f'  *) cat "{CUDA / "nvidia-smi-banner.txt"}" ;;\n'
            "esac\n")
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:{Path(shutil.which('sh')).parent}")

    return use


def test_h200_facts_from_the_recorded_nvidia_smi(replay):
    replay("nvidia-smi-query-idle.csv", "nvidia-smi-apps-idle.csv")
    facts = gpu_facts(LocalTransport())
    assert facts.ok and len(facts.gpus) == 1
    g = facts.gpus[0]
    assert g.name == "NVIDIA H200" and g.index == 0 and g.uuid.startswith("GPU-")
    assert 140_000 < g.memory_total_mib < 145_000  # 141 GB of HBM3e
    assert g.memory_used_mib < 0.01 * g.memory_total_mib and g.apps == []
    assert g.driver_version.count(".") == 2 and facts.cuda_version and facts.cuda_version.startswith("13.")
    assert g.clock_max_sm_mhz and g.clock_max_sm_mhz >= 1900 and g.clock_sm_mhz is not None
    assert g.power_limit_w and g.power_limit_w >= 600 and g.power_draw_w is not None
    assert idle_gpu_gate(facts, declared_gpus=1, max_busy_share=0.1) is None


def test_a_busy_gpu_refuses_the_boot_and_names_who_holds_it(replay):
    # Recorded while a CUDA llama-server held the testbed target and drafter on the H200.
    replay("nvidia-smi-query-busy.csv", "nvidia-smi-apps-busy.csv")
    facts = gpu_facts(LocalTransport())
    g = facts.gpus[0]
    assert g.apps and "llama-server" in g.apps[0].name and g.apps[0].used_mib > 0
    assert idle_gpu_gate(facts, 1, max_busy_share=0.5) is None  # within a generous share
    reason = idle_gpu_gate(facts, 1, max_busy_share=0.0001)
    assert reason and reason.startswith("GPU 0 (NVIDIA H200) has ")
    assert f"pid {g.apps[0].pid}" in reason and "gpu_max_busy_share" in reason


def test_missing_gpus_and_missing_nvidia_smi_refuse(replay, monkeypatch, tmp_path):
    replay("nvidia-smi-query-idle.csv", "nvidia-smi-apps-idle.csv")
    assert "declares 2 GPUs, nvidia-smi lists 1" in idle_gpu_gate(gpu_facts(LocalTransport()), 2, 0.1)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    facts = gpu_facts(LocalTransport())
    assert not facts.ok and idle_gpu_gate(facts, 1, 0.1).startswith("GPU host: nvidia-smi failed (exit 127)")


def test_not_supported_fields_read_as_unknown():
    row = "0, NVIDIA H200, GPU-x, 143771, 0, 580.159.04, P0, [N/A], [N/A], 1980, 3201, [N/A], [N/A], 0, 30\n"
    g = parse_query(row)[0]
    assert g.clock_sm_mhz is None and g.power_draw_w is None and g.clock_max_sm_mhz == 1980


# ------------------------------------------------------------- the CUDA llama-server, recorded


def test_cuda_boot_log_says_what_was_offloaded():
    # Verbosity 4: libllama's load lines, target first, then the drafter.
    facts = LlamaCpp().boot_facts((CUDA / "boot-verbose.log").read_text())
    assert facts.extra["offloaded_layers"] == "5/5"  # 4 blocks and the output layer of the testbed target
    assert facts.extra["draft_offloaded_layers"] == "3/3"
    assert facts.extra["gpu_model_buffer_mib"] == 3.49 and facts.extra["draft_gpu_model_buffer_mib"] == 0.89
    assert facts.extra["gpu_device"] == "CUDA0 NVIDIA H200"
    assert facts.max_running_requests == 2 and facts.context_per_slot == 512 and facts.draft_model_loaded


def test_cuda_boot_log_at_default_verbosity_reads_like_the_cpu_build():
    # What lanes boot with: no load lines, so the offload is read from nvidia-smi instead.
    facts = LlamaCpp().boot_facts((CUDA / "boot.log").read_text())
    assert facts.max_running_requests == 2 and facts.context_per_slot == 512 and facts.draft_model_loaded
    assert "offloaded_layers" not in facts.extra


def test_the_servers_gpu_memory_is_what_nvidia_smi_says_it_holds(replay):
    replay("nvidia-smi-query-busy.csv", "nvidia-smi-apps-busy.csv")
    facts = gpu_facts(LocalTransport())
    binary = facts.gpus[0].apps[0].name  # the pinned CUDA build's path on the H200
    assert binary.endswith("-cuda-90/bin/llama-server")
    assert server_gpu_memory(facts, binary) == 808.0  # target, drafter, KV cache and compute buffers
    assert server_gpu_memory(facts, "/opt/sglang/bin/python") is None


def test_cuda_slots_props_and_metrics_read_like_the_cpu_build():
    engine = LlamaCpp()
    facts = engine.boot_facts((CUDA / "boot.log").read_text())
    facts = engine.info_facts(facts, json.loads((CUDA / "slots_after.json").read_text()))
    assert facts.extra["speculative_context"] is True and facts.max_running_requests == 2
    props = json.loads((CUDA / "props.json").read_text())
    assert props["total_slots"] == 2 and props["model_ftype"] == "F16"
    before = engine.metrics((CUDA / "metrics_before.prom").read_text())
    after = engine.metrics((CUDA / "metrics_after.prom").read_text())
    acc = engine.acceptance(before, after, [], k=4)
    assert isinstance(before, Metrics) and acc is not None
    # The two streams' own log lines: 32/59 and 244/619 drafts accepted.
    assert acc.draft_tokens == 59 + 619 and acc.accepted == 32 + 244
    assert 1.0 <= acc.acceptance_length <= 5.0
    assert all(a >= b for a, b in zip(acc.per_position, acc.per_position[1:]))


def test_cuda_streams_parse():
    engine = LlamaCpp()
    for name, finish in (("stream_length.sse", "length"), ("stream_stop.sse", None)):
        events = [e for line in (CUDA / name).read_text().splitlines() if (e := engine.parse_sse_line(line))]
        done = [e for e in events if e.done]
        assert len(done) == 1 and done[0].completion_tokens == sum(e.tokens for e in events if not e.done)
        assert done[0].spec is not None and done[0].spec["draft_n"] > 0
        if finish:
            assert done[0].finish_reason == finish and done[0].completion_tokens == 48


# --------------------------------------------------------------------------- bandwidth share


def test_bandwidth_share_prices_single_stream_rows_only():
    # 3 GB read per token at 400 tok/s is 1.2 TB/s: a quarter of 4800 GB/s.
    assert bandwidth_share(400.0, 3_000_000_000, 4800.0) == pytest.approx(0.25)
    row = dict(lane="l", repeats=3, aggregate_tok_s=1.0, aggregate_tok_s_min=1.0, aggregate_tok_s_max=1.0,
               aggregate_spread_pct=0.0, ttft_p50_s=0.1, ttft_p95_s=0.1, itl_p50_s=0.01, requests=6,
               failed_requests=0)
    rows = [DecodeRow(concurrency=1, per_user_tok_s=400.0, **row), DecodeRow(concurrency=4, per_user_tok_s=300.0, **row)]
    priced = with_bandwidth_share(rows, 3_000_000_000, 4800.0)
    assert priced[0].bandwidth_share == pytest.approx(0.25) and priced[1].bandwidth_share is None
    assert with_bandwidth_share(rows, 3_000_000_000, None) == rows  # no declared bandwidth: no share


# ----------------------------------------------------------------- the pinned-tree build script


def _tree_module():
    spec = importlib.util.spec_from_file_location("llama_cpp_tree", REPO / "scripts" / "llama-cpp-tree.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_pre_fetched_tree_must_match_its_pins_file_for_file(tmp_path):
    tree = _tree_module()
    src = tmp_path / "src"
    (src / "ggml").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(x)\n")
    (src / "ggml" / "a.c").write_text("int a;\n")
    import hashlib
    pins = {rel: hashlib.sha256((src / rel).read_bytes()).hexdigest() for rel in ("CMakeLists.txt", "ggml/a.c")}
    assert tree.check(src, pins) is None
    (src / "ggml" / "a.c").write_text("int b;\n")
    assert tree.check(src, pins) == "ggml/a.c does not match its pinned sha256"
    (src / "ggml" / "a.c").unlink()
    assert tree.check(src, pins) == "ggml/a.c is missing"
    (src / "ggml" / "a.c").write_text("int a;\n")
    (src / "extra.h").write_text("")
    assert tree.check(src, pins) == "extra.h is not in the pinned tree (1 extra files)"


def test_the_manifest_pins_the_server_and_cuda_sources():
    pins = _tree_module().read_manifest()
    assert {"tools/server/server.cpp", "ggml/src/ggml-cuda/ggml-cuda.cu", "ggml/src/ggml-cpu/ggml-cpu.c",
            "src/llama-model.cpp", "CMakeLists.txt"} <= set(pins)
    assert not any(p.startswith(("docs/", "models/", "tests/", "ggml/src/ggml-vulkan/")) for p in pins)


@pytest.mark.parametrize("args, env, says", [
    (["rocm"], {}, "backend 'rocm' is not one of cpu, cuda"),
    (["cuda"], {"LANEBENCH_CUDA_ARCHS": "90;$(id)"}, "is not a ';'-separated list of CUDA architectures"),
])
def test_build_script_refuses_bad_backends_in_one_line(tmp_path, args, env, says):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "build-llama-cpp.sh"), *args], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "LANEBENCH_CACHE": str(tmp_path), **env})
    assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
