"""A stream stuck mid-way is cut at the lane's stall bound, not at its wall deadline, and a stream
that ends counting 0 tokens is an error row (issue 27). A real HTTP server process
(benchmarks/fake_server.py) sends the faults."""

from __future__ import annotations

import time

import pytest

from tasks.client.prompts import Prompt
from tasks.client.load import Wave, run_wave
from tasks.engines import engine_for
from tests.conftest import fake_server

PORT = 18647
VLLM = engine_for("vllm")


@pytest.fixture(scope="module")
def fake():
    with fake_server(PORT, "--ttft-ms", "20", "--itl-ms", "5", "--ping-s", "0.05") as url:
        yield url


def _prompts(*texts: str) -> list[Prompt]:
    return [Prompt(id=f"p{i}", prompt_class="t", text=t) for i, t in enumerate(texts)]


def _wave(**kw) -> Wave:
    return Wave(lane="l", stage="decode", repeat=1, concurrency=2, requests_per_stream=1, max_tokens=16, **kw)


def test_a_stream_stuck_mid_way_is_cut_at_the_stall_bound(fake):
    t = time.perf_counter()
    result = run_wave(fake, VLLM, _wave(deadline_s=30.0, stall_s=0.5, first_token_stall_s=2.0),
                      _prompts("ok", "#fault=midstall"))
    took = time.perf_counter() - t
    stalled, fine = sorted(result.records, key=lambda r: r.prompt_id != "p1")
    assert took < 5.0, f"took {took:.1f} s: the 30 s wall deadline fired, not the stall bound"
    assert not stalled.ok and stalled.error.startswith("stall: no token for"), stalled.error
    assert "after" in stalled.error and "token chunks" in stalled.error and "span" in stalled.error
    assert fine.ok and fine.output_tokens == 16


def test_without_a_bound_the_wall_deadline_still_rules(fake):
    result = run_wave(fake, VLLM, _wave(deadline_s=1.0), _prompts("#fault=midstall"))
    assert result.records[0].error.startswith("deadline: no complete response within 1 s")


def test_a_stream_counting_zero_tokens_is_not_ok(fake):
    result = run_wave(fake, VLLM, _wave(), _prompts("#fault=zerocount", "fine"))
    zero, fine = sorted(result.records, key=lambda r: r.prompt_id != "p0")
    assert not zero.ok and zero.error.startswith("no token count"), zero
    assert fine.ok and fine.output_tokens == 16
