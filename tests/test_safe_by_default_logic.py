"""Safe by default, the pure parts: no server needed (tasks/stages/safety.py, acceptance, noise)."""

from __future__ import annotations

import pytest

from conftest import run_cli, shipped_inventory, write_inventory
from tasks.wire.records import truncation_of
from tasks.engines.facts import BootFacts, Metrics
from tasks.engines.llamacpp import LlamaCpp
from tasks.hosts.noise import between, sample
from tasks.inventory.models import CapacityGate, CounterGate, Inventory, Lane
from tasks.record.rows import WarmupRow
from tasks.stages.acceptance import PromptWindow, budget_cut, summarize
from tasks.engines.facts import Acceptance
from tasks.client.waves import WaveResult
from tasks.stages.decode_curve import summarize as decode_row
from tasks.stages.safety import acceptance_findings, effective_findings, implied_gates, noise_findings, speculation_gates


def _lane(**changes) -> Lane:
    lane = shipped_inventory()["lanes"]["rehearsal"]
    lane.pop("gates")  # as a new user writes it: no gate declared
    lane.update(changes)
    return Lane.model_validate(lane)


def test_a_drafter_implies_the_counter_gate_and_every_bench_the_capacity_gate():
    gates = implied_gates(_lane(), LlamaCpp())
    assert [type(g) for g in gates] == [CounterGate, CapacityGate]
    assert gates[0].metric == "llamacpp:spec_decode_num_drafts_total" and gates[0].name.endswith("(implied)")
    assert [type(g) for g in implied_gates(_lane(drafter=None, speculative=None), LlamaCpp())] == [CapacityGate]
    waived = _lane(waivers=[{"gate": "capacity", "reason": "the engine reports no cap; checked by hand"}])
    assert [type(g) for g in implied_gates(waived, LlamaCpp())] == [CounterGate]


def test_declared_gates_only_add():
    """A declared counter gate on the draft counter keeps the implied drafts-happen gate unless it is at
    least as strict: `< 1000` (or `== 0`) on the same counter passes when nothing drafted."""
    metric = "llamacpp:spec_decode_num_drafts_total"
    for op, threshold in [("<", 1000), ("==", 0), ("<=", 5)]:
        declared = {"kind": "counter", "name": "mine", "metric": metric, "op": op, "threshold": threshold}
        gates = implied_gates(_lane(gates=[declared]), LlamaCpp())
        assert [g.name for g in gates] == ["mine", "drafts-happen (implied)", "capacity (implied)"], (op, gates)
    for op, threshold in [(">", 0), (">", 3), (">=", 1)]:  # as strict or stricter: nothing to add
        declared = {"kind": "counter", "name": "mine", "metric": metric, "op": op, "threshold": threshold}
        assert [g.name for g in implied_gates(_lane(gates=[declared]), LlamaCpp())] == ["mine", "capacity (implied)"]
    for op, threshold in [(">=", 0), (">", -1), ("!=", -3)]:  # cannot fail: refused at load
        with pytest.raises(ValueError, match="cannot fail"):
            _lane(gates=[{"kind": "counter", "name": "g", "metric": metric, "op": op, "threshold": threshold}])


def test_a_waiver_needs_a_reason(tmp_path):
    inv = shipped_inventory()
    inv["lanes"]["rehearsal"]["waivers"] = [{"gate": "counter"}]
    r = run_cli("nightly", "--hosts", str(write_inventory(tmp_path, inv)), timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "lanes.rehearsal.waivers[0].reason" in r.stderr


@pytest.mark.parametrize("flags,field,declared,given", [
    (["--spec-draft-n-max", "7"], "speculative.k", "4", "7"),
    (["--parallel=2"], "slots", "8", "2"),
    (["--spec-type", "ngram-simple"], "speculative.method", "draft-simple", "ngram-simple"),
    (["-c", "9999"], "context", "4096", "9999"),
])
def test_a_flag_that_contradicts_the_lane_is_a_config_error_before_boot(tmp_path, flags, field, declared, given):
    inv = shipped_inventory()
    inv["lanes"]["rehearsal"]["flags"] += flags
    r = run_cli("nightly", "--hosts", str(write_inventory(tmp_path, inv)), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"lanes.rehearsal.{field}: declared {declared}" in line and f"says {given}" in line and "Fix:" in line


def test_effective_width_and_synthetic_acceptance_from_the_servers_own_words():
    engine = LlamaCpp()
    before = Metrics(values={})
    pos = {f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}': 1.0 for i in range(7)}
    after = Metrics(values={"llamacpp:spec_decode_num_drafts_total": 2.0,
                            "llamacpp:spec_decode_num_draft_tokens_total": 14.0, **pos})
    log = "W common_speculative_init: synthetic speculative acceptance is enabled for benchmarking; generated output is not valid\n"
    results = speculation_gates(_lane(), engine, before, after, log)
    width, synth = results
    assert not width.passed and "declared K (speculative.k) = 4" in width.detail and "up to 7" in width.detail
    assert not synth.passed and "generated output is not valid" in synth.detail and "--spec-synth-len" in synth.detail
    assert speculation_gates(_lane(waivers=[{"gate": "synthetic", "reason": "benchmarking the verifier only"},
                                            {"gate": "draft-width", "reason": "width is checked elsewhere"}]),
                             engine, before, after, log) == []


def test_declared_against_effective_values_name_both_and_the_fix():
    from tasks.record.manifest import ModelFacts

    lane = _lane(context=1024, binary="/opt/other/llama-server")
    facts = BootFacts(max_running_requests=7, context_per_slot=512, speculative_type="ngram-simple",
                      draft_model_loaded=True, extra={"draft_model": "/x/other.gguf", "temperature": 0.8, "top_k": 40})
    models = [ModelFacts(role="model", path="t.gguf", bytes=1, sha256="a" * 64),
              ModelFacts(role="drafter", path="d.gguf", bytes=1, sha256="a" * 64)]
    identity = {"path": "/opt/other/llama-server", "sha256": "b" * 64}
    pinned = {"source": "llama-cpp-python==0.3.36 sdist sha256 ...", "llama_server_sha256": "c" * 64}
    found = {f.check: f for f in effective_findings(lane, facts, models, identity, pinned)}
    assert set(found) == {"slots", "context", "speculative type", "drafter file", "drafter is the target", "engine binary",
                          "sampling"}
    assert found["sampling"].severity == "failure" and "temperature 0.8" in found["sampling"].message
    assert found["slots"].declared == 8 and found["slots"].effective == 7 and "fix:" in found["slots"].message
    assert found["context"].declared == 1024 and found["context"].effective == 512
    assert found["speculative type"].severity == "failure" and found["drafter file"].severity == "failure"
    assert "outside the pinned build" in found["engine binary"].message
    assert effective_findings(_lane(), BootFacts(max_running_requests=8, context_per_slot=512,
                                                 speculative_type="draft-simple"), [], {}, None) == []


def test_the_target_as_its_own_drafter_reads_k_plus_1_once_the_budget_cut_step_is_apart():
    # Measured on llama-server (K=4, n_predict 23): 5 steps, 17 drafted, 17 accepted; the last
    # draft held 1 token because the budget had 2 left (server-context.cpp get_n_draft_max).
    w = PromptWindow(prompt_id="p", steps=5, accepted=17, draft_tokens=17, output_tokens=23, budget_hit=True,
                     context_cut=False)
    assert budget_cut(w, 4) == (1.0, 1.0)
    window = Acceptance(verify_steps=5, accepted=17, draft_tokens=17, acceptance_length=4.4,
                        per_position=[1, .8, .8, .8], source="counters")
    prompts = [w.model_copy(update={"prompt_id": f"p{i}"}) for i in range(3)]
    row = summarize("l", "prose", 4, [window], prompts)
    assert row.acceptance_length == pytest.approx(4.4)
    assert row.acceptance_length_full_steps == pytest.approx(5.0)
    assert row.tokens_per_pass == pytest.approx(22 / 5) and row.drafted_share == pytest.approx(1.0)
    assert row.prompts == 3 and not row.enough_prompts
    checks = {f.check for f in acceptance_findings(_lane(), [row])}
    assert checks == {"acceptance near K+1", "probe set too small"}


def test_interval_is_over_prompts_and_a_draft_floor_shows_in_tokens_per_pass():
    prompts = [PromptWindow(prompt_id=f"p{i}", steps=10, accepted=a, draft_tokens=40, output_tokens=60,
                            budget_hit=False, context_cut=False) for i, a in enumerate([5, 10, 15, 20, 8, 12, 6, 14])]
    window = Acceptance(verify_steps=80, accepted=90, draft_tokens=320, acceptance_length=1 + 90 / 80,
                        per_position=[.6, .4, .3, .2], source="counters")
    row = summarize("l", "prose", 4, [window], prompts)
    assert row.enough_prompts and row.ci_low < row.acceptance_length < row.ci_high
    # 59 decoded tokens per request, 80 drafted steps out of 8*59-90 = 382 target passes.
    assert row.drafted_share == pytest.approx(80 / 382) and row.tokens_per_pass == pytest.approx(472 / 382)
    (skipped,) = acceptance_findings(_lane(), [row])
    assert skipped.check == "drafts skipped" and "--spec-draft-p-min" in skipped.message


def test_every_request_says_how_it_ended():
    assert truncation_of(True, "stop", 10, 64, False) == "none"
    assert truncation_of(True, "length", 64, 64, False) == "max_tokens"
    assert truncation_of(True, "length", 30, 64, False) == "context"
    assert truncation_of(True, "length", 64, 64, True) == "context"  # llama.cpp `truncated`: shifted
    assert truncation_of(False, None, 0, 64, None) is None


def test_noise_is_measured_and_a_wide_spread_is_unstable(tmp_path):
    for name, stat in (("a", "cpu  100 0 100 700 0 0 0 100\n"), ("b", "cpu  300 0 200 800 0 0 0 200\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "stat").write_text(stat)
        (tmp_path / name / "loadavg").write_text("3.50 2.00 1.00 1/100 1\n")
    noise = between(sample(tmp_path / "a"), sample(tmp_path / "b"))
    assert noise.load_1m_before == 3.5 and noise.busy_pct == pytest.approx(80.0) and noise.steal_pct == pytest.approx(20.0)
    assert sample() is not None  # this host's own /proc
    from tasks.wire.records import RequestRecord

    def rec(n: int) -> RequestRecord:
        return RequestRecord(lane="l", stage="decode", repeat=1, concurrency=2, prompt_class="prose", prompt_id="p",
                             nonce="n", max_tokens=64, ok=True, output_tokens=n, started_at=0.0, truncation="max_tokens")
    row = decode_row("l", 2, [WaveResult([rec(64)], w) for w in (1.0, 5.0, 1.1)], noise=[noise] * 3,
                     unstable_spread_pct=50.0)
    assert row.unstable and row.steal_pct == pytest.approx(20.0)
    warm = [WarmupRow(lane="l", concurrency=1, size_class="decode", first_hit_ttft_s=.1, first_hit_e2el_s=.5,
                      steady_ttft_s=.1, steady_e2el_s=.9, first_hit_cost_s=-.4, noise=True)]
    checks = [f.check for f in noise_findings(_lane(), [row], warm)]
    assert checks == ["unstable", "warmup noise"]
    assert noise_findings(_lane(waivers=[{"gate": "unstable", "reason": "a shared CI box, judged elsewhere"}]),
                          [row], []) == []
    assert not decode_row("l", 2, [WaveResult([rec(64)], w) for w in (1.0, 1.2)], noise=[],
                          unstable_spread_pct=50.0).unstable


def test_the_shipped_rehearsal_lane_implies_nothing_new():
    inv = Inventory.model_validate(shipped_inventory())
    lane = inv.lanes["rehearsal"]
    assert implied_gates(lane, LlamaCpp()) == list(lane.gates)  # declared already: no duplicates


def test_kl_flags_a_quantized_reference_an_identical_candidate_and_a_shorter_reference_context():
    from tasks.kl.suspicious import kl_flags, quantized

    assert quantized("models/glm-NVFP4.gguf", None) and quantized("t-Q4_K_M.gguf", None)
    assert quantized("target-f16.gguf", "Q8_0") and quantized("target-f16.gguf", None) is None
    flags = kl_flags("ref", {"ref": {"path": "target-q8_0.gguf", "sha256": "a" * 64, "context": 256},
                             "same": {"path": "copy.gguf", "sha256": "a" * 64, "context": 256},
                             "long": {"path": "x.gguf", "sha256": "b" * 64, "context": 512}})
    assert len(flags) == 3
    assert "itself quantized" in flags[0] and "exact bytes" in flags[1] and "256 tokens of context" in flags[2]
    assert kl_flags("ref", {"ref": {"path": "target-f16.gguf", "sha256": "a" * 64, "context": 512},
                            "q8": {"path": "q.gguf", "sha256": "b" * 64, "quantize": "Q8_0", "context": 512}}) == []


def test_lowered_bars_under_a_new_matrix_name_are_compared_with_the_same_target_and_drafters(tmp_path):
    from manifests import matrix_section, write_manifest

    from tasks.matrix.bars import Registration, earlier_run

    def reg(name: str, bars_sha: str, text: str) -> Registration:
        return Registration(matrix=name, matrix_file=f"{name}.yaml", registered_at="2026-12-01T00:00:00+00:00",
                            baseline="good", bars=({"metric": "acceptance_length"},), bars_text=(text,),
                            prompt_sets={}, prompts_per_class=8, bars_sha256=bars_sha, prompt_sets_sha256="p",
                            sha256="x")
    old = tmp_path / "20261130T000000Z_matrix_aaaaaaaa"
    old.mkdir()
    old_reg = reg("october", "a" * 64, "weak: prose acceptance length at K=4 >= 2.6")
    write_manifest(old, "matrix", "2026-11-30", matrix=matrix_section(old_reg.model_dump(mode="json"), "same-bytes"))
    now = reg("october-v2", "b" * 64, "weak: prose acceptance length at K=4 >= 1.2")
    assert earlier_run(tmp_path, now, tmp_path / "new") is None  # by name alone: "first registered run"
    found = earlier_run(tmp_path, now, tmp_path / "new", subject="same-bytes")
    assert found is not None and not found.same_bars and found.matrix == "october"
    assert "BARS CHANGED" in found.lines()[0] and "of matrix october, same target and drafter bytes" in found.lines()[0]
    assert found.removed == ["weak: prose acceptance length at K=4 >= 2.6"]
