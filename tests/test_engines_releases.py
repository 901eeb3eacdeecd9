"""SGLang 0.5.23 and vLLM 0.33.0 boot logs, read per release, in the shapes users run.

Fixtures under tests/fixtures/engines/<engine>/<version>/ follow each release's own format
strings (tests/fixtures/engines/README.md names file and line); expected numbers are worked
out by hand from the fixture values.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.engines.facts import BootFacts
from tasks.engines.releases import Format, formats_for, version_key
from tasks.engines.sglang import SGLang
from tasks.engines.vllm import VLLM

FIX = Path(__file__).resolve().parent / "fixtures" / "engines"


def text(*parts: str) -> str:
    return FIX.joinpath(*parts).read_text()


def sglang_boot(shape: str) -> BootFacts:
    eng = SGLang()
    log, info = text("sglang", "0.5.23", shape, "boot.log"), None
    if (FIX / "sglang" / "0.5.23" / shape / "server_info.json").exists():
        info = json.loads(text("sglang", "0.5.23", shape, "server_info.json"))
    facts = eng.boot_facts(log, eng.version_of(log, info))
    return eng.info_facts(facts, info) if info is not None else facts


def test_release_ranges():
    assert version_key("0.5.23rc1") == (0, 5, 23) and version_key("v0.33.0") == (0, 33, 0)
    new, old = Format(name="new", since="0.5.23"), Format(name="old", until="0.5.23")
    assert [f.name for f in formats_for([new, old], "0.5.23")] == ["new"]
    assert [f.name for f in formats_for([new, old], "0.5.21")] == ["old"]
    assert [f.name for f in formats_for([new, old], None)] == ["new", "old"]


def test_sglang_0523_plain_tp_dflash_reads_the_flat_server_args():
    facts = sglang_boot("tp_dflash")
    assert facts.version == "0.5.23" and facts.extra["log_format"] == "server-args-dict"
    assert facts.max_running_requests == 9  # 48 // 5, the mamba cap; one worker
    assert facts.sources["max_running_requests"] == {"log": 9, "server_info": 9} and facts.disagreements == []
    assert facts.speculative_type == "DFLASH" and facts.draft_model_loaded
    assert facts.extra["draft_model_path"] == "/models/GLM-5.3-Flash-DFlash2"
    assert facts.extra["draft_model_type"] == "DFlashDraftModel"
    assert facts.context_per_slot == 1048576 and facts.parallel["tp_size"] == 2


def test_sglang_0523_attention_dp_cap_is_per_worker_times_workers():
    # Only DP0's TP0 prints the summary (64 per worker); four attention-DP workers serve 256.
    facts = sglang_boot("attn_dp_eagle")
    assert facts.max_running_requests == 256 and facts.parallel["dp_workers"] == 4
    assert facts.sources["max_running_requests"] == {"log": 256, "server_info": 256}
    assert facts.speculative_type == "EAGLE3" and facts.draft_model_loaded
    assert facts.extra["draft_model_type"] == "LlamaForCausalLMEagle3"
    assert facts.extra["requested_max_running_requests"] == 256


def test_sglang_0523_plain_dp_with_pp_attn_cp_and_milliseconds():
    # Every PP stage's TP0 prints the summary: 4 lines, but 2 replicas of 32.
    facts = SGLang().boot_facts(text("sglang", "0.5.23", "dp_pp_ms", "boot.log"))
    assert facts.max_running_requests == 64 and facts.context_per_slot == 32768
    assert facts.parallel == {"dp_workers": 2, "tp_size": 2, "pp_size": 2, "attn_cp_size": 2, "nnodes": 1}
    assert facts.speculative_type is None and not facts.draft_model_loaded
    assert facts.extra["mamba_capped_to"] == 32


def test_sglang_sources_disagree_and_the_lowest_cap_wins():
    eng = SGLang()
    log = text("sglang", "0.5.23", "tp_dflash", "boot.log")
    info = json.loads(text("sglang", "0.5.23", "tp_dflash", "server_info.json"))
    info["internal_states"][0]["effective_max_running_requests_per_dp"] = 7
    info["speculative_algorithm"] = "EAGLE"
    facts = eng.info_facts(eng.boot_facts(log, "0.5.23"), info)
    assert facts.max_running_requests == 7 and facts.cap_source == "server_info"
    assert any("running-request cap: log 9, server_info 7" in d for d in facts.disagreements)
    assert any(d.startswith("speculation type") for d in facts.disagreements)
    # The target loaded on every rank and no draft worker did: a drafter lane without its drafter.
    lost = eng.boot_facts("\n".join(l for l in log.splitlines() if "DFlashDraftModel" not in l), "0.5.23")
    assert lost.draft_model_loaded is False and lost.sources["draft_model_loaded"] == {"log": False}


def test_sglang_older_repr_still_reads_and_version_picks_the_format():
    old = text("sglang", "boot.log")  # the pre-0.5.23 ServerArgs(...) repr
    facts = SGLang().boot_facts(old, "0.5.21")
    assert facts.extra["log_format"] == "server-args-repr" and facts.speculative_type == "DFLASH"
    # A 0.5.23 server whose log printed only the old repr: the dict format is not found, nothing invented.
    assert SGLang().boot_facts(old, "0.5.23").speculative_type is None


def vllm_boot(shape: str, version: dict | None = None) -> BootFacts:
    eng = VLLM()
    log = text("vllm", "0.33.0", shape, "boot.log")
    facts = eng.boot_facts(log, eng.version_of(log, version))
    return eng.info_facts(facts, version) if version else facts


def test_vllm_0330_two_node_tp2_dflash_under_model_runner_v2():
    facts = vllm_boot("tp2_two_nodes", json.loads(text("vllm", "0.33.0", "version.json")))
    assert facts.version == "0.33.0"
    assert facts.max_running_requests == 8  # min(max_num_seqs 8, floor(9.75))
    assert facts.speculative_type == "dflash" and facts.extra["num_spec_tokens"] == 4
    # V2 prints no "Loading drafter model": the config's word stands, nothing says otherwise.
    assert facts.draft_model_loaded and facts.sources["draft_model_loaded"] == {"config": True}
    assert facts.parallel == {"dp_workers": 1, "tp_size": 2, "pp_size": 1}
    assert VLLM().version_of(text("vllm", "0.33.0", "tp2_two_nodes", "headless.log"), None) == "0.33.0"


def test_vllm_0330_ngram_keeps_its_token_count():
    facts = vllm_boot("ngram")
    assert facts.speculative_type == "ngram" and facts.extra["num_spec_tokens"] == 4
    assert "draft_model" not in facts.extra and not facts.draft_model_loaded
    assert facts.max_running_requests == 16


def test_vllm_0330_draft_model_on_v1_runner_and_data_parallel():
    facts = vllm_boot("draft_model_dp2")
    assert facts.sources["draft_model_loaded"] == {"log": True, "config": True} and facts.draft_model_loaded
    assert facts.max_running_requests == 24 and facts.extra["cap_per_worker"] == 12  # 2 engines x min(16, 12)


def test_vllm_0330_host_offloaded_kv():
    facts = vllm_boot("host_offload")
    assert facts.extra["kv_pool"] == "GPU + host" and facts.extra["kv_cache_tokens"] == 786432
    assert facts.max_running_requests == 6 and facts.context_per_slot == 131072


def test_vllm_v1_runner_without_drafter_line_is_a_disagreement():
    log = text("vllm", "0.33.0", "draft_model_dp2", "boot.log").replace("Loading drafter model...", "")
    facts = VLLM().boot_facts(log, "0.32.1")  # before V2 was the default: the line must be there
    assert facts.draft_model_loaded is False
    assert any(d.startswith("draft model loaded") for d in facts.disagreements)


def test_gates_take_the_most_conservative_reading_and_say_why():
    from tasks.inventory.models import CapacityGate, Lane
    from tasks.record.rows import GateResult
    from tasks.stages.gates import capacity_gate, cross_check_drafts

    eng = SGLang()
    info = json.loads(text("sglang", "0.5.23", "attn_dp_eagle", "server_info.json"))
    info["internal_states"][2]["effective_max_running_requests_per_dp"] = 40  # one worker resolved lower
    facts = eng.info_facts(eng.boot_facts(text("sglang", "0.5.23", "attn_dp_eagle", "boot.log")), info)
    lane = Lane.model_validate({"host": "h", "engine": "sglang", "model": {"path": "/m"},
                                "bench": {"decode": {"prompts": "p.jsonl", "concurrency": [1, 200]}}})
    result = capacity_gate.fn(CapacityGate(kind="capacity"), lane, facts)
    assert not result.passed and result.value == 160  # 40 x 4 workers, not the log's 256
    assert "server_info, the lowest of log 256, server_info 160" in result.detail
    assert "4 data-parallel workers" in result.detail

    vfacts = VLLM().boot_facts(text("vllm", "0.33.0", "tp2_two_nodes", "boot.log"))
    gate = GateResult(gate="drafts-happen", kind="counter", passed=False, value=0.0, op=">", threshold=0.0, detail="d")
    checked = cross_check_drafts(gate, vfacts, drafted=False)
    assert "config says loaded; the counters say it never drafted" in checked.detail
    assert vfacts.draft_model_loaded is False and vfacts.sources["draft_model_loaded"] == {"config": True, "counters": False}
    assert any(d.startswith("draft model loaded") for d in vfacts.disagreements)
