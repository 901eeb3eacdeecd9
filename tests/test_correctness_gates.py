"""Correctness gates: agentic smoke, thinking switch, tool gate, needle ladder.

The judges on recorded replies first (no server), then the gates end to end from the CLI on a
real llama-server serving the testbed through its chat template (ports 18530-18539).
"""

from __future__ import annotations

import random
from datetime import datetime

import pandas as pd
import pytest

from conftest import REPO, manifest_of, no_llama_server_left, run_cli, run_folder_of, shipped_inventory, write_inventory
from tasks.wire.replies import ChatReply, ToolCall, parse_openai_chat
from tasks.inventory.models import Agentic, ConfigError, ThinkingSwitch
from tasks.inventory.load import load_inventory
from tasks.engines import engine_for
from tasks.stages.input_files import check_prompt_files
from tasks.engines import engine_for
from tasks.correctness.needles import build, default_rungs, judge
from tasks.correctness.smoke import judge_reasoning, judge_tool_calls
from tasks.correctness.thinking import judge_switch, switch_kwargs
from tasks.correctness.tool_gate import cost_per_1000_solved

# --- judges on recorded replies ------------------------------------------------------------------

CALL = ToolCall(name="get_weather", arguments='{"city": "Paris", "unit": "celsius"}')


def test_smoke_passes_structured_calls_and_names_what_came_back_otherwise():
    assert judge_tool_calls(ChatReply(ok=True, tool_calls=[CALL], finish_reason="tool_calls")).passed
    text = judge_tool_calls(ChatReply(ok=True, finish_reason="stop",
                                      content='{"name": "get_weather", "arguments": {"city": "Paris"}}'))
    assert not text.passed and "came back as text, not as tool_calls" in text.detail
    assert 'content="{\\"name\\": \\"get_weather\\"' in text.detail  # quotes what came back
    refused = judge_tool_calls(ChatReply(ok=False, http_status=500, error="tools param requires --jinja flag"))
    assert not refused.passed and "HTTP 500: tools param requires --jinja flag" in refused.detail
    broken = judge_tool_calls(ChatReply(ok=True, tool_calls=[ToolCall(name="get_weather", arguments="{\"ci")]))
    assert not broken.passed and "not a JSON object" in broken.detail


def test_smoke_wants_reasoning_apart_from_content():
    assert judge_reasoning(ChatReply(ok=True, reasoning="17 x 3 = 51", content="51")).passed
    leaked = judge_reasoning(ChatReply(ok=True, content="<think>17 x 3 is 51</think>51"))
    assert not leaked.passed and "leaked into the content" in leaked.detail
    none = judge_reasoning(ChatReply(ok=True, content="17 x 3 is 51, so 51"))
    assert not none.passed and "no reasoning came back apart" in none.detail


def test_thinking_switch_judge_names_an_ignored_switch():
    effort = ThinkingSwitch.model_validate("reasoning_effort")
    assert (effort.on, effort.off) == ("high", "none")
    thinks = ChatReply(ok=True, reasoning="let me see", content="")
    plain = ChatReply(ok=True, content="no")
    assert judge_switch(effort, thinks, plain).passed
    ignored = judge_switch(effort, thinks, thinks)
    assert not ignored.passed and ignored.gate == "thinking:reasoning_effort"
    assert "reasoning_effort is ignored" in ignored.detail and "reasoning_effort='none'" in ignored.detail
    assert "works backwards" in judge_switch(effort, plain, thinks).detail
    assert "no reasoning with" in judge_switch(effort, plain, plain).detail


def test_thinking_switch_declarations():
    agentic = Agentic.model_validate({"thinking_switch": ["enable_thinking", {"name": "reasoning_effort", "off": "low"}]})
    assert [(s.name, s.on, s.off) for s in agentic.thinking_switch] == [("enable_thinking", True, False),
                                                                        ("reasoning_effort", "high", "low")]
    assert switch_kwargs(agentic, "off") == {"enable_thinking": False}
    assert switch_kwargs(agentic, "default") is None and switch_kwargs(None, "on") is None
    with pytest.raises(ValueError, match="same value"):
        ThinkingSwitch.model_validate({"name": "reasoning_effort", "on": "low", "off": "low"})


def test_agentic_declarations_become_each_engines_flags():
    agentic = Agentic(tools=True, tool_parser="glm47", reasoning=True, reasoning_parser="glm45")
    assert engine_for("sglang").agentic_flags(agentic, "/t.jinja") == [
        "--tool-call-parser", "glm47", "--reasoning-parser", "glm45", "--chat-template", "/t.jinja"]
    assert engine_for("vllm").agentic_flags(agentic, None) == [
        "--enable-auto-tool-choice", "--tool-call-parser", "glm47", "--reasoning-parser", "glm45"]
    assert engine_for("llamacpp").agentic_flags(Agentic(tools=True, reasoning=True), "/t.jinja") == [
        "--jinja", "--chat-template-file", "/t.jinja", "--reasoning-format", "deepseek"]
    assert engine_for("llamacpp").agentic_flags(Agentic(tools=True), None) == []


def test_chat_replies_read_every_engines_reasoning_field():
    body = {"choices": [{"finish_reason": "tool_calls", "message": {
        "content": None, "reasoning": "vLLM calls it reasoning",
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    reply = parse_openai_chat(body)
    assert reply.reasoning == "vLLM calls it reasoning" and reply.content == ""
    assert reply.tool_calls == [ToolCall(name="f", arguments='{"a": 1}')] and reply.prompt_tokens == 9
    body["choices"][0]["message"] = {"content": "x", "reasoning_content": "llama.cpp and SGLang"}
    assert parse_openai_chat(body).reasoning == "llama.cpp and SGLang"


def test_cost_per_1000_solved_matches_the_seeds_pricing():
    # "The held-out pass took 197 seconds at C8, which prices at $0.20 per 1,000 solved ($3.80/hr)": 1,040 solved.
    assert cost_per_1000_solved(197, 1040, 3.80) == pytest.approx(0.20, abs=0.001)
    assert cost_per_1000_solved(197, 0, 3.80) is None and cost_per_1000_solved(197, 5, None) is None


def test_needle_prompts_fit_their_rung_and_carry_the_nonce_first():
    assert default_rungs(512, 32) == [259, 345, 432]
    count = len  # one token per character, like the testbed's byte-level vocabulary
    for kind in ("one_key", "five_keys", "distractors"):
        for target in (259, 345, 432, 4000):
            hay = build(kind, target, "n0nce", count, seed=target)
            assert hay.text.startswith("[n0nce] ") and hay.tokens == len(hay.text) <= target
            assert target - hay.tokens < 60  # within a sentence or so of the rung
            assert all(k in hay.text for k in hay.keys + hay.wrong)
    assert len(build("five_keys", 400, "n", count, 1).keys) == 5
    with pytest.raises(ValueError, match="more than the rung"):
        build("distractors", 100, "n", count, 1)


def test_needle_answers_are_judged_with_truncation_apart():
    assert judge("The key is 48213.", ["48213"], [], "stop") == ("pass", 1)
    assert judge("12345", ["48213"], [], "stop") == ("fail", 0)
    assert judge("Let me look through the text for the", ["48213"], [], "length") == ("truncated", 0)
    assert judge("48213 and 77777", ["48213"], ["77777"], "stop") == ("fail", 1)  # a distractor's key came back
    assert judge("11111 22222 33333 44444", ["11111", "22222", "33333", "44444", "55555"], [], "length") == \
        ("truncated", 4)


# --- configuration errors: one line, exit 2, nothing boots -----------------------------------------


def _inventory(tmp_path, port: int, **lane_changes) -> tuple:
    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    lane["port"] = port
    for key, value in lane_changes.items():
        if value is None:
            lane.pop(key, None)
        else:
            lane[key] = value
    return inv, lane


def test_bad_correctness_inputs_are_config_errors(tmp_path):
    inv, lane = _inventory(tmp_path, 18539)
    lane["correctness"]["needles"] = {"rungs": [256, 600], "max_tokens": 32}
    with pytest.raises(ConfigError, match="needle rung 600 does not fit a context of 512"):
        load_inventory(write_inventory(tmp_path / "a", inv), engine_for)

    inv, lane = _inventory(tmp_path, 18539)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "suite.jsonl").write_text('{"id": "x"\n')
    lane["correctness"]["tool_gate"]["dev"] = "suite.jsonl"
    hosts = write_inventory(tmp_path / "b", inv)
    result = run_cli("nightly", "--hosts", str(hosts), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "lanes.rehearsal.correctness.tool_gate.dev" in result.stderr and "line 1: not JSON" in result.stderr

    inv, lane = _inventory(tmp_path, 18539)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "protocol.yaml").write_text("retries: 2\n")
    lane["correctness"]["tool_gate"]["protocol"] = "protocol.yaml"
    with pytest.raises(ConfigError, match="tool_gate.protocol: .*retries"):
        hosts = write_inventory(tmp_path / "c", inv)
        check_prompt_files(load_inventory(hosts, engine_for), hosts)

    inv, lane = _inventory(tmp_path, 18539)
    del lane["correctness"]["tool_gate"]["held_out"]
    result = run_cli("tools", "--hosts", str(write_inventory(tmp_path / "d", inv)), "--held-out", timeout=120)
    assert result.returncode == 2 and "declares no held-out suite" in result.stderr


# --- end to end on a real llama-server -----------------------------------------------------------


def _lean(lane: dict) -> None:
    """Shorter speed stages: the correctness stages are what these tests look at."""
    lane["bench"]["repeats"] = 1
    lane["bench"]["decode"]["concurrency"] = [1, 2]
    lane["bench"].pop("acceptance", None)
    for bench in ("prefill", "accuracy", "capacity"):  # tests/test_benches.py looks at those
        lane["bench"].pop(bench, None)


def _no_drafter(lane: dict) -> None:
    """A plain target: nothing to draft, so only the capacity gate stays."""
    for key in ("drafter", "speculative"):
        lane.pop(key, None)
    lane["flags"] = []
    lane["gates"] = [{"kind": "capacity"}]


def test_nightly_rehearsal_reports_smoke_tool_gate_and_needles(tmp_path, llama_bin):
    inv, lane = _inventory(tmp_path, 18530)
    _lean(lane)
    hosts = write_inventory(tmp_path, inv)
    result = run_cli("nightly", "--hosts", str(hosts), "--artifacts", str(tmp_path / "artifacts"))
    assert result.returncode == 0, result.stdout + result.stderr
    folder = run_folder_of(result)
    m = manifest_of(folder)
    record = m["lanes"]["rehearsal"]
    assert record["status"] == "passed", record
    assert [g["gate"] for g in record["gates"]] == ["drafts-happen", "capacity", "draft-width (implied)"]  # declared, then the implied width check
    assert "--jinja --chat-template-file" in record["launch_command"]
    assert "--reasoning-format deepseek" in record["launch_command"]
    ledger = m["flow"]["correctness"]["rehearsal"]
    gates = {g["gate"]: g for g in ledger["gates"]}
    assert list(gates) == ["smoke:tool-calls", "smoke:reasoning", "thinking:enable_thinking", "tool-gate:dev", "needles"]
    assert all(g["passed"] for g in gates.values()), gates
    assert "structured tool_calls: get_weather(" in gates["smoke:tool-calls"]["detail"]
    # Each gate's own requests are kept with their time in flight (the overhead benchmark counts
    # them); the tool gate and needles keep theirs in their own tables.
    started = m["flow"]["started_at"]
    for name, n in [("drafts-happen", 1), ("smoke:tool-calls", 1), ("smoke:reasoning", 1), ("thinking:enable_thinking", 2)]:
        sent = (gates.get(name) or next(g for g in record["gates"] if g["gate"] == name))["requests"]
        assert len(sent) == n and all(r["seconds"] > 0 and r["started_at"] > datetime.fromisoformat(started).timestamp() for r in sent), (name, sent)
    assert gates["tool-gate:dev"]["requests"] == [] and record["gates"][1]["requests"] == []  # capacity: no request
    assert "/24 solved" in gates["tool-gate:dev"]["detail"] and "per 1,000 solved" in gates["tool-gate:dev"]["detail"]
    assert "needle ladder:" in gates["needles"]["detail"]
    protocol = ledger["tool_gate"]["protocol"]
    assert protocol["path"] == "toolsuites/protocol.yaml" and len(protocol["sha256"]) == 64
    assert (protocol["temperature"], protocol["tool_choice"], protocol["retries"], protocol["strict"]) == \
        (0.0, "auto", 0, False)
    assert ledger["tool_gate"]["held_out"]["run"] is False  # the nightly never looks at the held-out suite
    kinds = {a["kind"]: a for a in m["artifacts"]}
    assert kinds["tools"]["validation"] == "passed" and kinds["needles"]["validation"] == "passed"
    tools = pd.read_parquet(folder / kinds["tools"]["path"])
    assert list(tools.split) == ["dev"] and int(tools.cases[0]) == 24 and int(tools.accounted[0]) == 24
    assert tools.seconds[0] > 0 and tools.dollars_per_hour[0] == 0.05
    needles = pd.read_parquet(folder / kinds["needles"]["path"])
    assert len(needles) == 9 and set(needles.needle_kind) == {"one_key", "five_keys", "distractors"}
    assert (needles.prompt_tokens <= 512).all() and (needles.outcome != "error").all()
    cases = pd.read_json(folder / "rehearsal" / "tool_cases.jsonl", lines=True)
    assert len(cases) == 24 and cases.kind.isna().sum() == cases.solved.sum()
    page = (folder / "rehearsal" / "correctness.md").read_text()
    report = (folder / "report.md").read_text()
    for heading in ("### Tool-call gate", "### Needle ladder", "smoke:tool-calls", "thinking:enable_thinking"):
        assert heading in page and heading in report
    assert "| testbed-dev.jsonl | dev |" in report and "| one_key | 1 |" in report  # the tool-gate and needle rows
    assert no_llama_server_left(18530)


def test_lane_without_its_tool_template_fails_the_smoke_gate(tmp_path, llama_bin):
    """No chat template declared: llama.cpp falls back to the GGUF's built-in ChatML, which renders
    no tools, so the server has no tool-call format to parse and the call comes back as text (the
    seeds' missing --tool-call-parser, in llama.cpp's terms)."""
    inv, lane = _inventory(tmp_path, 18531)
    _lean(lane)
    del lane["agentic"]["chat_template"]
    hosts = write_inventory(tmp_path, inv)
    result = run_cli("nightly", "--hosts", str(hosts), "--artifacts", str(tmp_path / "artifacts"))
    assert result.returncode == 1, result.stdout + result.stderr
    folder = run_folder_of(result)
    m = manifest_of(folder)
    record = m["lanes"]["rehearsal"]
    assert record["status"] == "failed" and record["stage"] == "boot gates"
    assert "gate 'smoke:tool-calls' failed: a tool request came back as text, not as tool_calls" in record["reason"]
    assert "content=" in record["reason"]  # names what came back
    assert "--chat-template-file" not in record["launch_command"]
    gates = {g["gate"]: g for g in m["flow"]["correctness"]["rehearsal"]["gates"]}
    assert not gates["smoke:tool-calls"]["passed"]
    assert not (folder / "rehearsal" / "decode.parquet").exists()  # measurements stopped
    assert "smoke:tool-calls" in (folder / "report.md").read_text()
    assert no_llama_server_left(18531)


def test_ignored_thinking_switch_fails_with_its_name(tmp_path, llama_bin):
    inv, lane = _inventory(tmp_path, 18532)
    _no_drafter(lane)
    lane["agentic"]["thinking_switch"] = ["enable_thinking", "reasoning_effort"]
    hosts = write_inventory(tmp_path, inv)
    result = run_cli("tools", "--hosts", str(hosts), "--artifacts", str(tmp_path / "artifacts"))
    assert result.returncode == 1, result.stdout + result.stderr
    m = manifest_of(run_folder_of(result))
    record = m["lanes"]["rehearsal"]
    assert record["status"] == "failed" and record["stage"] == "boot gates"
    assert "gate 'thinking:reasoning_effort' failed: thinking switch reasoning_effort is ignored" in record["reason"]
    gates = {g["gate"]: g["passed"] for g in m["flow"]["correctness"]["rehearsal"]["gates"]}
    assert gates == {"smoke:tool-calls": True, "smoke:reasoning": True, "thinking:enable_thinking": True,
                     "thinking:reasoning_effort": False}
    assert "thinking:reasoning_effort" in result.stdout + result.stderr
    assert no_llama_server_left(18532)


def test_tools_command_counts_every_held_out_run(tmp_path, llama_bin):
    inv, lane = _inventory(tmp_path, 18533)
    _no_drafter(lane)
    folder = tmp_path / "inv"
    folder.mkdir()
    for name in ("dev", "held-out"):
        lines = (REPO / "toolsuites" / f"testbed-{name}.jsonl").read_text().splitlines()
        (folder / f"{name}.jsonl").write_text("\n".join(random.Random(7).sample(lines, 4)) + "\n")
    lane["correctness"] = {"tool_gate": {"dev": "dev.jsonl", "held_out": "held-out.jsonl"}}
    hosts = write_inventory(folder, inv)
    artifacts = tmp_path / "artifacts"
    runs = []
    for _ in range(2):
        result = run_cli("tools", "--hosts", str(hosts), "--held-out", "--artifacts", str(artifacts))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "tool-gate:held_out" in result.stdout + result.stderr
        runs.append(run_folder_of(result))
    first, second = (manifest_of(r)["flow"]["correctness"]["rehearsal"]["tool_gate"] for r in runs)
    assert first["held_out"]["run_number"] == 1 and first["held_out"]["earlier_runs"] == []
    assert second["held_out"]["run_number"] == 2 and second["held_out"]["earlier_runs"] == [f"{runs[0].name}:rehearsal"]
    assert second["held_out"]["sha256"] == first["held_out"]["sha256"]
    assert second["protocol"]["sha256"] == first["protocol"]["sha256"]
    tools = pd.read_parquet(runs[1] / "rehearsal" / "tools.parquet")
    assert list(tools.split) == ["dev", "held_out"] and list(tools.run_number) == [1, 2]
    assert (tools.accounted == tools.cases).all() and (tools.cases == 4).all()
    report = (runs[1] / "report.md").read_text()
    assert "### Tool-call gate" in report and "held_out #2" in report
    assert not (runs[1] / "rehearsal" / "decode.parquet").exists()  # tools runs no speed stages
    assert no_llama_server_left(18533)
