"""One host list per lane: the nightly and the KL gate lock the same hosts for a lane across nodes.

A vLLM lane on two local hosts (127.0.0.1 and 127.0.0.2) that declares no engine binary:
preflight skips it within seconds, once it has checked both nodes, after the lane took its hosts' lock. Each flow runs
from the CLI, as a user runs it; the lock each held is read back from its run folder. The KL
gate once locked only the lane's host and its RPC workers, leaving the other node open to a
second job while the lane's rank 1 ran there.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from conftest import REPO, manifest_of, run_cli, run_folder_of, write_inventory

PAIR = {"host": "nodea", "engine": "vllm", "port": 18321, "model": {"path": "model"},
        "bench": {"decode": {"concurrency": [1], "prompts": "testbed/prompts/prose.jsonl"}},
        "nodes": {"hosts": ["nodea", "nodeb"], "port": 29621}}


def _inventory(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "model").write_bytes(b"x")
    return write_inventory(folder, {"hosts": {"nodea": {"address": "127.0.0.1"}, "nodeb": {"address": "127.0.0.2"}},
                                    "lanes": {"pair": PAIR}})


def test_kl_locks_the_hosts_the_nightly_locks_for_a_lane_across_nodes(tmp_path):
    hosts = _inventory(tmp_path / "inv")
    kl = tmp_path / "pair-kl.yaml"
    kl.write_text(yaml.safe_dump({"inventory": str(hosts), "prompts": str(REPO / "kl" / "prompts.jsonl"),
                                  "reference": "ref", "candidates": ["cand"],
                                  "lanes": {"ref": {"lane": "pair"}, "cand": {"lane": "pair", "port": 18322}},
                                  "bars": {"max_mean_abs_dlogprob": 0.05, "max_argmax_flip_share": 0.05}}))

    night = run_cli("nightly", "--hosts", str(hosts), "--lane", "pair", "--artifacts", str(tmp_path / "a"))
    assert night.returncode == 3, night.stdout + night.stderr  # skipped by preflight: nothing measured
    lane = manifest_of(run_folder_of(night))["lanes"]["pair"]
    assert lane["status"] == "skipped" and "no binary" in lane["reason"], lane["reason"]

    gate = run_cli("kl", str(kl), "--artifacts", str(tmp_path / "b"))
    assert gate.returncode == 1, gate.stdout + gate.stderr  # the reference could not run: no verdict
    ref = manifest_of(run_folder_of(gate))["lanes"]["ref"]
    assert ref["status"] == "skipped" and ref["reason"] == lane["reason"]

    assert lane["host_lock"]["limit"] == ref["host_lock"]["limit"] == "gpu:nodea,gpu:nodeb"
