"""`lanebench plan` on the shipped GB300 and Spark-pair example lanes, uncommented into a test inventory.

The plan runs nothing and contacts no host, so these tests are the launch plans themselves:
a two-host vLLM TP2 (head with `--nnodes 2 --node-rank 0 --master-addr`, `--headless` on the
other Spark, per engine-facts.md), and a GB300 SGLang lane whose config-time capacity passes.
The shipped examples once failed their own gates; the old values must be refused up front.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import REPO
from flows.cli import main


def uncommented(tmp_path: Path, edit=lambda text: text) -> Path:
    """hosts.yaml with its commented hosts, link and lanes switched on (placeholder digests filled)."""
    out = []
    for line in (REPO / "hosts.yaml").read_text().splitlines():
        m = re.match(r"^(\s*)# (.*)$", line)
        if m and (m[2].startswith(" ") or re.match(r"[a-z0-9_-]+:", m[2]) or m[2].startswith("- ")):
            line = m[1] + m[2]
        out.append(line)
    text = re.sub(r"<64 hex digits[^>]*>", "a" * 64, "\n".join(out).replace("links: []", "links:"))
    path = tmp_path / "hosts.yaml"
    path.write_text(edit(text) + "\n")
    return path


def plan(capsys, path: Path, *lanes: str) -> tuple[int, list[dict]]:
    code = main(["plan", "--hosts", str(path), "--json", *lanes])
    return code, json.loads(capsys.readouterr().out)


def test_the_spark_pair_plans_a_two_node_vllm_launch(tmp_path, capsys):
    code, (pair,) = plan(capsys, uncommented(tmp_path), "spark-pair")
    assert code == 0 and pair["problems"] == [] and pair["skipped"] is None
    head, worker = pair["processes"]
    assert (head["host"], worker["host"]) == ("spark1", "spark2")
    assert head["where"] == worker["where"] and head["where"].startswith("container vllm/vllm-openai@sha256:")
    for proc, rank in ((head, 0), (worker, 1)):
        argv = proc["argv"]
        assert argv[:2] == ["vllm", "serve"] and argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--master-addr") + 1] == "192.168.100.1"  # spark1's end of spark-roce
        assert argv[argv.index("--max-num-seqs") + 1] == "8"
    assert "--headless" not in head["argv"] and worker["argv"][-1] == "--headless"
    assert head["ports"] == [18080, 29501]
    assert pair["preflight"][0].startswith("link spark-roce: spark1 enp1s0f0np0 192.168.100.1 <-> spark2")
    assert any(line.startswith("host spark2 ") and "model files" in line for line in pair["preflight"])
    assert "at most 8 running requests (--max-num-seqs 8" in pair["capacity"] and pair["capacity"].endswith("passes")
    assert any(g.startswith("counter drafts-happen") for g in pair["gates"])


def test_the_gb300_lane_plans_an_sglang_launch_whose_capacity_passes(tmp_path, capsys):
    code, (gb300,) = plan(capsys, uncommented(tmp_path), "gb300-daily")
    assert code == 0 and gb300["problems"] == []
    (server,) = gb300["processes"]
    argv = server["argv"]
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert argv[argv.index("--speculative-algorithm") + 1] == "DFLASH"
    assert argv[argv.index("--speculative-dflash-block-size") + 1] == "8"  # K=7 plus the anchor token
    assert gb300["capacity"].startswith("at most 48 running requests (--max-mamba-cache-size 240 // 5 state slots")
    assert gb300["capacity"].endswith("passes")


def test_the_old_example_values_fail_before_anything_boots(tmp_path, capsys):
    old = uncommented(tmp_path, lambda t: t.replace('--max-mamba-cache-size, "240"', '--max-mamba-cache-size, "48"')
                      .replace("slots: 8                  # --max-num-seqs", "slots: 4                  # --max-num-seqs"))
    code, plans = plan(capsys, old, "gb300-daily", "spark-pair")
    assert code == 1
    gb300, pair = plans
    assert gb300["problems"] == ["capacity gate: running requests are capped at 9 by the config (--max-mamba-cache-size "
                                 "48 // 5 state slots per request (strategy auto: extra buffer with the overlap "
                                 "scheduler)), below bench concurrency 48. Fix: raise --max-mamba-cache-size to at "
                                 "least 240, or lower bench.decode.concurrency"]
    assert "capped at 4" in pair["problems"][0] and "raise the lane's slots" in pair["problems"][0]
    # The nightly refuses it the same way: one line, exit 2, nothing pulled or booted.
    assert main(["nightly", "--hosts", str(old), "--lane", "gb300-daily"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lanebench: error: {old}: lanes.gb300-daily.flags: running requests")


def test_a_flag_the_release_lacks_and_a_bad_node_list(tmp_path, capsys):
    typo = uncommented(tmp_path, lambda t: t.replace("--enforce-eager]", "--enforce-eagre]"))
    code, (pair,) = plan(capsys, typo, "spark-pair")
    assert code == 1
    assert pair["problems"] == ["head (node 0) on spark1: flag --enforce-eagre is not defined by vllm 0.33.0 "
                                "(tasks/engines/flags/)", "node 1 on spark2: flag --enforce-eagre is not defined by "
                                "vllm 0.33.0 (tasks/engines/flags/)"]
    swapped = uncommented(tmp_path, lambda t: t.replace("hosts: [spark1, spark2]", "hosts: [spark2, spark1]"))
    assert main(["plan", "--hosts", str(swapped)]) == 2
    err = capsys.readouterr().err
    assert "lanes.spark-pair" in err and "head node and must be the lane's host 'spark1'" in err
    unknown = uncommented(tmp_path, lambda t: t.replace("hosts: [spark1, spark2]", "hosts: [spark1, spark3]"))
    assert main(["plan", "--hosts", str(unknown)]) == 2
    assert "lanes.spark-pair.nodes.hosts[1]: names host 'spark3'" in capsys.readouterr().err


def test_the_rehearsal_plan_is_the_command_the_nightly_runs(capsys):
    code = main(["plan", "rehearsal"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("lane rehearsal (llamacpp, 1 process)")
    assert "--spec-type draft-simple --spec-draft-n-max 4" in out and "would be skipped: not for any reason" in out


@pytest.mark.parametrize("lane", ["gb300-daily", "spark-pair"])
def test_plan_text_names_every_section(tmp_path, capsys, lane):
    assert main(["plan", "--hosts", str(uncommented(tmp_path)), lane]) == 0
    out = capsys.readouterr().out
    for section in ("preflight (a failure skips the lane):", "boot facts read:", "gates:", "config-time capacity:"):
        assert section in out


def test_the_lane_flow_places_the_ranks_the_plan_prints(tmp_path, capsys):
    """What `plan` prints is what the lane flow starts: the head's argv and each worker node's."""
    from tasks.stages.serve import placement as _placement
    from tasks.engines import engine_for
    from tasks.hosts.transport import LocalTransport
    from tasks.inventory.load import load_inventory
    from tasks.stages import topology
    from tasks.hosts.connect import Reach
    from tasks.stages.preflight import Preflight

    path = uncommented(tmp_path)
    _, (printed,) = plan(capsys, path, "spark-pair")
    inventory = load_inventory(path, engine_for)
    lane = inventory.lanes["spark-pair"]
    pre = Preflight(ok=True, binary="vllm", master=topology.master_address(lane, inventory))
    reach = Reach("spark1", {"spark1": LocalTransport("spark1"), "spark2": LocalTransport("spark2")})  # not contacted
    placement = _placement(lane, inventory.hosts["spark1"], reach, pre, inventory)
    (worker,) = placement.workers
    assert (worker.host_name, worker.rank, worker.image) == ("spark2", 1, lane.image)
    assert worker.argv == printed["processes"][1]["argv"]
    head = engine_for("vllm").launch_command(topology.at_rank(lane, engine_for("vllm"), 0, pre.master), "vllm",
                                             inventory.hosts["spark1"].address)
    assert head == printed["processes"][0]["argv"]


def test_inverse_flags_the_release_accepts_plan_cleanly(tmp_path, capsys):
    """vLLM's EnableDisableAction inverses were once missing from the flag list: WOULD FAIL, exit 1."""
    path = uncommented(tmp_path, lambda t: t.replace("--enforce-eager]", "--enforce-eager, --disable-prefix-caching, "
                                                     "--no-enable-chunked-prefill, --disable-log-requests]"))
    code, (pair,) = plan(capsys, path, "spark-pair")
    assert code == 0 and pair["problems"] == []
    assert "--disable-prefix-caching" in pair["processes"][0]["argv"]
