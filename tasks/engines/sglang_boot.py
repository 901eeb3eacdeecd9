"""SGLang's boot log and /server_info, read per release (checked against the 0.5.23 wheel; line
examples in tests/fixtures/engines/README.md):
- `server_args={...}`: every resolved field, logged once by `srt/entrypoints/engine.py`
  (`ServerArgs.resolved_dict`) from 0.5.23; older builds logged `server_args=ServerArgs(a=1, ...)`.
- Rank prefix `[%(asctime)s{.ms} DP{d} PP{p} ATTN_CP{c} MOE_DP{m} TP{t} EP{e}]` (`srt/managers/scheduler.py`
  `configure_scheduler_process`; each field only when that width is > 1, DP whenever a dp rank exists).
- `max_total_num_tokens=..., max_running_requests=R, context_len=L, ...`: printed on `tp_rank == 0`
  only, R per data-parallel worker (`srt/mem_cache/kv_cache_configurator.py`: `requested //
  attn_dp_size`). With attention-DP one line stands for every worker; plain DP prints one per replica.
- `max_running_requests is capped to N by the mamba state cache (max_mamba_cache_size=M, S state
  slots per request)` (kv_cache_configurator.py), per worker.
- `Load weight end. elapsed=..., type=<class>, ...` (`srt/model_executor/model_runner.py`) once per
  model runner: the second on a rank is the draft worker's.
- `/server_info`: the resolved args flat, `internal_states[i].effective_max_running_requests_per_dp`
  (`srt/managers/scheduler_components/internal_state.py`) and `version`.

Deployment cap = per-worker cap x `dp_size * attn_dp_size` (`srt/arg_groups/fields/parallel.py`);
tensor and pipeline widths shard one worker.
"""

from __future__ import annotations

import ast
import re

from tasks.engines.facts import BootFacts
from tasks.engines.releases import Format, formats_for

FORMATS = [Format(name="server-args-dict", since="0.5.23"), Format(name="server-args-repr", until="0.5.23")]

PREFIX = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?((?: [A-Z_]+\d+)*)\] ?")
_ARGS = {"server-args-dict": re.compile(r"server_args=(\{.*\})\s*$", re.M),
         "server-args-repr": re.compile(r"server_args=ServerArgs\((.*)\)\s*$", re.M)}
_MAMBA_CAP = re.compile(
    r"max_running_requests is capped to (\d+) by the mamba state cache\s+"
    r"\(max_mamba_cache_size=(\d+), (\d+) state slots per request\)"
)
_SCHED = re.compile(r"max_total_num_tokens=(\d+), .*?max_running_requests=(\d+), context_len=(\d+)")
_WEIGHT_END = re.compile(r"Load weight end\..*?type=(\w+)")
_DRAFTERLESS = {"NGRAM"}  # methods that draft without a draft model
_KEYS = ("speculative_algorithm", "speculative_draft_model_path", "max_running_requests", "dp_size",
         "attn_dp_size", "tp_size", "pp_size", "attn_cp_size", "nnodes", "max_mamba_cache_size")


def _scalar(text: str) -> str | int | None:
    """One logged value as `'[^']*'|-?\\d+|None|True|False` matched it."""
    text = text.strip()
    if text in ("None", ""):
        return None
    return text[1:-1] if text[0] in "'\"" else int(text) if text.lstrip("-").isdigit() else text


def server_args(log: str, version: str | None) -> tuple[str | None, dict[str, str | int | None]]:
    """The logged server args in the format the version prints: (format name, the keys we use)."""
    for fmt in formats_for(FORMATS, version):
        if (m := _ARGS[fmt.name].search(log)) is None:
            continue
        if fmt.name == "server-args-dict":
            try:
                whole = ast.literal_eval(m[1])
                return fmt.name, {k: whole.get(k) for k in _KEYS if k in whole}
            except (ValueError, SyntaxError):  # a value without a literal repr: read keys one by one
                pattern = r"'{}': ('[^']*'|-?\d+|None|True|False)"
        else:
            pattern = r"\b{}=('[^']*'|-?\d+|None|True|False)"
        return fmt.name, {k: _scalar(v[1]) for k in _KEYS if (v := re.search(pattern.format(k), m[1]))}
    return None, {}


def _tag(line: str) -> tuple[str, str]:
    m = PREFIX.search(line)
    return ((m[1] or "").strip(), line[m.end():]) if m else ("", line)


def _dp(tag: str) -> str:
    return next((t for t in tag.split() if re.fullmatch(r"DP\d+", t)), "")


def _workers(args: dict) -> int | None:
    dp, attn_dp = args.get("dp_size"), args.get("attn_dp_size")
    if isinstance(dp, int) or isinstance(attn_dp, int):
        return (dp if isinstance(dp, int) else 1) * (attn_dp if isinstance(attn_dp, int) else 1)
    return None


def boot_facts(log: str, version: str | None = None) -> BootFacts:
    facts = BootFacts(version=version)
    fmt, args = server_args(log, version)
    if fmt is not None:
        facts.extra["log_format"] = fmt
    per_worker: list[int] = []
    tags: set[str] = set()
    weights: dict[str, list[str]] = {}
    for line in log.splitlines():
        tag, msg = _tag(line)
        if m := _SCHED.search(msg):
            per_worker.append(int(m[2]))
            tags.add(_dp(tag))
            facts.context_per_slot = int(m[3])
            facts.extra["max_total_num_tokens"] = int(m[1])
        if m := _WEIGHT_END.search(msg):
            weights.setdefault(tag, []).append(m[1])
    # Searched over the whole text so a line wrapped by a report still counts.
    for m in _MAMBA_CAP.finditer(log):
        tag, _ = _tag(log[log.rfind("\n", 0, m.start()) + 1:m.start()] + "x")
        per_worker.append(int(m[1]))
        tags.add(_dp(tag))
        facts.extra["mamba_capped_to"] = int(m[1])
        facts.extra["max_mamba_cache_size"] = int(m[2])
        facts.extra["mamba_state_slots_per_request"] = int(m[3])
    # Data-parallel workers: the logged sizes when the args line said them, else one per DP tag seen.
    workers = _workers(args) or max(len(tags), 1)
    facts.parallel = {"dp_workers": workers, **{k: v for k in ("tp_size", "pp_size", "attn_cp_size", "nnodes")
                                                 if isinstance(v := args.get(k), int)}}
    if per_worker:
        facts.extra["cap_per_worker"] = min(per_worker)
        facts.note("max_running_requests", "log", min(per_worker) * workers)
    if isinstance(asked := args.get("max_running_requests"), int):
        facts.extra["requested_max_running_requests"] = asked
    algo = args.get("speculative_algorithm")
    facts.note("speculative_type", "log", algo if isinstance(algo, str) else None)
    if isinstance(path := args.get("speculative_draft_model_path"), str):
        facts.extra["draft_model_path"] = path
    if drafts := [w[1] for w in weights.values() if len(w) >= 2]:
        facts.extra["draft_model_type"] = drafts[0]
        facts.note("draft_model_loaded", "log", True)
    elif weights and isinstance(algo, str) and algo.upper() not in _DRAFTERLESS:
        facts.note("draft_model_loaded", "log", False)  # the target loaded on every rank, no draft worker did
    return facts.reconcile()


def info_facts(facts: BootFacts, info: dict) -> BootFacts:
    """/server_info's readings beside the log's: its own cap, speculation type and version."""
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
    per_dp = [s["effective_max_running_requests_per_dp"] for s in states
              if isinstance(s.get("effective_max_running_requests_per_dp"), int)]
    if per_dp:
        workers = _workers(info) or len(states) or 1
        facts.note("max_running_requests", "server_info", min(per_dp) * workers)
        facts.parallel.setdefault("dp_workers", workers)
    if info.get("speculative_algorithm"):
        facts.note("speculative_type", "server_info", str(info["speculative_algorithm"]))
    if facts.context_per_slot is None and isinstance(info.get("context_length"), int):
        facts.context_per_slot = info["context_length"]
    facts.info_version(info.get("version"), "server_info")
    return facts.reconcile()
