"""vLLM's boot log and /version, read per release (checked against the 0.33.0 wheel; line examples in
tests/fixtures/engines/README.md):
- `Initializing a V1 LLM engine (v%s) with config: %s` (`vllm/v1/engine/core.py`, DP rank 0 only):
  `speculative_config=SpeculativeConfig(method='m', model='p'|None, num_spec_tokens=K)` (model None for
  ngram, suffix, ...) and `tensor_parallel_size=`, `pipeline_parallel_size=`, `data_parallel_size=`.
  A headless worker node prints `Launching vLLM (v%s) headless multiproc executor`.
- `non-default args: {...}` (`vllm/entrypoints/common/startup.py`): `max_num_seqs` when set.
- `%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx`
  (`vllm/v1/core/kv_cache_utils.py`): pool "GPU", "GPU + host" (HiSparse offload), or "CPU" (the
  0.32.0 CPU build), on one line from 0.32.0; older releases printed `GPU KV cache size: N tokens`
  and the concurrency on two lines. `init engine (profile, create kv cache, warmup model) took S s`.
- `Loading drafter model...` (`vllm/v1/worker/gpu_model_runner.py`, `cpu_model_runner.py`): Model
  Runner V1 only, printed for model-free methods (ngram) too, so it counts only when the config names
  a draft model. The CPU build (no Triton) always runs V1 (`Model Runner V2 requires Triton; using the
  V1 model runner instead`); 0.33.0 defaults to V2 (`VllmConfig.use_v2_model_runner`), which prints no
  such line: the drafter is then known from the config line and the spec-decode counters.
- `GET /version` -> `{"version": "..."}` (`vllm/entrypoints/serve/instrumentator/basic.py`).

Cap per engine = min(max_num_seqs, floor(max concurrency)); `max_num_seqs` is per data-parallel rank
(`vllm/config/scheduler.py`), so the deployment's is that x `data_parallel_size`.
"""

from __future__ import annotations

import math
import re

from tasks.engines.facts import BootFacts
from tasks.engines.releases import Format, formats_for

FORMATS = [Format(name="kv-line-pool", since="0.32.0"), Format(name="kv-line-gpu", until="0.32.0")]
# Model Runner V2 became the default (and stopped logging "Loading drafter model") in this range.
RUNNER_V2 = Format(name="model-runner-v2", since="0.33.0")

_VERSION = re.compile(r"(?:Initializing a V1 LLM engine|Launching vLLM) \(v([^)\s]+)\)")
_KV = {
    "kv-line-pool": re.compile(r"(\w+(?: \+ host)?) KV cache size: ([\d,]+) tokens"),
    "kv-line-gpu": re.compile(r"(GPU) KV cache size: ([\d,]+) tokens"),
}
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_MAX_NUM_SEQS = re.compile(r"non-default args: .*'max_num_seqs': (\d+)")
_MAX_MODEL_LEN = re.compile(r"Using max model len (\d+)")
_SPEC = re.compile(r"speculative_config=SpeculativeConfig\(method='([^']+)'"
                   r"(?:, model=(?:'([^']*)'|None))?(?:, num_spec_tokens=(\d+))?")
_SIZES = re.compile(r"\b(tensor_parallel_size|pipeline_parallel_size|data_parallel_size)=(\d+)")
_DRAFTER = re.compile(r"Loading drafter model")
# A platform without Triton (the CPU build) falls back to Model Runner V1 whatever the release's
# default: its "Loading drafter model" line is then expected.
_RUNNER_V1 = re.compile(r"using the V1 model runner instead")
_INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
_TORCH_THREADS = re.compile(r"Reducing Torch threads from (\d+) to (\d+)")
# The engine config line's resolved dtype (the CPU build serves float32 weights as bfloat16
# unless --dtype says otherwise) and KV-cache dtype: what a KL gate's candidate really ran.
_DTYPE = re.compile(r"\btrust_remote_code=\w+, dtype=(?:torch\.)?(\w+)")
_KV_DTYPE = re.compile(r"\bkv_cache_dtype=(\w+)")


def version_in(log: str) -> str | None:
    m = _VERSION.search(log)
    return m[1] if m else None


def boot_facts(log: str, version: str | None = None) -> BootFacts:
    version = version or version_in(log)
    facts = BootFacts(version=version)
    if version:
        facts.extra["version"] = version
    seqs = concurrency = None
    if m := _MAX_NUM_SEQS.search(log):
        seqs = facts.extra["max_num_seqs"] = int(m[1])
    if ms := list(_CONCURRENCY.finditer(log)):
        facts.extra["cap_line"] = ms[-1][0]  # quoted by the capacity gate
        facts.context_per_slot = int(ms[-1][1].replace(",", ""))
        concurrency = math.floor(float(ms[-1][2]))
        facts.extra["kv_max_concurrency"] = float(ms[-1][2])
    elif m := _MAX_MODEL_LEN.search(log):
        facts.context_per_slot = int(m[1])
    for fmt in formats_for(FORMATS, version):
        if m := _KV[fmt.name].search(log):
            facts.extra["kv_cache_tokens"] = int(m[2].replace(",", ""))
            facts.extra["kv_pool"] = m[1]
            facts.extra["log_format"] = fmt.name
            break
    sizes = {k: int(v) for k, v in _SIZES.findall(log)}
    dp = sizes.get("data_parallel_size", 1)
    facts.parallel = {"dp_workers": dp, "tp_size": sizes.get("tensor_parallel_size", 1),
                      "pp_size": sizes.get("pipeline_parallel_size", 1)}
    if known := [c for c in (seqs, concurrency) if c is not None]:
        facts.extra["cap_per_worker"] = min(known)
        facts.note("max_running_requests", "log", min(known) * dp)
    if spec := _SPEC.search(log):
        facts.note("speculative_type", "log", spec[1])
        if spec[2]:
            facts.extra["draft_model"] = spec[2]
        if spec[3]:
            facts.extra["num_spec_tokens"] = int(spec[3])
    runner_v1 = bool(_RUNNER_V1.search(log)) or bool(version and not RUNNER_V2.covers(version))
    facts.extra["model_runner"] = "v1" if runner_v1 else "v2"
    for key, pattern, group, cast in (("init_engine_s", _INIT_ENGINE, 1, float), ("dtype", _DTYPE, 1, str),
                                      ("kv_cache_dtype", _KV_DTYPE, 1, str), ("torch_threads", _TORCH_THREADS, 2, int)):
        if m := pattern.search(log):
            facts.extra[key] = cast(m[group])
    if spec and spec[2]:  # "Loading drafter model" counts only with a draft model configured (module docstring)
        if _DRAFTER.search(log):
            facts.note("draft_model_loaded", "log", True)
        elif runner_v1:
            facts.note("draft_model_loaded", "log", False)
        facts.note("draft_model_loaded", "config", True)
    elif spec:
        facts.note("draft_model_loaded", "config", False)  # ngram, suffix, ...: no drafter to load
    return facts.reconcile()
