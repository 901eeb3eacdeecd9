"""The client against a server that steps like a batching engine: is it still not the bottleneck?

llama-server on a GPU writes one event to every stream in the same decode step (docs/benchmarks.md,
"Why the flag fired"). This runs the wave client (tasks/client/load.py) against fake_server.py
`--step-ms`, keeping records in a real run folder as a nightly does, and prints per level: tok/s,
the loop lag p99 and max (the client-bound flag's input), client CPU, whether the flag fired,
and the loop's longest turns (measured around each epoll wait).

Run: python benchmarks/client_bursts.py [--step-ms 10.6] [--levels 1,2,4,8,16,32,64] [--workers N] [--out f.json] [--strict]
`--workers N` spreads each wave over N kept worker processes as a lane's `workers` does (their
loop turns are then not timed here). Exits 1 on any failed request, and with --strict also when
the flag fires at any level (on a quiet machine a client that cannot keep up must not pass).
"""

from __future__ import annotations

import argparse
import json
import selectors
import sys
import tempfile
import time
from pathlib import Path

from _common import FakeServer, ints

from tasks.client.load import Wave, run_wave
from tasks.client.prompts import Prompt
from tasks.engines import engine_for
from tasks.record.run_folder import RunFolder

_TURNS: list[float] = []  # wall seconds of each loop turn (from one epoll return to the next wait)
_select, _left = selectors.EpollSelector.select, [0.0]


def _timed_select(self, timeout=None):
    t = time.perf_counter()
    if _left[0]:
        _TURNS.append(t - _left[0])
    try:
        return _select(self, timeout)
    finally:
        _left[0] = time.perf_counter()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, default=10.6, help="the server's step (10.6 ms: 64 streams at ~6k tok/s)")
    p.add_argument("--levels", type=ints, default="1,2,4,8,16,32,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=18590)
    p.add_argument("--out", default=None)
    p.add_argument("--workers", type=int, default=1, help="wave client processes (a lane's decode `workers`)")
    p.add_argument("--strict", action="store_true", help="exit 1 when the client-bound flag fires at any level")
    args = p.parse_args()
    selectors.EpollSelector.select = _timed_select  # type: ignore[method-assign]
    rows, fired, failed = [], False, False
    with FakeServer(args.port, "--ttft-ms", "5", "--itl-ms", str(args.step_ms), "--step-ms", str(args.step_ms)) as server, \
            tempfile.TemporaryDirectory() as tmp:
        engine = engine_for("vllm")  # the fake server speaks OpenAI completions
        prompts = [Prompt(id=f"p{i}", prompt_class="prose", text=f"the river town kept its ledgers {i} " * 8)
                   for i in range(64)]
        inventory = Path(tmp, "hosts.yaml")
        inventory.write_text("hosts: {}\n")
        run = RunFolder(Path(tmp), "client-bursts", "0" * 16, inventory)
        for c in args.levels:
            for repeat in range(1, args.repeats + 1):
                wave = Wave(lane="bursts", stage="decode", repeat=repeat, concurrency=c, requests_per_stream=2,
                            max_tokens=args.max_tokens, stall_s=10.0, workers=args.workers)
                _TURNS.clear()
                _left[0] = 0.0
                res = run_wave(server.url, engine, wave, prompts,
                               lambda r: run.append_jsonl("bursts", "requests.jsonl", r))
                turns = sorted(_TURNS)
                row = {"concurrency": c, "workers": min(args.workers, c), "repeat": repeat, "ok": sum(r.ok for r in res.records),
                       "requests": len(res.records), "tok_s": round(res.output_tokens / res.wall_s, 1),
                       "lag_p99_ms": round(1e3 * res.loop_lag_p99_s, 3), "lag_max_ms": round(1e3 * res.loop_lag_max_s, 3),
                       "client_cpu": round(res.client_cpu, 3), "client_bound": res.client_saturated,
                       "longest_turns_ms": [round(1e3 * t, 2) for t in turns[-5:]]}
                fired |= res.client_saturated
                failed |= row["ok"] != row["requests"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print("requests failed" if failed else "client-bound at some level" if fired else "the client kept up at every level")
    return 1 if failed or (fired and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
