"""llama.cpp's `llama-server`: the rehearsal engine, and a real engine for GGUF lanes.

Facts used here were read from the llama.cpp tree vendored in llama-cpp-python 0.3.36
(tools/server/server-task.cpp for the metric names, server-context.cpp for the log lines):
- speculation needs BOTH `--model-draft` and `--spec-type`; with only the first, the draft
  model loads and nothing is ever drafted (the counter gate exists for this);
- `-c` is the total context, split over `-np` slots;
- `llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="k"}` counts, per
  verification step, whether draft position k was accepted (so it never rises with k).
"""

from __future__ import annotations

import re

from tasks.config import Lane
from tasks.engines.base import Engine, per_position_from_counts
from tasks.records import Acceptance, BootFacts, Metrics, RequestRecord, RequestSpec, StreamEvent

_SLOTS = re.compile(r"initializing, n_slots = (\d+), n_ctx_slot = (\d+)")
_DRAFT_LOADED = re.compile(r"loading draft model '([^']*)'")
_SPEC_IMPL = re.compile(r"adding speculative implementation '([^']+)'")
_SPEC_TYPE = re.compile(r"speculative decoding.*type[ =:]+'?([a-z0-9-]+)")

_P = "llamacpp:"


class LlamaCpp(Engine):
    name = "llamacpp"
    info_path = "/props"

    def launch_command(self, lane: Lane, binary: str, host: str) -> list[str]:
        argv = [
            binary,
            "--model", lane.model.path,
            "--host", host,
            "--port", str(lane.port),
            "--parallel", str(lane.slots),
            "--ctx-size", str(lane.context * lane.slots),
            "--metrics",
            "--no-webui",
        ]
        if lane.threads:
            argv += ["--threads", str(lane.threads), "--threads-batch", str(lane.threads)]
        if lane.drafter is not None:
            argv += ["--model-draft", lane.drafter.path]
            if lane.threads:
                argv += ["--threads-draft", str(lane.threads)]
        if lane.speculative is not None:
            argv += ["--spec-type", lane.speculative.method, "--spec-draft-n-max", str(lane.speculative.k)]
        return argv + list(lane.flags)

    def boot_facts(self, log: str) -> BootFacts:
        facts = BootFacts()
        if m := _SLOTS.search(log):
            facts.max_running_requests, facts.context_per_slot = int(m[1]), int(m[2])
        if m := _DRAFT_LOADED.search(log):
            facts.draft_model_loaded = True
            facts.extra["draft_model"] = m[1]
        if m := _SPEC_IMPL.search(log) or _SPEC_TYPE.search(log):
            facts.speculative_type = m[1]
        return facts

    def info_facts(self, facts: BootFacts, info: dict) -> BootFacts:
        """/props: `total_slots`, and `speculative.types` in default_generation_settings.params."""
        params = (info.get("default_generation_settings") or {}).get("params") or {}
        spec = params.get("speculative.types")
        if spec and spec != "none":
            facts.speculative_type = spec
        if facts.max_running_requests is None and isinstance(info.get("total_slots"), int):
            facts.max_running_requests = info["total_slots"]
        return facts

    def acceptance(self, before: Metrics, after: Metrics, requests: list[RequestRecord], k: int) -> Acceptance | None:
        def delta(name: str) -> float:
            return after.get(_P + name) - before.get(_P + name)

        steps = delta("spec_decode_num_drafts_total")
        if steps <= 0:
            return None
        accepted = delta("spec_decode_num_accepted_tokens_total")
        per_pos = [delta(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}') for i in range(k)]
        return Acceptance(
            verify_steps=steps,
            accepted=accepted,
            draft_tokens=delta("spec_decode_num_draft_tokens_total"),
            acceptance_length=1.0 + accepted / steps,
            per_position=per_position_from_counts(per_pos, steps),
            source="counters",
        )

    def completion_request(self, prompt: str, max_tokens: int) -> RequestSpec:
        # Native /completion: its final chunk carries `timings` with draft_n / draft_n_accepted.
        return RequestSpec(
            path="/completion",
            body={
                "prompt": prompt,
                "n_predict": max_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "stream": True,
                "cache_prompt": False,
            },
        )

    def parse_event(self, data: dict) -> StreamEvent:
        if not data.get("stop"):
            return StreamEvent(text=data.get("content", ""), tokens=len(data.get("tokens") or []) or 1)
        timings = data.get("timings") or {}
        spec = None
        if "draft_n" in timings:
            spec = {"draft_n": float(timings["draft_n"]), "draft_n_accepted": float(timings.get("draft_n_accepted", 0))}
        return StreamEvent(
            text=data.get("content", ""),
            tokens=0,
            done=True,
            completion_tokens=int(data.get("tokens_predicted", timings.get("predicted_n", 0))),
            prompt_tokens=data.get("tokens_evaluated", timings.get("prompt_n")),
            finish_reason="length" if data.get("stop_type") == "limit" else "stop",
            spec=spec,
        )
