"""K as the engine counts it: one definition (draft tokens proposed per verification step),
converted once per engine, checked at load against the whole argv and at boot against the
server's own counts.

SGLang 0.5.23's `--speculative-num-draft-tokens` and `--speculative-dflash-block-size` include
the root (K+1), `--speculative-num-steps` decides with topk 1 (srt/arg_groups/speculative_hook.py);
vLLM's K is `num_speculative_tokens`. A lane whose flags agree loads; one whose flags change
the width is refused at load (exit 2, one line: the flag, the declared K, the K the engine runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from tasks.wire.records import RequestRecord
from tasks.engines import engine_for
from tasks.engines.sglang import SGLang
from tasks.inventory.models import CounterGate, Lane
from tasks.stages.safety import implied_gates, speculation_gates

FIX = Path(__file__).resolve().parent / "fixtures" / "engines" / "sglang"
HOSTS = {"gb300": {"address": "gb300.lab", "transport": "ssh", "user": "bench", "gpus": 1}}


def inventory(tmp_path: Path, engine: str, method: str, k: int, flags: list[str], drafter: bool = True) -> Path:
    lane = {"host": "gb300", "engine": engine, "binary": "python3" if engine == "sglang" else "vllm",
            "model": {"path": "/models/target"}, "speculative": {"method": method, "k": k}, "flags": flags,
            "bench": {"decode": {"concurrency": [1], "prompts": "p.jsonl"}}}
    if drafter:
        lane["drafter"] = {"path": "/models/drafter"}
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": HOSTS, "lanes": {"spec": lane}}))
    return path


CONSISTENT = [
    ("sglang", "draft-eagle3", 3, ["--speculative-num-draft-tokens", "4"], "--speculative-num-steps 3"),
    ("sglang", "draft-eagle3", 3, ["--speculative-algorithm", "EAGLE3"], "--speculative-num-steps 3"),
    ("sglang", "EAGLE3", 3, ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1"], "--speculative-num-steps 3"),
    ("sglang", "DFLASH", 7, ["--speculative-dflash-block-size", "8"], "--speculative-dflash-block-size 8"),
    ("sglang", "NEXTN", 2, ["--speculative-algorithm", "EAGLE"], "--speculative-num-steps 2"),
    ("sglang", "DSPARK", 5, ["--speculative-dspark-block-size", "5"], "--speculative-dspark-block-size 5"),
    ("vllm", "eagle3", 3, ["--speculative-config.num_speculative_tokens", "3"], "--speculative-config"),
]


@pytest.mark.parametrize("engine,method,k,flags,deciding", CONSISTENT)
def test_flags_that_agree_with_the_declared_k_load_and_plan(tmp_path, capsys, engine, method, k, flags, deciding):
    code = main(["plan", "--hosts", str(inventory(tmp_path, engine, method, k, flags)), "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    (plan,) = json.loads(out)
    assert plan["problems"] == []
    adapter = engine_for(engine)
    drafted = adapter.draft_plan(plan["processes"][0]["argv"])
    assert drafted is not None and drafted.k == k and drafted.flag.startswith(deciding)


WRONG = [
    # DFLASH's block holds the anchor: block 7 drafts 6, every row would have said K=7.
    ("sglang", "DFLASH", 7, ["--speculative-dflash-block-size", "7"], "--speculative-dflash-block-size 7", 6),
    # --speculative-num-steps was never checked: the server drafts 5.
    ("sglang", "draft-eagle3", 3, ["--speculative-num-steps", "5"], "--speculative-num-steps 5", 5),
    # A tree: verified 8 wide (root included) drafts 7 per step whatever num-steps says.
    ("sglang", "EAGLE", 3, ["--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
     "--speculative-num-draft-tokens 8", 7),
    ("sglang", "NGRAM", 4, ["--speculative-num-draft-tokens", "4"], "--speculative-num-draft-tokens 4", 3),
    ("vllm", "eagle3", 3, ["--speculative-config", '{"method": "eagle3", "model": "/models/drafter", '
                                                   '"num_speculative_tokens": 5}'],
     "--speculative-config num_speculative_tokens=5", 5),
]


@pytest.mark.parametrize("engine,method,k,flags,flag,runs", WRONG)
def test_flags_that_change_k_are_refused_at_load(tmp_path, capsys, engine, method, k, flags, flag, runs):
    hosts = inventory(tmp_path, engine, method, k, flags)
    for command in (["plan", "--hosts", str(hosts)], ["nightly", "--hosts", str(hosts)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err
        assert f"lanes.spec.speculative.k: declared K={k}, but {flag} makes {engine} draft K={runs}" in err, err
        assert f"Fix: set speculative.k to {runs}" in err


def test_a_method_the_flags_contradict_is_refused_in_the_release_spelling(tmp_path, capsys):
    assert main(["plan", "--hosts", str(inventory(tmp_path, "sglang", "draft-eagle3", 3,
                                                   ["--speculative-algorithm", "DFLASH"]))]) == 2
    err = capsys.readouterr().err
    assert "lanes.spec.speculative.method: declared draft-eagle3 (sglang spells it EAGLE3), but 'flags' says DFLASH" in err


def test_each_conversion_is_its_own_inverse():
    """speculative_flags(K) read back by draft_plan is K, for every method and width."""
    for engine_name, methods in (("sglang", ["EAGLE", "EAGLE3", "NEXTN", "draft-simple", "DFLASH", "DSPARK", "NGRAM"]),
                                 ("vllm", ["eagle3", "dflash", "mtp", "ngram"])):
        engine = engine_for(engine_name)
        for method in methods:
            for k in (1, 4, 7):
                lane = Lane.model_validate({"host": "h", "engine": engine_name, "model": {"path": "/m"},
                                            "speculative": {"method": method, "k": k},
                                            "bench": {"decode": {"prompts": "p.jsonl"}}})
                plan = engine.draft_plan(engine.launch_command(lane, "bin", "0.0.0.0"))
                assert plan is not None and plan.k == k and engine.same_method(plan.method, method), (method, k, plan)
    ngram = SGLang().draft_plan(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"])
    assert ngram is not None and ngram.tree and ngram.shape == "tree, BFS breadth up to 10"
    chain = SGLang().draft_plan(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5",
                                 "--speculative-ngram-max-bfs-breadth", "1"])
    assert chain is not None and not chain.tree
    adaptive = SGLang().draft_plan(["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                                    "--speculative-adaptive"])
    assert adaptive is not None and adaptive.k == 3 and "adaptive" in adaptive.shape


# --- At boot: the server's own counts -----------------------------------------------------------

def _probe(name: str) -> RequestRecord:
    """The probe request as the client records it, from a recorded /generate stream."""
    engine = SGLang()
    done = [e for line in (FIX / name).read_text().splitlines() if (e := engine.parse_sse_line(line)) is not None]
    end = next(e for e in done if e.done and e.completion_tokens is not None)
    return RequestRecord(lane="spec", stage="probe", repeat=0, concurrency=1, prompt_class="probe", prompt_id="p0",
                         nonce="n0", max_tokens=64, ok=True, started_at=0.0, output_tokens=end.completion_tokens or 0,
                         finish_reason=end.finish_reason, spec=end.spec)


def _dflash_lane(k: int) -> Lane:
    return Lane.model_validate({"host": "h", "engine": "sglang", "model": {"path": "/m"}, "drafter": {"path": "/d"},
                                "speculative": {"method": "DFLASH", "k": k}, "bench": {"decode": {"prompts": "p.jsonl"}}})


def test_sglang_drafter_lanes_get_the_implied_drafts_happen_gate():
    gates = implied_gates(_dflash_lane(7), SGLang())
    assert [g.metric for g in gates if isinstance(g, CounterGate)] == ["sglang:spec_verify_calls_total"]


def test_the_sglang_draft_width_gate_reads_the_servers_width_from_the_probe():
    engine = SGLang()
    before, after = (engine.metrics((FIX / f"metrics_{w}.prom").read_text()) for w in ("before", "after"))
    # The recorded stream: 140 proposed drafts over 20 verify steps, K=7 as declared.
    (ok,) = speculation_gates(_dflash_lane(7), engine, before, after, "", [_probe("stream_stop.sse")])
    assert ok.gate == "draft-width (implied)" and ok.passed and ok.value == 7.0
    # A server that ran block 7 (6 drafts per step: 120 over 20) behind a lane that says K=7.
    (wrong,) = speculation_gates(_dflash_lane(7), engine, before, after, "",
                                 [_probe("0.5.23/dflash_block7/stream_stop.sse")])
    assert not wrong.passed and (wrong.value, wrong.threshold) == (6.0, 7.0)
    assert "declared K (speculative.k) = 7, but the server drafts up to 6 tokens per verification step" in wrong.detail
    assert "120 draft tokens over 20 verify steps" in wrong.detail
    # Without the probe's fields there is nothing to judge the width by: no gate, not a pass.
    assert speculation_gates(_dflash_lane(7), engine, before, after, "", []) == []


def test_tree_shaped_drafting_is_labelled_in_the_acceptance_table():
    """SGLang NGRAM drafts a BFS tree (breadth up to 10 by default): its per-position rates mean
    "accepted path at least i+1 long", and the table says so; a chain lane's table is unchanged."""
    import pandas as pd

    from tasks.report.report import acceptance_table
    from tasks.stages.acceptance import draft_shape, summarize

    engine = SGLang()
    ngram = Lane.model_validate({"host": "h", "engine": "sglang", "model": {"path": "/m"},
                                 "speculative": {"method": "NGRAM", "k": 7}, "bench": {"decode": {"prompts": "p.jsonl"}}})
    shape = draft_shape("sglang", engine.launch_command(ngram, "python3", "0.0.0.0"))
    assert shape == "tree, BFS breadth up to 10"
    chain = draft_shape("sglang", engine.launch_command(_dflash_lane(7), "python3", "0.0.0.0"))
    assert chain == "chain"
    window = engine.acceptance(engine.metrics(""), engine.metrics(""), [_probe("stream_stop.sse")], 7)
    assert window is not None
    tree_row = summarize("ngram", "prose", 7, [window], shape=shape)
    chain_row = summarize("dflash", "prose", 7, [window], shape=chain)
    table = acceptance_table(pd.DataFrame([tree_row.model_dump()]))
    assert list(table["drafting"]) == ["tree, BFS breadth up to 10 (per-position: accepted path >= i+1)"]
    assert "drafting" not in acceptance_table(pd.DataFrame([chain_row.model_dump()]))
    # Rows written before the column existed read as chains.
    old = pd.DataFrame([chain_row.model_dump(exclude={"draft_shape"})])
    assert "drafting" not in acceptance_table(old)
