"""The acceptance probe agrees with what llama-server itself logs for the same requests.

llama-server prints, per request, `draft acceptance = R (A accepted / G generated), mean
len = L`, where L = 1 + A / (its verification steps). The probe computes acceptance from
counter deltas over its window. Both must describe the same requests.
"""

from __future__ import annotations

import re
import uuid

import pytest

from conftest import REPO, shipped_inventory
from tasks.wire.records import RequestRecord
from tasks.record.run_folder import RunFolder
from tasks.serving import live
from tasks.stages.acceptance import acceptance_probe
from tasks.stages.boot import start, stop, wait_healthy
from tasks.inventory.models import Inventory
from tasks.client.prompts import load_prompts

_LINE = re.compile(r"draft acceptance = [0-9.]+ \(\s*(\d+) accepted /\s*(\d+) generated\), mean len =\s*([0-9.]+)")


@pytest.fixture(scope="module")
def server(llama_bin, tmp_path_factory):
    inv = Inventory.model_validate(shipped_inventory())
    lane = inv.lanes["rehearsal"]
    lane = lane.model_copy(update={
        "port": 18090,
        "model": lane.model.model_copy(update={"path": str(REPO / lane.model.path)}),
        "drafter": lane.drafter.model_copy(update={"path": str(REPO / lane.drafter.path)}),
    })
    srv = start("rehearsal", lane, str(llama_bin / "llama-server"), "127.0.0.1",
                tmp_path_factory.mktemp("log") / "boot.log")
    handles = live.register("rehearsal")  # as served_lane does: the probe checks the server between windows
    try:
        wait_healthy(srv, lane, 60)
        handles.server = srv
        yield srv, lane
    finally:
        live.forget("rehearsal", handles)
        stop(srv)


@pytest.mark.parametrize("prompt_class", ["prose", "code"])
def test_probe_matches_server_log(server, prefect_harness, prompt_class, tmp_path):
    srv, lane = server
    prompts = load_prompts(REPO / f"testbed/prompts/{prompt_class}.jsonl", 6)
    offset = len(srv.log())
    run = RunFolder(tmp_path, "nightly", str(uuid.uuid4()), REPO / "hosts.yaml")
    rows, silent = acceptance_probe(srv.endpoint, str(run.path), lane.speculative.k, {prompt_class: prompts},
                                    max_tokens=64, repeats=1)
    kept = (run.path / "rehearsal" / "requests.jsonl").read_text().splitlines()
    records = [RequestRecord.model_validate_json(line) for line in kept]
    assert not silent and len(rows) == 1
    row = rows[0]
    lines = _LINE.findall(srv.log()[offset:])
    assert len(lines) == len(prompts) == len(records)
    accepted = sum(int(a) for a, _, _ in lines)
    generated = sum(int(g) for _, g, _ in lines)
    # Same requests, same totals: the counters' window holds exactly these requests.
    assert row.accepted == accepted
    assert sum(r.spec["draft_n"] for r in records) == generated
    assert sum(r.spec["draft_n_accepted"] for r in records) == accepted
    # Verification steps per request recovered from the logged mean length (printed to 2 decimals).
    steps = sum(int(a) / (float(mean) - 1.0) for a, _, mean in lines if float(mean) > 1.0)
    assert row.acceptance_length == pytest.approx(1.0 + accepted / steps, abs=0.05)
    assert row.acceptance_length == pytest.approx(1.0 + row.accepted / row.verify_steps)
    curve = row.per_position
    assert len(curve) == lane.speculative.k and all(a >= b for a, b in zip(curve, curve[1:]))
    # Per-position rates add up to the accepted tokens per step.
    assert sum(curve) == pytest.approx(row.accepted / row.verify_steps)
