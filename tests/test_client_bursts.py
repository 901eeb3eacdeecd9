"""The client when a batching server ends many streams in one step (issue 23).

llama-server on a GPU writes one event to every stream in the same decode step and ends a
wave's streams together. The client must then send the next requests at once and keep the
finished ones' records later, one per loop turn, not all in the turn they ended in (that turn
held the loop 10-20 ms at C=64 on an H200 and fired the client-bound flag). A real HTTP server
process (benchmarks/fake_server.py, `--step-ms`: every event on one shared grid) and a slow
record keeper (a disk at 20 ms a write) show it.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tasks.client.load import Wave, run_wave
from tasks.client.prompts import Prompt
from tasks.wire.records import RequestRecord
from tasks.engines import engine_for
from tests.conftest import REPO, fake_server

PORT = 18653
STEP_MS = 20.0
SLOW_WRITE_S = 0.02
VLLM = engine_for("vllm")


@pytest.fixture(scope="module")
def stepping():
    with fake_server(PORT, "--ttft-ms", "5", "--itl-ms", str(STEP_MS), "--step-ms", str(STEP_MS)) as url:
        yield url


def test_streams_ending_in_one_step_send_on_before_their_records_are_kept(stepping):
    kept: list[tuple[float, RequestRecord]] = []

    def slow_keeper(record: RequestRecord) -> None:
        time.sleep(SLOW_WRITE_S)  # a slow disk: 16 of these in one loop turn would hold it 320 ms
        kept.append((time.perf_counter(), record))

    c = 16
    wave = Wave(lane="l", stage="decode", repeat=1, concurrency=c, requests_per_stream=2, max_tokens=8, stall_s=5.0)
    prompts = [Prompt(id=f"p{i}", prompt_class="t", text=f"prompt {i}") for i in range(c)]
    result = run_wave(stepping, VLLM, wave, prompts, slow_keeper)
    assert len(result.records) == 2 * c and all(r.ok for r in result.records), [r.error for r in result.records]
    # Every record reached the keeper once; the first stream's records all before the second's.
    assert sorted(r.nonce for _, r in kept) == sorted(r.nonce for r in result.records)
    first_round = {r.nonce for r in result.records if r.sent_s < min(x.ended_s for x in result.records)}
    assert {r.nonce for _, r in kept[:c]} == first_round
    # Each stream's second request left right after its first ended, not after the records of
    # every stream that ended in the same step were written (up to 16 x 20 ms = 320 ms).
    by_stream: dict[int, list[RequestRecord]] = {}
    for r in result.records:
        by_stream.setdefault(r.stream, []).append(r)
    waits = sorted(b.sent_s - a.ended_s for a, b in (sorted(rs, key=lambda r: r.sent_s) for rs in by_stream.values()))
    assert waits[-1] < 0.15, f"a stream waited {waits[-1] * 1e3:.0f} ms to send its next request: {waits}"
    # The loop never held one slow write per finished stream in a single turn: the lag probe saw
    # at most a few writes' worth (one write a turn; a busy host adds its own delays).
    assert result.loop_lag_max_s < 0.16, f"loop lag max {result.loop_lag_max_s * 1e3:.0f} ms"


def test_the_benchmark_runs_at_tiny_size(tmp_path):
    out = tmp_path / "bursts.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/client_bursts.py"), "--levels", "1,4",
                           "--repeats", "1", "--max-tokens", "8", "--port", str(PORT + 1), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.read_text().count('"concurrency"') == 2
