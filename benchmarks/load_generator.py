"""The load generator against the scripted fake server, side by side with guidellm and aiperf.

Two parts, each printing a markdown table:
  timed: the fake server streams on a schedule (--ttft-ms, then one token every --itl-ms);
         each client's TTFT (and, for lanebench, every ITL gap) is compared with the server's
         own write stamps. Error = client's interval - server's interval for the same request.
         The server busy-polls its sockets (fake_server.py --busy-poll), so a request's arrival
         stamp does not wait for its idle core to wake (--server-sleeps: as before).
  raw:   the fake server writes as fast as it can (--zero-delay), --events-per-write token events
         a write (16: the server's own syscalls stop capping the clients); streamed tokens per
         second over the server's busy span, the client's CPU, and TCP connections it accepted.
The server runs pinned to --server-cpu and every client to --client-cpu (os.sched_setaffinity),
so a client's ceiling is one core's. Peers are installed into throwaway venvs under /tmp
(`uv venv` + `uv pip install`), never into the project.

  uv run python benchmarks/load_generator.py                 # full run (quiet machine)
  uv run python benchmarks/load_generator.py --quick         # small scale, proves it works
  uv run python benchmarks/load_generator.py --peers none    # lanebench only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from math import nan
from pathlib import Path

import numpy as np

from _common import REPO, FakeServer, ints, loadavg, table
from peers import PEERS, python, run_peer

from tasks.client.load import Wave, run_wave
from tasks.client.metrics import percentile
from tasks.client.prompts import Prompt
from tasks.client.workers import run_spread
from tasks.engines import engine_for

PORT = 18531


def lanebench(url: str, concurrency: int, requests: int, tokens: int, workers: int = 1,
              cpus: list[int] | None = None) -> dict:
    """One closed-loop wave with lanebench's client: in this (pinned) process, or, given `cpus`,
    over `workers` processes pinned one a core to them (this process then only merges records)."""
    wave = Wave(lane="bench", stage="decode", repeat=1, concurrency=concurrency,
                requests_per_stream=max(1, requests // concurrency), max_tokens=tokens, workers=workers)
    prompts = [Prompt(id="p", prompt_class="bench", text="benchmark prompt")]
    result = run_spread(url, engine_for("vllm"), wave, prompts, cpus=cpus) if cpus else \
        run_wave(url, engine_for("vllm"), wave, prompts)
    # the wave's own CPU in every client process (a worker's interpreter start-up is not in it)
    return {"cpu_s": result.client_cpu_s, "wall_s": result.wall_s,
            "ok": sum(r.ok for r in result.records), "n": len(result.records),
            "tokens": sum(r.output_tokens for r in result.records if r.ok),
            "span_s": max(r.ended_s or 0.0 for r in result.records) - min(r.sent_s or 0.0 for r in result.records),
            "ttft": [(r.nonce, r.ttft_s) for r in result.records if r.ok],
            "chunks": {r.nonce: (r.chunk_arrivals_s, r.chunk_tokens, r.chunk_coalesced) for r in result.records if r.ok}}


def timed_row(client: str, got: dict, entries: list[dict], concurrency: int, itl_ms: float) -> dict:
    """Error = the client's interval minus the server's for the same request: TTFT against
    (first write - the kernel's stamp of the request's last byte reaching the server host), ITL
    gap by gap against the server's write gaps. The older references, for comparison: `read`, the
    server process's read of those bytes (adds its loop's wake-up, the reference before
    2026-12-03 11:00), and `parsed`, after its handler woke and parsed the request.
    A gap that touches a coalesced chunk (its read also carried a later event: its stamp is that
    event's arrival, an upper bound for its own) is left out of the ITL error and counted apart."""
    ttft_err, itl_err, parsed, read = [], [], [], []
    chunks = coalesced = 0

    def err(ttft: float, e: dict) -> float:
        parsed.append(ttft - (e["writes"][0] - e["recv"]))
        read.append(ttft - (e["writes"][0] - e.get("recv_read", e["recv"])))
        return ttft - (e["writes"][0] - e.get("recv_bytes", e["recv"]))

    if client.startswith("lanebench"):
        for nonce, ttft in got["ttft"]:
            (e,) = [e for e in entries if nonce in e["prompt"]]
            ttft_err.append(err(ttft, e))
            # A chunk starts at the write of its first token (the fake server writes one token per write).
            arrivals, tokens, shared = got["chunks"][nonce]
            first = np.cumsum([0, *tokens[:-1]])
            sent = [e["writes"][i] for i in first]
            chunks, coalesced = chunks + len(shared), coalesced + sum(shared)
            itl_err += [(arrivals[i + 1] - arrivals[i]) - (sent[i + 1] - sent[i]) for i in range(len(arrivals) - 1)
                        if not (shared[i] or shared[i + 1])]
    elif "ttft_by_id" in got:
        by_id = {e["id"]: e for e in entries}
        ttft_err = [err(t, by_id[i]) for i, t in got["ttft_by_id"].items() if i in by_id]
    elif len(got.get("ttft_in_order", [])) == len(entries):  # matched by send order
        ordered = sorted(entries, key=lambda e: e["recv"])
        ttft_err = [err(t, e) for t, e in zip(got["ttft_in_order"], ordered)]
    return {"client": client, "C": concurrency, "tok/s scheduled": round(concurrency * 1000 / itl_ms),
            "requests ok": f"{got['ok']}/{got['n']}",
            "TTFT err p50 ms": percentile(ttft_err, 50, nan) * 1e3, "TTFT err p99 ms": percentile(ttft_err, 99, nan) * 1e3,
            "vs read p50 ms": percentile(read, 50, nan) * 1e3,
            "vs parsed p50 ms": percentile(parsed, 50, nan) * 1e3, "vs parsed p99 ms": percentile(parsed, 99, nan) * 1e3,
            "ITL err p50 ms": percentile(itl_err, 50, nan) * 1e3,
            "ITL |err| p99 ms": percentile(np.abs(itl_err), 99, nan) * 1e3,
            "coalesced %": 100.0 * coalesced / chunks if chunks else float("nan")}


def raw_row(client: str, got: dict, entries: list[dict], concurrency: int, cores: int, server_cpu_s: float,
            servers: int) -> dict:
    """Streamed tokens/s from the first request's send to the last response's end, on the client's
    own per-request stamps (lanebench's records, aiperf's request_start/end_ns, guidellm's
    request_start/end_time). Not the server's busy span: a fast server has written the last
    round of responses into the socket buffers long before a client reads them, which overstated a
    row run in k rounds by about k/(k-1) (2x at 2 requests a stream; docs/benchmarks.md).
    `server busy %`: the fake servers' CPU over their busy span, per server process; near 100,
    the row measured the server, not the client."""
    span = (max(e["writes"][-1] for e in entries) - min(e["recv"] for e in entries)) if entries else float("nan")
    return {"client": client, "C": concurrency, "cores": cores, "requests ok": f"{got['ok']}/{got['n']}",
            "tok/s": got["tokens"] / got["span_s"] if got.get("span_s") else float("nan"),
            "client CPU us/token": 1e6 * got["cpu_s"] / max(got["tokens"], 1),
            "server busy %": 100 * server_cpu_s / (span * servers) if span else float("nan"),
            "connections": len({e["conn"] for e in entries})}


def workers_bound(concurrency: int, workers: int, one_core: dict[int, float]) -> float:
    """The tok/s `workers` processes reach if each streams at the one-core rate for its own share of
    the streams, and the busiest sets the span. Stream i runs in worker i mod N, every stream the same
    requests, so a worker with c streams is done after c / rate(c). One process reading many streams
    takes more events a read (one core: ~195k tok/s at C 1-16, ~301k at C 256 on a 16-core Xeon), so
    N workers of C/N streams each cannot reach N x the one-core row at C: that is the scaling loss this
    bound separates from the workers' own overhead. rate(c): log-log interpolated over the one-core
    rows, held at the end rows beyond them."""
    levels = sorted(one_core)
    x, y = np.log(levels), np.log([one_core[c] for c in levels])
    return concurrency / max(c / float(np.exp(np.interp(np.log(c), x, y)))
                             for c in streams_a_worker(concurrency, workers) if c)


def streams_a_worker(concurrency: int, workers: int) -> list[int]:
    """Streams each worker runs: stream i goes to worker i mod N (tasks/client/workers.py)."""
    return [len(range(i, concurrency, workers)) for i in range(workers)]


def versus(raw: list[dict], clients: list[str], streams_a_core: int | None = None) -> tuple[list[dict], list[dict]]:
    """From the raw rows: lanebench against the best peer on the same cores, and lanebench's
    scaling (tok/s over its one-core row), per concurrency, with the bound of `workers_bound`.
    With `streams_a_core` (weak scaling: C grows with the cores) the one-core row is the one at
    that C, so "of linear" holds each worker to what one core did with the same streams."""
    by = {(r["client"], r["C"], r["cores"]): r["tok/s"] for r in raw}
    one_core = {c: v for (who, c, cores), v in by.items() if who == "lanebench" and cores == 1 and v > 0}
    ratios, scaling = [], []
    for c, n in sorted({(r["C"], r["cores"]) for r in raw}):
        peers = {p: by[(p, c, n)] for p in clients[1:] if (p, c, n) in by}
        if peers and ("lanebench", c, n) in by:
            best = max(peers, key=lambda p: peers[p])
            ratios.append({"C": c, "cores": n, "lanebench tok/s": by[("lanebench", c, n)], "best peer": best,
                           "its tok/s": peers[best], "lanebench / best": by[("lanebench", c, n)] / peers[best]})
        base = streams_a_core if streams_a_core and c == streams_a_core * n else c
        if ("lanebench", base, 1) in by and ("lanebench", c, n) in by:
            gain = by[("lanebench", c, n)] / by[("lanebench", base, 1)]
            shares = streams_a_worker(c, n)
            scaling.append({"C": c, "cores": n, "tok/s": by[("lanebench", c, n)], "x one core": gain,
                            "of linear %": 100 * gain / n, "streams a worker": f"{min(shares)}-{max(shares)}",
                            "of workers' bound %": 100 * by[("lanebench", c, n)] / workers_bound(c, n, one_core)})
    return ratios, scaling


def one(client: str, server: FakeServer, concurrency: int, requests: int, tokens: int, work: Path,
        workers: int = 1, cpus: list[int] | None = None, parent: int | None = None) -> dict:
    """One run of one client. Given `cpus`, the client gets its first `workers` of them for its
    worker processes, and `parent` for the process that drives them (lanebench's merging parent;
    a peer's controller and record services, which it starts itself, share both)."""
    server.reset()
    if client == "lanebench":
        return lanebench(server.url, concurrency, requests, tokens, workers, cpus[:workers] if cpus else None)
    pinned = os.sched_getaffinity(0)
    if cpus:  # a peer spreads over its own worker processes, capped at the cores it is given
        os.sched_setaffinity(0, {*cpus[:workers], *([] if parent is None else [parent])})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        got = run_peer(client, server.url, concurrency, requests, tokens, work, workers if cpus else None)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:  # the row says 0/n; the run exits 1
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        print(f"{client} failed at C={concurrency}: {e}\n{err[-1500:]}", file=sys.stderr, flush=True)
        got = {"ok": 0, "n": requests, "tokens": 0, "span_s": 0.0}
    finally:
        os.sched_setaffinity(0, pinned)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    got["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small scale: C in 1,16; few requests")
    p.add_argument("--smoke", action="store_true", help="tiny scale, seconds: proves every part runs (CI)")
    p.add_argument("--peers", default="guidellm,aiperf", help="comma list, or 'none'")
    p.add_argument("--port", type=int, default=PORT, help="the fake server's port (loopback)")
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--raw-server-cpus", type=ints, default=None,
                   help="raw part: one zero-delay fake server per core listed, sharing the port (default: --server-cpu)")
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument("--workers", type=ints, default="1",
                   help="raw part, with --client-cpus: comma list of core counts; each client runs on that many "
                        "of the cores with as many worker processes (lanebench's, a peer's own), e.g. 1,2,4,8,12")
    p.add_argument("--client-cpus", type=ints, default=None,
                   help="raw part: the cores clients' worker processes are pinned to, one a core (default: every "
                        "client in one process on --client-cpu)")
    p.add_argument("--parent-cpu", type=int, default=None,
                   help="raw part, with --client-cpus: the core of the process that drives a client's workers")
    p.add_argument("--streams-a-core", type=int, default=None,
                   help="raw part, with --client-cpus: weak scaling, C = this many streams x each core count of "
                        "--workers (instead of C 1, 16, 64, 256 at every core count), so each worker keeps the "
                        "streams one core had")
    p.add_argument("--events-per-write", type=int, default=16,
                   help="raw part: token events the zero-delay server writes at once (1: one a write, as before 2026-12-03 11:00)")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=1.0)
    p.add_argument("--server-sleeps", action="store_true",
                   help="timed part: the fake server sleeps between writes (before 2026-12-01 15:30 UTC)")
    args = p.parse_args()
    levels_timed = [1, 4] if args.smoke else [1, 4, 16]
    levels_raw = [1, 4] if args.smoke else [1, 16] if args.quick else [1, 16, 64, 256]
    per_level = 2 if args.smoke else 8 if args.quick else 32  # requests per concurrency level (x C for C > 8)
    per_core_raw = per_level * (1 if args.smoke or args.quick else 8)  # raw requests a core: about 1 s of lanebench
    tokens_timed, tokens_raw = (16, 32) if args.smoke else (64, 256) if args.quick else (128, 1024)
    errors: list[str] = []  # any of these: the run exits 1 after printing what it has
    peers = [] if args.peers == "none" else args.peers.split(",")
    clients = ["lanebench", *[c for c in peers if c in PEERS]]
    work = Path(tempfile.mkdtemp(prefix="lb-loadgen-"))
    load = loadavg()
    print(f"# load generator benchmark: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} cores, load at start {' '.join(load)}, server cpu {args.server_cpu}, "
          f"clients cpu {args.client_cpu}, raw part {args.events_per_write} events a server write\n")
    log = work / "server.jsonl"

    timed, raw, layers = [], [], []
    # The reference polls instead of sleeping: its own wake-up is not the clients' error.
    with FakeServer(args.port, "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms),
                    *([] if args.server_sleeps else ["--busy-poll"]), cpus=[args.server_cpu], log=log) as server:
        os.sched_setaffinity(0, {args.client_cpu})  # after the server started: it pinned itself
        for c in levels_timed:
            for client in clients:
                n = per_level * max(1, c // 8) if c > 1 else per_level
                got = one(client, server, c, n, tokens_timed, work)
                timed.append(timed_row(client, got, server.entries(), c, args.itl_ms))
                print(timed[-1], flush=True)
    zero_delay = ["--zero-delay", "--events-per-write", str(args.events_per_write)]
    servers = args.raw_server_cpus or [args.server_cpu]
    with FakeServer(args.port, *zero_delay, cpus=servers, log=log) as server:
        if args.client_cpus and args.parent_cpu is not None:
            os.sched_setaffinity(0, {args.parent_cpu})
        cores = [n for n in args.workers if n <= len(args.client_cpus)] if args.client_cpus else [1]
        rows = [(args.streams_a_core * n, n) for n in cores] if args.streams_a_core else \
            [(c, n) for c in levels_raw for n in cores if n <= c]  # more worker processes than streams would idle
        for c, n in rows:
            for client in clients:
                before = server.cpu_s()
                got = one(client, server, c, max(4 * c, per_core_raw * n), tokens_raw, work, n, args.client_cpus,
                          args.parent_cpu)
                raw.append(raw_row(client, got, server.entries(), c, n, server.cpu_s() - before, len(servers)))
                print(raw[-1], flush=True)
    ratios, scaling = versus(raw, clients, args.streams_a_core)
    if "aiperf" in clients:  # its venv has httpx and aiohttp: the HTTP layer comparison, on one server
        with FakeServer(args.port, *zero_delay, cpus=[args.server_cpu], log=log) as server:  # (its /stats counts connections)
            interpreter, env = python("aiperf")
            res = subprocess.run([*interpreter, str(REPO / "benchmarks/http_layers.py"),
                                  "--url", server.url, "--levels", ",".join(map(str, levels_raw)),
                                  "--tokens", str(tokens_raw)], capture_output=True, text=True, timeout=900, env=env)
            layers = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
            if res.returncode:
                print(res.stderr[-2000:], flush=True)
                errors.append(f"benchmarks/http_layers.py exited {res.returncode}")
    load_end = loadavg()
    print(f"\n## timed (TTFT {args.ttft_ms:g} ms, one token every {args.itl_ms:g} ms per stream)\n")
    print(table(timed))
    print("\n## raw ceiling (zero-delay server; peers' CPU is their whole run, start-up included)\n")
    print(table(raw))
    if ratios:
        print("\n## lanebench against the best peer, on the same cores\n")
        print(table(ratios))
    if any(r["cores"] > 1 for r in scaling):
        print("\n## lanebench's scaling over cores (worker processes, one a core)\n")
        print(table(scaling))
    if layers:
        print("\n## HTTP layers (same zero-delay streams, same work per read)\n")
        print(table(layers))
    print(f"\nload at end {' '.join(load_end)}")
    errors += [f"{r['client']} C={r['C']}: {r['requests ok']} requests ok" for r in timed + raw
               if r["requests ok"].split("/")[0] != r["requests ok"].split("/")[1]]
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
