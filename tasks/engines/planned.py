"""Running-request caps computed from a lane's config, before anything boots.

Each is an upper bound (the KV pool, known only at boot, may allow fewer), so a bench concurrency
above it fails the capacity gate for sure: better said at config time than after an image pull and
a ten-minute boot (the shipped GB300 example once asked 48 of a server its own
`--max-mamba-cache-size 48` capped at 9).

- SGLang 0.5.23 (`srt/mem_cache/kv_cache_configurator.py` `_calculate_mamba_ratio`): per worker,
  `max_mamba_cache_size // ratio` and `--max-running-requests // attn_dp_size`; ratio = 3 state slots
  per request plus the radix cache's extra buffer (2 with the overlap scheduler, 1 without or lazy,
  `srt/mem_cache/allocation_sizing.py`), or 1 with `--disable-radix-cache`. 'auto' resolves per
  model; we take the extra buffer (5, as the GLM field logs print), its lowest cap. Workers =
  dp_size x attn_dp_size.
"""

from __future__ import annotations

from tasks.engines.facts import PlannedCap
from tasks.inventory.flag_conflicts import flag_values
from tasks.inventory.models import Lane


def flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last of `names` in an argv (`--x v` or `--x=v`); argparse keeps the last."""
    return next(reversed(flag_values(argv, names)), None)


def int_flag(argv: list[str], *names: str) -> int | None:
    value = flag_value(argv, *names)
    return int(value) if value is not None and value.isdigit() else None


def sglang_cap(lane: Lane, argv: list[str]) -> PlannedCap | None:
    dp = int_flag(argv, "--dp-size", "--data-parallel-size") or 1
    attn_dp = int_flag(argv, "--attn-dp-size", "--attention-data-parallel-size") or 1
    if "--enable-dp-attention" in argv:  # deprecated spelling: --dp-size N means N attention-DP workers
        dp, attn_dp = 1, dp
    workers = dp * attn_dp
    per_worker_wanted = -(-max(lane.bench.decode.gated_levels()) // workers)
    caps: list[tuple[int, str, str]] = []
    if (cache := int_flag(argv, "--max-mamba-cache-size")) is not None:
        strategy = flag_value(argv, "--mamba-radix-cache-strategy") or "auto"
        if "--disable-radix-cache" in argv:
            ratio, why = 1, "--disable-radix-cache"
        elif strategy == "no_buffer":
            ratio, why = 3, "strategy no_buffer"
        elif strategy == "extra_buffer_lazy" or "--disable-overlap-schedule" in argv:
            ratio, why = 4, f"strategy {strategy}, extra buffer of 1"
        else:
            ratio, why = 5, f"strategy {strategy}: extra buffer with the overlap scheduler"
        caps.append((cache // ratio, f"--max-mamba-cache-size {cache} // {ratio} state slots per request ({why})",
                     f"raise --max-mamba-cache-size to at least {per_worker_wanted * ratio}"))
    if (asked := int_flag(argv, "--max-running-requests")) is not None:
        split = f" // {attn_dp} attention-DP workers" if attn_dp > 1 else ""
        caps.append((max(1, asked // attn_dp), f"--max-running-requests {asked}{split}",
                     f"raise --max-running-requests to at least {per_worker_wanted * attn_dp}"))
    if not caps:
        return None
    per_worker, reason, fix = min(caps)
    shape = f" x {workers} data-parallel workers" if workers > 1 else ""
    return PlannedCap(cap=per_worker * workers, reason=f"{reason}{shape}", fix=fix)


def check(lane: Lane, planned: PlannedCap | None) -> str | None:
    """A one-line reason when the lane's capacity gate cannot pass its own bench, else None (levels
    declared `beyond_cap: queue` are let through, as the gate lets them)."""
    wanted = max(lane.bench.decode.gated_levels())
    if planned is None or planned.cap >= wanted or not any(g.kind == "capacity" for g in lane.gates):
        return None
    return (f"running requests are capped at {planned.cap} by the config ({planned.reason}), below bench "
            f"concurrency {wanted}. Fix: {planned.fix}, or lower bench.decode.concurrency")
