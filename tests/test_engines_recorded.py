"""SGLang and vLLM adapters against recorded boot logs, /metrics windows and streams.

The fixtures reproduce the engines' real formats (tests/fixtures/engines/README.md says from
where); every expected number below is worked out by hand from the fixture values.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from tasks.inventory.models import Lane
from tasks.engines import engine_for
from tasks.engines.sglang import SGLang, sglang_method
from tasks.engines.vllm import VLLM, counter_by_position, vllm_method
from tasks.wire.records import RequestRecord, StreamEvent
from tasks.engines.facts import Metrics

FIX = Path(__file__).resolve().parent / "fixtures" / "engines"


def read(engine: str, name: str) -> str:
    return (FIX / engine / name).read_text()


def events(engine, name: str) -> list[StreamEvent]:
    out = []
    for line in read(engine.name, name).splitlines():
        event = engine.parse_sse_line(line)
        if event is not None:
            out.append(event)
    return out


def final(evts: list[StreamEvent]) -> StreamEvent:
    """What tasks/load.py keeps: the first done event that carries the completion count."""
    return next(e for e in evts if e.done and e.completion_tokens is not None)


def record(done: StreamEvent, i: int) -> RequestRecord:
    return RequestRecord(lane="l", stage="acceptance", repeat=1, concurrency=1, prompt_class="prose",
                         prompt_id=f"p{i}", nonce=f"n{i}", max_tokens=64, ok=True, started_at=0.0,
                         output_tokens=done.completion_tokens or 0, finish_reason=done.finish_reason, spec=done.spec)


def lane(**over) -> Lane:
    base = {
        "host": "gb300", "engine": "sglang", "port": 18080, "slots": 8, "context": 4096,
        "model": {"path": "/models/GLM-5.3-Flash-NVFP4"},
        "bench": {"decode": {"prompts": "prompts/prose.jsonl"}},
    }
    base.update(over)
    return Lane.model_validate(base)


SPEC_LANE = {"drafter": {"path": "/models/DFlash2-drafter"}, "speculative": {"method": "DFLASH", "k": 7},
             "flags": ["--max-mamba-cache-size", "48", "--tool-call-parser", "glm47"]}


def assert_non_increasing(rates: list[float]) -> None:
    assert all(a >= b for a, b in pairwise(rates)), rates


def test_registry_returns_the_adapters():
    assert isinstance(engine_for("sglang"), SGLang)
    assert isinstance(engine_for("vllm"), VLLM)


# ---------------------------------------------------------------------------------------- SGLang


def test_sglang_boot_facts_read_the_resolved_cap_not_the_flags():
    facts = SGLang().boot_facts(read("sglang", "boot.log"))
    assert facts.max_running_requests == 7  # the mamba cap; server_args asked for None
    assert facts.context_per_slot == 4096
    assert facts.speculative_type == "DFLASH"
    assert facts.draft_model_loaded is True
    assert facts.extra["draft_model_type"] == "DFlashDraftModel"
    assert facts.extra["draft_model_path"] == "/models/DFlash2-drafter"
    assert facts.extra["max_mamba_cache_size"] == 38
    assert facts.extra["mamba_state_slots_per_request"] == 5
    assert facts.extra["max_total_num_tokens"] == 576000
    assert "requested_max_running_requests" not in facts.extra


def test_sglang_seed_line_caps_below_the_scheduler_line():
    # The seeds' report quotes the line wrapped over two lines; the scheduler line says 48.
    log = (
        "[2026-09-30 11:02:41] max_running_requests is capped to 7 by the mamba state cache\n"
        "(max_mamba_cache_size=38, 5 state slots per request)\n"
        "[2026-09-30 11:02:58] max_total_num_tokens=134016, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        "max_running_requests=48, context_len=1048576, available_gpu_mem=21.40 GB\n"
    )
    facts = SGLang().boot_facts(log)
    assert facts.max_running_requests == 7
    assert facts.context_per_slot == 1048576


def test_sglang_scheduler_line_alone_and_data_parallel_replicas():
    one = SGLang().boot_facts("[2026-10-01 08:00:00 TP0] max_total_num_tokens=500000, chunked_prefill_size=8192, "
                              "max_prefill_tokens=16384, max_running_requests=48, context_len=8192, "
                              "available_gpu_mem=30.10 GB\n")
    assert (one.max_running_requests, one.context_per_slot, one.draft_model_loaded) == (48, 8192, False)
    assert one.speculative_type is None
    two = SGLang().boot_facts(
        "[2026-10-01 08:00:00 DP0 TP0] max_running_requests is capped to 12 by the mamba state cache "
        "(max_mamba_cache_size=64, 5 state slots per request). To raise it: ...\n"
        "[2026-10-01 08:00:00 DP1 TP0] max_running_requests is capped to 12 by the mamba state cache "
        "(max_mamba_cache_size=64, 5 state slots per request). To raise it: ...\n"
        "[2026-10-01 08:00:05 DP0 TP0] max_total_num_tokens=500000, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        "max_running_requests=12, context_len=8192, available_gpu_mem=30.10 GB\n"
        "[2026-10-01 08:00:05 DP1 TP0] max_total_num_tokens=500000, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        "max_running_requests=12, context_len=8192, available_gpu_mem=30.10 GB\n")
    assert two.max_running_requests == 24
    assert SGLang().boot_facts("nothing resolved yet\n").max_running_requests is None


def test_sglang_info_facts_fill_only_what_the_log_left_out():
    eng, info = SGLang(), json.loads(read("sglang", "server_info.json"))
    from_info = eng.info_facts(eng.boot_facts(""), info)
    assert (from_info.max_running_requests, from_info.speculative_type, from_info.context_per_slot) == (7, "DFLASH", 4096)
    assert from_info.extra["version"] == "0.5.21"
    logged = eng.boot_facts("[2026-10-01 08:00:00] max_total_num_tokens=1, chunked_prefill_size=8192, "
                            "max_prefill_tokens=16384, max_running_requests=5, context_len=2048, available_gpu_mem=1.00 GB\n")
    kept = eng.info_facts(logged, {**info, "dp_size": 2})
    assert (kept.max_running_requests, kept.context_per_slot) == (5, 2048)
    assert eng.info_facts(eng.boot_facts(""), {**info, "dp_size": 2}).max_running_requests == 14


def test_sglang_stream_parses_deltas_finish_reasons_and_final_counts():
    eng = SGLang()
    stop = events(eng, "stream_stop.sse")
    assert len(stop) == 22  # 21 chunks (prefill token + 20 verify steps) and [DONE]
    assert [e.done for e in stop[:21]] == [False] * 20 + [True]
    assert all(e.spec is None for e in stop[:20])  # cumulative spec on mid chunks is not taken
    assert stop[0].text == " The" and stop[1].text == " river bends" and stop[1].tokens == 2
    assert sum(e.tokens for e in stop) == 52
    text = "".join(e.text for e in stop)
    assert text.startswith(" The river bends south of the old mill") and "river" not in text[12:]
    end = final(stop)
    assert (end.finish_reason, end.completion_tokens, end.prompt_tokens) == ("stop", 52, 37)
    assert end.spec == {"spec_verify_ct": 20.0, "spec_correct_drafts_histogram": [6.0, 5.0, 4.0, 3.0, 1.0, 1.0],
                        "spec_num_correct_drafts": 31.0, "spec_num_proposed_drafts": 140.0}

    length = events(eng, "stream_length.sse")
    end = final(length)
    assert (end.finish_reason, end.completion_tokens, end.prompt_tokens) == ("length", 64, 41)
    assert sum(e.tokens for e in length) == 64
    assert end.spec is not None and end.spec["spec_verify_ct"] == 24.0 and end.spec["spec_num_correct_drafts"] == 39.0


def test_sglang_older_field_names_and_errors():
    eng = SGLang()
    old = eng.parse_event({"text": "", "output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort", "message": "x"}, "completion_tokens": 3, "prompt_tokens": 5,
        "spec_verify_ct": 2, "spec_accept_histogram": [0, 1, 1]}})
    assert old.done and old.finish_reason == "abort"
    assert old.spec == {"spec_verify_ct": 2.0, "spec_correct_drafts_histogram": [0.0, 1.0, 1.0],
                        "spec_num_correct_drafts": 3.0}
    oldest = eng.parse_event({"text": "", "meta_info": {"finish_reason": {"type": "length", "length": 9},
                              "spec_verify_ct": 4, "spec_accept_token_num": 5, "spec_draft_token_num": 28}})
    assert oldest.spec == {"spec_verify_ct": 4.0, "spec_num_correct_drafts": 5.0, "spec_num_proposed_drafts": 28.0}
    no_spec = eng.parse_event({"text": "x", "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                               "completion_tokens": 1}})
    assert no_spec.spec is None and no_spec.finish_reason == "stop"
    err = eng.parse_event({"error": {"message": "boom"}})
    assert err.done and err.finish_reason == "error"


def test_sglang_acceptance_from_the_requests_in_the_window():
    eng = SGLang()
    recs = [record(final(events(eng, name)), i) for i, name in enumerate(["stream_stop.sse", "stream_length.sse"])]
    before, after = eng.metrics(read("sglang", "metrics_before.prom")), eng.metrics(read("sglang", "metrics_after.prom"))
    acc = eng.acceptance(before, after, recs, 7)
    assert acc is not None and acc.source == "requests"
    # steps 20 + 24 = 44; accepted 31 + 39 = 70; proposed 7 per step.
    assert (acc.verify_steps, acc.accepted, acc.draft_tokens) == (44.0, 70.0, 308.0)
    assert acc.acceptance_length == pytest.approx(1 + 70 / 44)
    # Steps keeping > i drafts: stop [6,5,4,3,1,1] -> 14, 9, 5, 2, 1, 0, 0; length [7,6,4,4,2,1] -> 17, 11, 7, 3, 1, 0, 0.
    assert acc.per_position == pytest.approx([31 / 44, 20 / 44, 12 / 44, 5 / 44, 2 / 44, 0.0, 0.0])
    assert sum(acc.per_position) == pytest.approx(acc.accepted / acc.verify_steps)
    assert_non_increasing(acc.per_position)
    # The one SGLang spec counter moved by the same number of verification steps.
    key = 'sglang:spec_verify_calls_total{engine_type="unified",model_name="GLM-5.3-Flash-NVFP4"}'
    assert after.get(key) - before.get(key) == acc.verify_steps


def test_sglang_acceptance_none_without_verification():
    eng = SGLang()
    plain = record(StreamEvent(done=True, completion_tokens=4, finish_reason="stop"), 0)
    assert eng.acceptance(Metrics(), Metrics(), [plain], 4) is None
    zero = record(StreamEvent(done=True, completion_tokens=1, spec={"spec_verify_ct": 0.0}), 1)
    assert eng.acceptance(Metrics(), Metrics(), [zero], 4) is None


def test_sglang_launch_command_with_and_without_speculation():
    eng = SGLang()
    plain = eng.launch_command(lane(), "python3", "0.0.0.0")
    assert plain[:3] == ["python3", "-m", "sglang.launch_server"]
    assert plain[plain.index("--model-path") + 1] == "/models/GLM-5.3-Flash-NVFP4"
    assert plain[plain.index("--port") + 1] == "18080" and plain[plain.index("--host") + 1] == "0.0.0.0"
    assert plain[plain.index("--context-length") + 1] == "4096"
    assert "--enable-metrics" in plain and "--incremental-streaming-output" in plain
    assert not any(a.startswith("--speculative") for a in plain)
    assert "--max-running-requests" not in plain

    spec = eng.launch_command(lane(**SPEC_LANE), "python3", "0.0.0.0")
    i = spec.index("--speculative-algorithm")
    assert spec[i:i + 6] == ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                             "/models/DFlash2-drafter", "--speculative-dflash-block-size", "8"]
    assert spec[-4:] == ["--max-mamba-cache-size", "48", "--tool-call-parser", "glm47"]

    eagle = eng.launch_command(lane(drafter={"path": "/d"}, speculative={"method": "draft-eagle3", "k": 3}), "python3", "h")
    j = eagle.index("--speculative-algorithm")
    assert eagle[j:] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d",
                         "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                         "--speculative-num-draft-tokens", "4"]
    dspark = eng.launch_command(lane(drafter={"path": "/d"}, speculative={"method": "DSPARK", "k": 5}), "python3", "h")
    assert dspark[-2:] == ["--speculative-dspark-block-size", "5"]
    assert [sglang_method(m) for m in ("draft-simple", "mtp", "NEXTN", "eagle")] == ["STANDALONE", "NEXTN", "NEXTN", "EAGLE"]


def test_sglang_request_shape():
    eng = SGLang()
    a, b = eng.completion_request("hello", 96), eng.completion_request("hello", 96)
    assert a.path == "/generate"
    assert a.body["text"] == "hello" and a.body["stream"] is True
    assert a.body["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 96}
    assert isinstance(a.body["extra_key"], str) and a.body["extra_key"] != b.body["extra_key"]
    assert set(a.body) == {"text", "sampling_params", "stream", "extra_key"}


# ------------------------------------------------------------------------------------------ vLLM


def test_vllm_boot_facts():
    facts = VLLM().boot_facts(read("vllm", "boot.log"))
    # max_num_seqs 8, but the KV pool holds floor(3.25) requests of 4,096 tokens.
    assert facts.max_running_requests == 3
    assert facts.context_per_slot == 4096
    assert facts.speculative_type == "dflash"
    assert facts.draft_model_loaded is True
    assert facts.extra.items() >= {"max_num_seqs": 8, "kv_max_concurrency": 3.25, "kv_cache_tokens": 13312,
                                   "version": "0.26.1", "draft_model": "/models/DFlash2-drafter",
                                   "num_spec_tokens": 7, "log_format": "kv-line-gpu"}.items()
    assert facts.version == "0.26.1" and facts.disagreements == []


def test_vllm_boot_facts_other_shapes():
    merged = ("(EngineCore_DP0 pid=9) INFO 10-03 10:08:05 [kv_cache_utils.py:1299] GPU KV cache size: 2,871,094 tokens, "
              "Maximum concurrency for 131,072 tokens per request: 21.90x\n"
              "(APIServer pid=1) INFO 10-03 10:02:11 [api_utils.py:286] non-default args: {'max_num_seqs': 16}\n"
              "(EngineCore_DP0 pid=9) INFO 10-03 10:02:31 [core.py:105] Initializing a V1 LLM engine (v0.29.0) with "
              "config: model='/m', speculative_config=None, tokenizer='/m'\n")
    facts = VLLM().boot_facts(merged)
    assert (facts.max_running_requests, facts.context_per_slot) == (16, 131072)
    assert facts.speculative_type is None and facts.draft_model_loaded is False
    assert facts.extra["kv_cache_tokens"] == 2871094
    mtp = VLLM().boot_facts("speculative_config=SpeculativeConfig(method='mtp', num_spec_tokens=2), tokenizer=x\n"
                            "Using max model len 8192\n")
    assert (mtp.speculative_type, mtp.extra["num_spec_tokens"], mtp.context_per_slot) == ("mtp", 2, 8192)
    assert mtp.max_running_requests is None


def test_vllm_acceptance_from_counter_deltas():
    eng = VLLM()
    before, after = eng.metrics(read("vllm", "metrics_before.prom")), eng.metrics(read("vllm", "metrics_after.prom"))
    acc = eng.acceptance(before, after, [], 7)
    assert acc is not None and acc.source == "counters"
    # drafts 1600-1200, draft tokens 11200-8400, accepted 2140-1610
    assert (acc.verify_steps, acc.draft_tokens, acc.accepted) == (400.0, 2800.0, 530.0)
    assert acc.acceptance_length == pytest.approx(2.325)
    # per position [968-720, 564-420, 306-230, 156-120, 86-70, 48-40, 12-10] / 400
    assert acc.per_position == pytest.approx([0.62, 0.36, 0.19, 0.09, 0.04, 0.02, 0.005])
    assert_non_increasing(acc.per_position)
    assert eng.acceptance(before, before, [], 7) is None
    assert eng.acceptance(before, after, [], 3).per_position == pytest.approx([0.62, 0.36, 0.19])


def test_vllm_counters_summed_over_engines_and_extra_labels():
    def scrape(drafts: tuple[float, float], pos0: tuple[float, float]) -> Metrics:
        text = "".join(
            f'vllm:spec_decode_num_drafts_total{{engine="{e}",model_name="m"}} {d}\n'
            f'vllm:spec_decode_num_drafts_created{{engine="{e}",model_name="m"}} 1.79e9\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="{e}",model_name="m"}} {p}\n'
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="m",position="0"}} {p}\n'
            for e, d, p in zip("01", drafts, pos0))
        return VLLM().metrics(text)

    before, after = scrape((100, 50), (60, 20)), scrape((300, 150), (160, 70))
    assert counter_by_position(after, "vllm:spec_decode_num_drafts") == {"": 450.0}  # _created is not a sample of it
    acc = VLLM().acceptance(before, after, [], 2)
    assert acc is not None
    assert (acc.verify_steps, acc.accepted) == (300.0, 150.0)
    assert acc.per_position == pytest.approx([0.5, 0.0])


def test_vllm_stream_parses_deltas_finish_reasons_and_final_counts():
    eng = VLLM()
    length = events(eng, "stream_length.sse")
    assert [e.tokens for e in length[:7]] == [1, 3, 1, 4, 2, 3, 1]
    assert "".join(e.text for e in length) == " The river bends south of the old mill where the bank rises steeply and the"
    assert [e.done for e in length[:6]] == [False] * 6
    end = final(length)
    assert end is length[6]  # the finish chunk is complete: tasks/load.py stops there
    assert (end.finish_reason, end.completion_tokens, end.prompt_tokens, end.spec) == ("length", 15, 12, None)
    assert length[7].done and length[7].completion_tokens == 15 and length[-1].done  # usage chunk, [DONE]

    stop = events(eng, "stream_stop.sse")
    end = final(stop)
    assert (end.finish_reason, end.completion_tokens, end.prompt_tokens) == ("stop", 3, 15)
    assert "".join(e.text for e in stop) == " Paris."
    err = eng.parse_event({"error": {"message": "x", "type": "BadRequestError", "code": 400}})
    assert err.done and err.finish_reason == "error"


def test_vllm_launch_command_with_and_without_speculation():
    eng = VLLM()
    plain = eng.launch_command(lane(engine="vllm"), "vllm", "127.0.0.1")
    assert plain[:3] == ["vllm", "serve", "/models/GLM-5.3-Flash-NVFP4"]
    assert plain[plain.index("--max-model-len") + 1] == "4096" and plain[plain.index("--max-num-seqs") + 1] == "8"
    assert plain[plain.index("--port") + 1] == "18080" and plain[plain.index("--host") + 1] == "127.0.0.1"
    assert "--speculative-config" not in plain

    spec = eng.launch_command(lane(engine="vllm", **SPEC_LANE), "/opt/venv/bin/vllm", "0.0.0.0")
    config = json.loads(spec[spec.index("--speculative-config") + 1])
    assert config == {"method": "dflash", "model": "/models/DFlash2-drafter", "num_speculative_tokens": 7}
    assert spec[-4:] == SPEC_LANE["flags"]
    assert [vllm_method(m) for m in ("EAGLE3", "draft-simple", "NEXTN", "draft-dflash")] == \
        ["eagle3", "draft_model", "mtp", "dflash"]


def test_vllm_request_shape():
    eng = VLLM()
    a, b = eng.completion_request("hello", 64), eng.completion_request("hello", 64)
    assert a.path == "/v1/completions"
    assert {k: v for k, v in a.body.items() if k != "cache_salt"} == {
        "prompt": "hello", "max_tokens": 64, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "return_token_ids": True}
    assert a.body["cache_salt"] != b.body["cache_salt"]


@pytest.mark.parametrize("engine,name", [("vllm", "0.32.0-cpu/ngram/stream_0.sse"), ("vllm", "stream_length.sse"),
                                         ("sglang", "0.5.23/dflash_block7/stream_stop.sse"), ("sglang", "stream_length.sse")])
def test_a_released_engines_stream_is_decoded_whole_as_event_by_event(engine, name):
    """The client's hot path (Engine.stream_tokens: a read's token events in one decode) takes the
    streams the releases wrote whole, not through the event-by-event fallback, and reads each
    event as stream_token does: a token_chunk that no longer fits the release would fall back
    silently, and the client would lose its speed without a wrong number to show it."""
    adapter = engine_for(engine)
    raws = [e for e in read(engine, name).replace("\r\n", "\n").encode().split(b"\n\n") if e.strip()]
    whole = adapter.stream_tokens(raws)
    assert whole is not None
    assert whole == [adapter.stream_token(r) for r in raws]
    assert sum(t is not None for t in whole) >= len(raws) - 3
