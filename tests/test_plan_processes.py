"""`lanebench plan` prints every process as boot starts it: host, argv, environment (secrets
redacted), ports and working directory, from the same functions (tasks/stages/topology.py).

The two-node lanes here run on this machine (two local hosts, 127.0.0.1 and 127.0.0.2) with a
recorder as the engine binary: a real process that writes the argv and environment it was
started with, so the test compares the plan with what boot actually launched, process by
process, through the lane flow's own path (resolved -> placement -> at_rank -> start).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from tasks.engines import engine_for
from tasks.hosts.connect import Reach
from tasks.hosts.transport import LocalTransport
from tasks.inventory.lane_hosts import every_host
from tasks.inventory.load import load_inventory
from tasks.inventory.secrets import REDACTED
from tasks.stages import boot, serve, topology
from tasks.stages.preflight import Preflight

RECORDER = f"""#!{sys.executable}
import json, os, sys, time
print(json.dumps({{"argv": sys.argv, "env": dict(os.environ)}}), flush=True)
time.sleep(60)
"""

HOSTS = {"nodea": {"address": "127.0.0.1", "transport": "local"},
         "nodeb": {"address": "127.0.0.2", "transport": "local"}}


def inventory(tmp_path: Path) -> tuple[Path, Path]:
    recorder = tmp_path / "engine-recorder"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    for name in ("target", "drafter"):
        (tmp_path / name).write_bytes(b"x")
    common = {"host": "nodea", "binary": str(recorder), "model": {"path": str(tmp_path / "target")},
              "drafter": {"path": str(tmp_path / "drafter")}, "bench": {"decode": {"concurrency": [1], "prompts": "p.jsonl"}}}
    lanes = {
        "sglang-pair": {**common, "engine": "sglang", "port": 18311, "speculative": {"method": "draft-eagle3", "k": 3},
                        "flags": ["--tp-size", "2", "--speculative-num-draft-tokens", "4"],
                        "env": {"GLOO_SOCKET_IFNAME": "lo", "HF_TOKEN": "hf_plan_secret_1234"},
                        "nodes": {"hosts": ["nodea", "nodeb"], "port": 29611,
                                  "env": {"nodea": {"NCCL_SOCKET_IFNAME": "enp1s0f0np0"},
                                          "nodeb": {"NCCL_SOCKET_IFNAME": "enp1s0f1np1", "GLOO_SOCKET_IFNAME": "eth9"}}}},
        "vllm-dp-pair": {**common, "engine": "vllm", "port": 18312, "speculative": {"method": "eagle3", "k": 4},
                         # --disable-prefix-caching: an EnableDisableAction inverse the old flag list lacked.
                         "flags": ["--data-parallel-size", "2", "--disable-prefix-caching"],
                         "env": {"VLLM_LOGGING_LEVEL": "DEBUG"},
                         "nodes": {"hosts": ["nodea", "nodeb"], "port": 29612,
                                   "env": {"nodea": {"VLLM_HOST_IP": "127.0.0.1"},
                                           "nodeb": {"VLLM_HOST_IP": "127.0.0.2"}}}},
    }
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": HOSTS, "lanes": lanes}))
    return path, recorder


def launched(name: str, path: Path, recorder: Path, tmp_path: Path) -> dict[str, dict]:
    """Start the lane's processes as the lane flow does (resolved -> placement -> the boot task's
    start) and read what each was started with, by host."""
    inv = load_inventory(path, engine_for)
    lane = inv.lanes[name]
    host = inv.hosts[lane.host]
    workers = [n for _, n in topology.worker_ranks(lane)]
    pre = Preflight(ok=True, binary=str(recorder), master=topology.master_address(lane, inv),
                    node_binaries={n: str(recorder) for n in workers})
    served_as = serve.resolved(lane, host, path.parent, pre)
    reach = Reach(lane.host, {n: LocalTransport(n) for n in every_host(lane)})
    placement = serve.placement(served_as, host, reach, pre, inv)
    log = tmp_path / name / "boot.log"
    server = boot.start(name, served_as, pre.binary, host.address, log, placement)
    try:
        logs = {lane.host: log, **{n: log.with_name(f"worker-{n}.log") for n in workers}}
        deadline = time.monotonic() + 30
        while not all(p.exists() and p.read_text().strip() for p in logs.values()):
            assert time.monotonic() < deadline, "the recorder never wrote"
            time.sleep(0.1)
        return {host_name: json.loads(p.read_text().splitlines()[0]) for host_name, p in logs.items()}
    finally:
        boot.stop(server, grace_s=2.0)


def test_plan_argv_is_what_boot_launches_with_offload_flags(tmp_path, capsys):
    """A llama.cpp lane on a GPU host: boot adds the offload its host implies (every layer of
    target and drafter on the GPU), and the plan prints that very argv, token for token."""
    path, recorder = inventory(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["hosts"]["gpubox"] = {"address": "127.0.0.1", "transport": "local", "gpus": 1}
    data["lanes"] = {"llamacpp-gpu": {
        "host": "gpubox", "engine": "llamacpp", "binary": str(recorder), "port": 18313,
        "model": {"path": str(tmp_path / "target")}, "drafter": {"path": str(tmp_path / "drafter")},
        "speculative": {"method": "draft-simple", "k": 4}, "bench": {"decode": {"concurrency": [1], "prompts": "p.jsonl"}}}}
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", "--hosts", str(path), "--json", "llamacpp-gpu"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)
    (server,) = plan["processes"]
    assert server["argv"][-4:] == ["--n-gpu-layers", "all", "--n-gpu-layers-draft", "all"]
    real = launched("llamacpp-gpu", path, recorder, tmp_path)["gpubox"]
    assert server["argv"] == real["argv"]
    assert real["env"].get("CUDA_VISIBLE_DEVICES") != ""  # a GPU host's server is not hidden from its GPUs


@pytest.mark.parametrize("name", ["sglang-pair", "vllm-dp-pair"])
def test_plan_shows_every_process_as_boot_launches_it(tmp_path, capsys, name):
    path, recorder = inventory(tmp_path)
    assert main(["plan", "--hosts", str(path), "--json", name]) == 0
    (plan,) = json.loads(capsys.readouterr().out)
    assert plan["problems"] == [] and plan["skipped"] is None
    started = launched(name, path, recorder, tmp_path)
    assert [p["host"] for p in plan["processes"]] == ["nodea", "nodeb"]
    for proc in plan["processes"]:
        real = started[proc["host"]]
        assert proc["argv"] == real["argv"]  # the same argv, token for token
        assert proc["env"] and proc["cwd"] == os.getcwd()
        for key, value in proc["env"].items():
            assert real["env"][key] == ("hf_plan_secret_1234" if value == REDACTED else value), key
    head, node = plan["processes"]
    lane = load_inventory(path, engine_for).lanes[name]
    assert head["env"] == {**lane.env, **lane.nodes.env["nodea"]} | ({"HF_TOKEN": REDACTED} if "HF_TOKEN" in lane.env else {})
    assert node["env"] == {**lane.env, **lane.nodes.env["nodeb"]} | ({"HF_TOKEN": REDACTED} if "HF_TOKEN" in lane.env else {})
    assert "hf_plan_secret_1234" not in json.dumps(plan)
    if name == "vllm-dp-pair":
        # The head listens for the other node's engines on the data-parallel RPC port (vLLM's default).
        assert list(zip(head["ports"], head["port_uses"])) == [(18312, "HTTP"), (29612, "rendezvous"),
                                                                (29550, "--data-parallel-rpc-port")]
        assert node["ports"] == [] and node["argv"][-1] == "--headless"
        assert "--disable-prefix-caching" in head["argv"]
    else:
        assert head["ports"] == [18311, 29611] and node["argv"][node["argv"].index("--node-rank") + 1] == "1"
        assert plan["drafting"].startswith("EAGLE3, K=3 draft tokens per verification step (--speculative-num-steps 3)")
        # SGLang drafter lanes get the implied gates (tasks/stages/safety.py), and the plan lists them.
        assert "counter drafts-happen (implied): metric sglang:spec_verify_calls_total increase over a probe > 0" \
            in plan["gates"]
        assert any(g.startswith("draft-width (implied)") and "K=3" in g for g in plan["gates"])


def test_plan_text_prints_env_ports_and_working_directory(tmp_path, capsys):
    path, _ = inventory(tmp_path)
    assert main(["plan", "--hosts", str(path)]) == 0
    out = capsys.readouterr().out
    assert "env: GLOO_SOCKET_IFNAME=lo HF_TOKEN=REDACTED NCCL_SOCKET_IFNAME=enp1s0f0np0" in out
    assert "env: GLOO_SOCKET_IFNAME=eth9 HF_TOKEN=REDACTED NCCL_SOCKET_IFNAME=enp1s0f1np1" in out
    assert "env: VLLM_LOGGING_LEVEL=DEBUG VLLM_HOST_IP=127.0.0.2" in out
    assert "ports 18312 (HTTP), 29612 (rendezvous), 29550 (--data-parallel-rpc-port)" in out
    assert f"working directory: {os.getcwd()}" in out and "hf_plan_secret_1234" not in out


def test_a_node_env_for_a_host_outside_the_nodes_is_refused(tmp_path, capsys):
    path, _ = inventory(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["lanes"]["vllm-dp-pair"]["nodes"]["env"]["nodec"] = {"VLLM_HOST_IP": "127.0.0.3"}
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", "--hosts", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "lanes.vllm-dp-pair.nodes" in err and "nodes.env names host 'nodec'" in err
