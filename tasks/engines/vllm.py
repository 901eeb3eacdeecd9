"""vLLM (`vllm serve`): lanes with EAGLE3/DFlash/MTP drafters behind the V1 engine.

Facts read from vllm-project/vllm:
- Spec-decode counters (v1/spec_decode/metrics.py `SpecDecodingProm`): `vllm:spec_decode_num_drafts`
  (one per request per verification step), `_num_draft_tokens`, `_num_accepted_tokens`,
  `_num_accepted_tokens_per_pos{position="k"}` (+1 at every position below the accepted count, so
  it never rises with k); exported with `_total`, labelled `model_name` and `engine` (one series
  per data-parallel engine, v1/metrics/loggers.py). Summed over those labels, `position` kept apart.
  The module's PromQL defines mean acceptance length as 1 + accepted / drafts: lanebench's.
- Boot log lines: vllm_boot.py. `max_num_seqs` is resolved at DEBUG only (engine/arg_utils.py), so we
  pass `--max-num-seqs lane.slots`; the cap reported, min(max_num_seqs, floor(max concurrency)), is
  how many requests of `lane.context` tokens run without preemption, as llama.cpp's slot count means.
- `--speculative-config` JSON keys `method` (lower case: eagle, eagle3, dflash, dspark, mtp,
  draft_model, ngram, ...), `model`, `num_speculative_tokens` (config/speculative.py): K for every
  method, and the number of per-position series.
- /v1/completions streaming (entrypoints/openai/serving_completion.py): each chunk has the text
  delta, `finish_reason` and, with `return_token_ids`, `token_ids`; `continuous_usage_stats` puts
  the running `usage` on every chunk, `include_usage` adds a last `choices: []` chunk with totals.
  `cache_salt` (protocol.py) keeps the request out of other requests' prefix cache.

`binary` is the environment's `vllm` executable. Per-request spec fields need
`--per-request-spec-decode-metrics` and are not used: the counters are exact over the window.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import msgspec

from tasks.inventory.models import Agentic, Lane
from tasks.engines.base import Engine, parser_flags
from tasks.wire.kl_probes import ForcedProbe, ForcedScore
from tasks.wire.records import RequestRecord, RequestSpec, StreamEvent
from tasks.engines.facts import Acceptance, BootFacts, DraftPlan, LoggedAcceptance, Metrics, PlannedCap
from tasks.engines import planned, vllm_boot
from tasks.engines.build import vllm_cpu_bin_dir, vllm_cpu_identity

_P = "vllm:spec_decode_"
DP_RPC_PORT = 29550  # vllm/config/parallel.py `data_parallel_rpc_port`: "shared by all nodes"
_KEY = re.compile(r"^([^{]+)(?:\{(.*)\})?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_ALIASES = {"simple": "draft_model", "standalone": "draft_model", "nextn": "mtp"}
# vllm/v1/spec_decode/metrics.py SpecDecodingLogging.log, printed every VLLM_LOG_STATS_INTERVAL
# seconds (default 10) in which drafts happened, over that interval only.
_SPEC_LINE = re.compile(r"SpecDecoding metrics: Mean acceptance length: ([\d.]+), .*?Accepted: (\d+) tokens, "
                        r"Drafted: (\d+) tokens, Per-position acceptance rate: ([\d., ]+?), Avg Draft")


class _TokenChoice(msgspec.Struct):
    text: Any = None
    token_ids: Any = None
    finish_reason: Any = None


class _TokenChunk(msgspec.Struct):
    """What VLLM.token_event reads of a /v1/completions stream chunk (Engine.token_chunk)."""
    choices: list[_TokenChoice] | None = None
    error: Any = msgspec.UNSET  # present at all: an error body
    object: Any = None


def vllm_method(method: str) -> str:
    """Lane method name -> vLLM's `method` ("EAGLE3" -> "eagle3", "draft-simple" -> "draft_model")."""
    name = method.lower().removeprefix("draft-")
    return _ALIASES.get(name, name)


def counter_by_position(metrics: Metrics, name: str) -> dict[str, float]:
    """One counter summed over its other labels (model_name, engine per DP rank...), by `position` ('' if none)."""
    out: dict[str, float] = {}
    for key, value in metrics.values.items():
        m = _KEY.match(key)
        if m is None or m[1] not in (name, name + "_total"):
            continue
        position = dict(_LABEL.findall(m[2] or "")).get("position", "")
        out[position] = out.get(position, 0.0) + value
    return out


class VLLM(Engine):
    name = "vllm"
    draft_counter = "vllm:spec_decode_num_drafts_total"
    draft_tokens_counter = "vllm:spec_decode_num_draft_tokens_total"
    info_path = "/version"  # {"version": "0.33.0"}
    queue_gauge = "vllm:num_requests_waiting"
    token_chunk = _TokenChunk

    def acceptance_log_interval_s(self, env: dict[str, str]) -> float | None:
        try:
            interval = float(env.get("VLLM_LOG_STATS_INTERVAL", "10"))
        except ValueError:
            return None
        return interval if interval > 0 else None

    def logged_acceptance(self, log: str, k: int) -> LoggedAcceptance | None:
        lines = _SPEC_LINE.findall(log)
        accepted, drafted = sum(int(a) for _, a, _, _ in lines), sum(int(d) for _, _, d, _ in lines)
        if k <= 0 or drafted <= 0:
            return None
        rates = [[float(x) for x in r.split(",")] for *_, r in lines]
        width = max(len(r) for r in rates)
        per_pos = [sum(int(line[2]) * (r[i] if i < len(r) else 0.0) for line, r in zip(lines, rates)) / drafted
                   for i in range(width)]
        return LoggedAcceptance(lines=len(lines), accepted=accepted, drafted=drafted,
                                acceptance_length=1.0 + accepted / (drafted / k), per_position=per_pos)

    def effective_k(self, metrics: Metrics) -> int | None:
        """K as the engine states it: one `num_accepted_tokens_per_pos` series per position, from boot on."""
        positions = counter_by_position(metrics, _P + "num_accepted_tokens_per_pos")
        return len([p for p in positions if p != ""]) or None

    local_binary_name = "vllm"

    def local_build(self) -> tuple[str, dict[str, str]]:
        """vLLM's CPU build (`vllm-cpu`) in its own environment under ~/.cache/lanebench."""
        bin_dir = vllm_cpu_bin_dir()
        return str(bin_dir / "vllm"), vllm_cpu_identity(bin_dir)

    def launch_command(self, lane: Lane, binary: str, host: str) -> list[str]:
        argv = [binary, "serve", lane.model.path, "--host", host, "--port", str(lane.port),
                "--max-model-len", str(lane.context), "--max-num-seqs", str(lane.slots)]
        if lane.speculative is not None:
            config: dict[str, str | int] = {"method": vllm_method(lane.speculative.method),
                                            **({"model": lane.drafter.path} if lane.drafter else {}),
                                            "num_speculative_tokens": lane.speculative.k}
            argv += ["--speculative-config", json.dumps(config)]
        return argv + list(lane.flags)

    boot_facts = staticmethod(vllm_boot.boot_facts)  # per release: cap per engine x data-parallel engines

    def info_facts(self, facts: BootFacts, info: dict | list) -> BootFacts:
        """/version beside the log's version line."""
        facts.info_version(info.get("version") if isinstance(info, dict) else None, "/version")
        return facts

    def planned_cap(self, lane: Lane) -> PlannedCap | None:
        """0.33.0: `--max-num-seqs` per data-parallel engine (`vllm/config/scheduler.py`) x `--data-parallel-size`."""
        argv = self.launch_command(lane, "vllm", "0.0.0.0")
        if (seqs := planned.int_flag(argv, "--max-num-seqs")) is None:
            return None
        dp = planned.int_flag(argv, "--data-parallel-size", "-dp") or 1
        shape = f" x {dp} data-parallel engines" if dp > 1 else ""
        return PlannedCap(cap=seqs * dp, reason=f"--max-num-seqs {seqs}{shape} (the lane's slots unless its flags say)",
                          fix="raise the lane's slots (it becomes --max-num-seqs)")

    method_name = staticmethod(vllm_method)

    def draft_plan(self, argv: list[str]) -> DraftPlan | None:
        """K as vLLM 0.33.0 will run an argv: `num_speculative_tokens` of the last `--speculative-config`
        JSON, with its dotted keys (`--speculative-config.num_speculative_tokens 5`) applied over it,
        as FlexibleArgumentParser merges them. A `speculative_token_tree` drafts a tree."""
        config: dict = {}
        for i, token in enumerate(argv):
            head, eq, tail = token.partition("=")
            name, dot, key = head.partition(".")
            if name.replace("_", "-") != "--speculative-config":
                continue
            value = tail if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if not dot:
                try:
                    config = json.loads(value) if value.strip().startswith("{") else {}
                except json.JSONDecodeError:
                    config = {}
            else:
                config[key] = value
        if "method" not in config and "num_speculative_tokens" not in config:
            return None
        k = config.get("num_speculative_tokens")
        k = int(k) if isinstance(k, int) or (isinstance(k, str) and k.isdigit()) else None
        tree = bool(config.get("speculative_token_tree"))
        return DraftPlan(method=config.get("method"), k=k, flag=f"--speculative-config num_speculative_tokens={k}",
                         tree=tree, shape="tree (speculative_token_tree)" if tree else "chain")

    def listen_ports(self, argv: list[str], rank: int, spans_nodes: bool) -> list[tuple[int, str]]:
        """The head's data-parallel RPC port, when data-parallel spans nodes or the flag is given (the headless
        nodes connect to it: vllm/entrypoints/cli/serve.py run_headless)."""
        given = planned.int_flag(argv, "--data-parallel-rpc-port")
        dp = planned.int_flag(argv, "--data-parallel-size", "-dp") or 1
        if rank != 0 or (given is None and not (dp > 1 and spans_nodes)):
            return []
        return [(given or DP_RPC_PORT, "--data-parallel-rpc-port")]

    def node_flags(self, rank: int, nnodes: int, master: str, port: int) -> list[str]:
        # vllm/engine/arg_utils.py --nnodes/--node-rank/--master-addr/--master-port; every node but
        # the head runs --headless (entrypoints/cli/serve.py run_headless: workers, no API server).
        flags = ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", master, "--master-port", str(port)]
        return flags + (["--headless"] if rank > 0 else [])

    def version_of(self, log: str, info: dict | list | None) -> str | None:
        return super().version_of(log, info) or vllm_boot.version_in(log)

    def acceptance(self, before: Metrics, after: Metrics, requests: list[RequestRecord], k: int) -> Acceptance | None:
        def delta(name: str) -> dict[str, float]:
            b, a = counter_by_position(before, _P + name), counter_by_position(after, _P + name)
            return {pos: a.get(pos, 0.0) - b.get(pos, 0.0) for pos in a.keys() | b.keys()}

        steps = delta("num_drafts").get("", 0.0)
        if steps <= 0:
            return None
        accepted = delta("num_accepted_tokens").get("", 0.0)
        per_pos = delta("num_accepted_tokens_per_pos")
        return Acceptance.over(steps, accepted, delta("num_draft_tokens").get("", 0.0),
                               [per_pos.get(str(i), 0.0) for i in range(k)], "counters")

    def completion_request(self, prompt: str, max_tokens: int) -> RequestSpec:
        # Continuous usage makes the chunk with finish_reason a complete final event (stages stop there).
        # No "model": /v1/completions may omit it, and the first served model answers.
        return RequestSpec(path="/v1/completions", body={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "return_token_ids": True,
            "cache_salt": uuid.uuid4().hex})

    def token_event(self, chunk: _TokenChunk) -> tuple[str, int] | None:
        choices = chunk.choices
        if not choices or chunk.error is not msgspec.UNSET or chunk.object == "error":
            return None
        choice = choices[0]
        text = choice.text or ""
        if choice.finish_reason is not None or type(text) is not str:
            return None
        return text, len(choice.token_ids or ())

    def parse_event(self, data: dict) -> StreamEvent:
        if "error" in data or data.get("object") == "error":
            return StreamEvent(done=True, finish_reason="error")
        choices = data.get("choices") or []
        if not choices:
            usage = data.get("usage")
            if usage is None:
                return StreamEvent()
            # The usage chunk is the last data chunk: the stream's totals.
            return StreamEvent(done=True, completion_tokens=usage.get("completion_tokens"),
                               prompt_tokens=usage.get("prompt_tokens"))
        choice = choices[0]
        finish = choice.get("finish_reason")
        text, tokens = choice.get("text") or "", len(choice.get("token_ids") or ())
        if finish is None:  # a token event (the client reads these through token_event; here: prefill, tests)
            return StreamEvent(text=text, tokens=tokens)
        usage = data.get("usage") or {}
        return StreamEvent(text=text, tokens=tokens, done=True, completion_tokens=usage.get("completion_tokens"),
                           prompt_tokens=usage.get("prompt_tokens"), finish_reason=finish)

    # `tool_choice: auto` needs `--enable-auto-tool-choice` plus `--tool-call-parser`; `reasoning`
    # (formerly `reasoning_content`) needs `--reasoning-parser`.

    def agentic_flags(self, agentic: Agentic, chat_template: str | None) -> list[str]:
        return parser_flags(agentic, chat_template, ("--enable-auto-tool-choice",))

    # --- Teacher-forced scoring (KL gate) ---------------------------------------------------
    # /v1/completions takes token ids as `prompt` (no BOS added); `prompt_logprobs: k` returns per
    # choice null for the first token, then per position `{"<id>": {"logprob", "rank", ...}}` with
    # the prompt token and the top k (rank 1 = argmax; -inf clamped to -9999.0; k capped by
    # `--max-logprobs`, default 20). `max_tokens: 0` is refused: one token is generated and ignored.
    # Prompt logprobs bypass the prefix cache.

    def greedy_tokens_request(self, tokens: list[int], max_tokens: int, ignore_eos: bool) -> RequestSpec:
        return RequestSpec(path="/v1/completions", body={"prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                                                         "ignore_eos": ignore_eos, "return_token_ids": True, "stream": False})

    def parse_greedy_tokens(self, data: dict) -> list[int]:
        return [int(t) for t in data["choices"][0]["token_ids"]]

    def forced_probes(self, tokens: list[int], start: int) -> list[ForcedProbe]:
        if start < 1:
            raise ValueError("position 0 has no prefix to be scored from")
        body = {"prompt": tokens, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1, "stream": False}
        return [ForcedProbe(path="/v1/completions", body=body, positions=list(range(start, len(tokens))),
                            forced=tokens[start:])]

    def parse_forced(self, probe: ForcedProbe, data: dict) -> list[ForcedScore]:
        per_token = data["choices"][0]["prompt_logprobs"]
        n = len(probe.body["prompt"])
        if len(per_token) != n:
            raise ValueError(f"vLLM returned {len(per_token)} prompt logprobs for {n} prompt tokens")
        scores = []
        for position, forced in zip(probe.positions, probe.forced):
            entries = per_token[position] or {}
            mine = entries.get(str(forced))
            best = [int(t) for t, e in entries.items() if e.get("rank") == 1]
            if mine is None or not best:
                raise ValueError(f"vLLM prompt logprobs at position {position} lack token {forced} or the rank-1 token")
            scores.append(ForcedScore(position=position, logprob=float(mine["logprob"]), argmax=best[0]))
        return scores
