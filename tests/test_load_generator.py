"""The load generator against servers whose behaviour we know: the scripted fake server in
benchmarks/ (true timings logged server-side) and the pinned llama-server.

Bounds are generous on purpose: the box is shared, so these check that the clocks sit in the
right place (milliseconds, not tens of them) and the bookkeeping is exact; the sub-millisecond
targets are the benchmark's (benchmarks/load_generator.py), run on a quiet machine.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
import urllib.request

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, fake_server, shipped_inventory
from tasks.client.metrics import steady_window
from tasks.client.prompts import Prompt
from tasks.client import workers
from tasks.client.load import Wave, run_wave
from tasks.engines import engine_for
from tasks.inventory.models import DecodePlan, Inventory
from tasks.record.expectations import validate
from tasks.stages.decode_curve import levels, summarize

PORT = 18521
TTFT_MS, ITL_MS = 20.0, 5.0
VLLM = engine_for("vllm")  # the fake server speaks OpenAI /v1/completions with vLLM's token_ids


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    log = tmp_path_factory.mktemp("fake") / "writes.jsonl"
    with fake_server(PORT, "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS), "--ping-s", "0.05",
                     "--log", str(log)) as url:
        yield url, log


def _stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/stats") as r:
        return json.load(r)


def _prompts(*texts: str) -> list[Prompt]:
    return [Prompt(id=f"p{i}", prompt_class="t", text=t) for i, t in enumerate(texts)]


def _wave(concurrency: int, per_stream: int, max_tokens: int = 16, **kw) -> Wave:
    return Wave(lane="l", stage="decode", repeat=1, concurrency=concurrency, requests_per_stream=per_stream,
                max_tokens=max_tokens, **kw)


def test_connections_opened_equal_concurrency_not_requests(fake):
    url, _ = fake
    before = _stats(url)["connections"]
    result = run_wave(url, VLLM, _wave(8, 4), _prompts("a", "b", "c"))
    assert all(r.ok for r in result.records) and len(result.records) == 32
    assert result.connections_opened == 8
    assert _stats(url)["connections"] - before == 8 + 1  # the server agrees (+1: this /stats call)
    assert sum(r.reused_connection for r in result.records) == 24
    assert all((r.connect_s is None) == r.reused_connection for r in result.records)


def test_a_request_larger_than_the_socket_buffer_goes_out_whole(fake):
    """A long prompt (prefill ladder) is more than one send takes: the rest goes out as the socket
    drains, and the connection then serves the next request."""
    url, _ = fake
    result = run_wave(url, VLLM, _wave(1, 2), _prompts("long " * 1_000_000))  # 5 MB each
    assert [r.ok for r in result.records] == [True, True], [r.error for r in result.records]
    assert result.connections_opened == 1


def test_clocks_match_the_servers_write_times(fake):
    url, log = fake
    result = run_wave(url, VLLM, _wave(2, 4, max_tokens=24), _prompts("x"))
    writes = {json.loads(line)["prompt"]: json.loads(line) for line in log.read_text().splitlines()}
    ttft_err, itl_err = [], []
    for r in result.records:
        (w,) = [w for p, w in writes.items() if r.nonce in p]
        ttft_err.append(r.ttft_s - (w["writes"][0] - w["recv"]))
        # each chunk starts at the write of its first token (one token per write)
        starts = [w["writes"][i] for i in np.cumsum([0, *r.chunk_tokens[:-1]])]
        a = r.chunk_arrivals_s
        itl_err += [(a1 - a0) - (s1 - s0) for a0, a1, s0, s1 in zip(a, a[1:], starts, starts[1:])]
        assert r.output_tokens == 24 and sum(r.chunk_tokens) == 24
        assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / 23)
    # The client's TTFT is the server's plus loopback: never less, and (busy box) within a few ms;
    # each ITL gap matches the server's own gap between the writes.
    assert -0.0005 < statistics.median(ttft_err) < 0.015
    assert abs(statistics.median(itl_err)) < 0.003


def test_the_fake_server_stamps_a_request_with_the_kernels_arrival(fake):
    """The TTFT reference starts at the kernel's receive stamp of the request's last byte, before
    the server's loop read it, before its handler parsed it: strictly earlier where the kernel
    stamps (a missing stamp falls back to the read's own time and fails here)."""
    url, log = fake
    log.write_text("")
    result = run_wave(url, VLLM, _wave(2, 3), _prompts("stamps"))
    assert all(r.ok for r in result.records)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(entries) == 6
    for e in entries:
        assert e["recv_bytes"] < e["recv_read"] <= e["recv"] < e["writes"][0], e
        assert e["recv_read"] - e["recv_bytes"] < 1.0  # a stamp on the same clock, not a raw wall time


def test_events_written_together_arrive_whole(tmp_path):
    """--events-per-write (the raw ceiling's server): 16 token events a write, the last write
    short; the client counts every token, and the server's log shows the writes it made."""
    log = tmp_path / "writes.jsonl"
    with fake_server(PORT + 1, "--zero-delay", "--events-per-write", "16", "--log", str(log)) as url:
        result = run_wave(url, VLLM, _wave(2, 2, max_tokens=40), _prompts("batched"))
    assert [r.output_tokens for r in result.records] == [40] * 4, [r.error for r in result.records]
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [len(e["writes"]) for e in entries] == [3 + 1] * 4  # 16 + 16 + 8 token events, then the final one


def test_the_raw_ceilings_batched_writes_carry_the_same_events_byte_for_byte():
    """--zero-delay with several events a write renders them from cached tails (the server's own
    CPU must not cap the clients it measures): the events are the one-a-write path's, to the byte,
    for a vLLM completion with running usage and for a chat stream."""
    bodies = [({"prompt": "x", "max_tokens": 37, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "/v1/completions"),
              ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 21, "stream": True}, "/v1/chat/completions")]
    streams = {}
    for per_write in ("1", "16"):
        with fake_server(PORT + 40, "--zero-delay", "--events-per-write", per_write) as url:
            streams[per_write] = [urllib.request.urlopen(urllib.request.Request(
                url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})).read()
                for body, path in bodies]
    assert streams["16"] == streams["1"]
    assert streams["1"][0].count(b'"finish_reason":null') == 37 and streams["1"][1].count(b'"content":" tok"') == 21


def test_speculative_bursts_show_as_bursts(fake):
    url, _ = fake
    result = run_wave(url, VLLM, _wave(2, 2, max_tokens=32), _prompts("spec #burst=4"))
    row = summarize("l", 2, [result])
    tokens = [n for r in result.records for n in r.chunk_tokens]
    # A burst is never split (a busy client may read two bursts at once: still whole bursts).
    assert all(n % 4 == 0 for n in tokens) and sum(tokens) == 2 * 2 * 32
    assert row.tokens_per_chunk >= 4.0 and row.tokens_per_chunk_max >= 4
    # The gap between bursts is the schedule's, not a tiny number from zero gaps inside a burst.
    assert row.itl_p50_s >= ITL_MS / 1000 - 0.002


def test_each_broken_stream_is_its_own_error_row(fake):
    url, _ = fake
    prompts = _prompts("fine", "#fault=malformed", "#fault=error", "#fault=empty", "#fault=inconsistent",
                       "#fault=close", "also fine", "#fault=errorclose")
    result = run_wave(url, VLLM, _wave(8, 2), prompts)
    by = {}
    for r in result.records:
        by.setdefault(r.prompt_id, []).append(r)
    assert all(r.ok and r.output_tokens == 16 for p in ("p0", "p6") for r in by[p])
    expect = {"p1": "malformed event", "p2": "slot 0 failed: out of memory", "p3": "empty stream",
              "p4": "final usage claims 160 tokens, the chunks carried 16", "p5": "connection closed inside",
              "p7": "slot 0 failed: out of memory"}  # the server's words, though the connection then broke
    for pid, words in expect.items():
        assert all(not r.ok and words in r.error and r.e2el_s is None for r in by[pid]), by[pid]


def test_wall_deadline_fires_on_a_stream_kept_alive_by_pings(fake):
    url, _ = fake
    t = time.perf_counter()
    result = run_wave(url, VLLM, _wave(2, 1, deadline_s=0.6), _prompts("ok", "#fault=stall"))
    assert time.perf_counter() - t < 3.0
    stalled, fine = sorted(result.records, key=lambda r: r.prompt_id != "p1")
    assert not stalled.ok and stalled.error.startswith("deadline: no complete response within 0.6 s")
    assert fine.ok


def test_a_request_past_its_deadline_ends_the_wave_without_new_requests(fake):
    """A stopped server stalls every request: the stream sends no more after the first ran past its
    deadline (the lane ends at its next check), so the fault costs one deadline, not one per request."""
    url, _ = fake
    t = time.perf_counter()
    result = run_wave(url, VLLM, _wave(1, 3, deadline_s=0.6), _prompts("#fault=stall"))
    assert time.perf_counter() - t < 1.5
    assert len(result.records) == 1 and result.records[0].error.startswith("deadline:")


def test_open_loop_keeps_its_schedule_under_a_ceiling(fake):
    url, _ = fake
    wave = _wave(2, 5, max_tokens=8, rate=40.0, arrival="constant")
    result = run_wave(url, VLLM, wave, _prompts("o"))
    assert len(result.records) == 10 and all(r.ok for r in result.records)
    assert [r.scheduled_s for r in result.records] == pytest.approx([i / 40 for i in range(10)])
    assert result.connections_opened <= 2
    # each request needs ~55 ms and arrives every 25 ms: with 2 in flight, later ones queue.
    assert max(r.queued_s for r in result.records) > 0.005
    assert all(r.sent_s >= r.scheduled_s - 0.001 for r in result.records)
    assert result.shape == "open constant 40 req/s, ceiling 2"


def test_a_level_becomes_a_valid_decode_row(fake):
    url, _ = fake
    waves = [run_wave(url, VLLM, _wave(4, 3, max_tokens=16, stagger_s=0.003, seed=s), _prompts("r")) for s in (1, 2)]
    row = summarize("l", 4, waves, ttft_bound_s=1.0, tpot_bound_s=1.0)
    assert row.connections_opened == 4 and row.unforced_reconnects == 0 and row.failed_requests == 0 and row.goodput_pct == 100.0
    assert row.steady_window_s > 0 and row.ramp_up_s >= 0.009  # the last stream started 3 x 3 ms late
    # The aggregate counts only tokens inside each wave's steady window (ramps excluded).
    windows = [steady_window(w.records, w.wall_s) for w in waves]
    inside = [sum(n for r in w.records for t, n in zip(r.chunk_arrivals_s, r.chunk_tokens)
                  if win.start_s <= r.sent_s + t <= win.end_s) for w, win in zip(waves, windows)]
    assert [win.tokens for win in windows] == inside and all(0 < n < w.output_tokens for n, w in zip(inside, waves))
    assert row.aggregate_tok_s == pytest.approx(statistics.median(win.tok_s for win in windows))
    assert row.itl_p50_s <= row.itl_p90_s <= row.itl_p99_s and row.tpot_p50_s > 0
    assert row.load_shape == "closed c=4, stagger 0.003 s"
    assert validate("decode", pd.DataFrame([row.model_dump()])).success
    tight = summarize("l", 4, waves, ttft_bound_s=0.001)
    assert tight.goodput_pct == 0.0 and tight.goodput_req_s == 0.0
    records = pd.DataFrame([r.model_dump() for w in waves for r in w.records])
    assert validate("requests", records).success


def test_a_plan_sweeps_rates_under_its_largest_concurrency():
    plan = DecodePlan(prompts="x", concurrency=[1, 8], rates=[2.0, 4.0])
    assert levels(plan) == [(8, 2.0), (8, 4.0)]
    assert levels(DecodePlan(prompts="x", concurrency=[1, 2])) == [(1, None), (2, None)]


def test_llama_server_pings_and_errors_parse_as_the_server_wrote_them():
    engine = engine_for("llamacpp")
    assert engine.parse_stream_event(b":") is None  # tools/server: `:\n\n` every 30 s on an idle stream
    err = engine.parse_stream_event(b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}')
    assert err.done and err.error == "boom"
    ev = engine.parse_stream_event(b'data: {"content":"hi","tokens":[1,2],"stop":false}')
    assert ev.tokens == 2 and ev.text == "hi"
    with pytest.raises(ValueError):
        engine.parse_stream_event(b'data: {"content": "hi"')


@pytest.fixture(scope="module")
def llama(llama_bin, tmp_path_factory):
    from tasks.stages.boot import start, stop, wait_healthy

    lane = Inventory.model_validate(shipped_inventory()).lanes["rehearsal"]
    lane = lane.model_copy(update={
        "port": 18095,
        "model": lane.model.model_copy(update={"path": str(REPO / lane.model.path)}),
        "drafter": lane.drafter.model_copy(update={"path": str(REPO / lane.drafter.path)}),
    })
    srv = start("rehearsal", lane, str(llama_bin / "llama-server"), "127.0.0.1",
                tmp_path_factory.mktemp("log") / "boot.log")
    try:
        wait_healthy(srv, lane, 60)
        yield srv
    finally:
        stop(srv)


def test_real_llama_server_reuses_connections_and_isolates_an_error(llama):
    prompts = _prompts("Write a short story about a lighthouse.", "Explain how a bicycle gear works.",
                       "word " * 3000)  # over the 512-token slot context: llama-server refuses it
    engine = engine_for("llamacpp")
    # The pinned llama-server closes the connection after every streamed response (cpp-httplib
    # takes the content provider's final `false` for an abort): the client counts each close
    # and opens no connection beyond what the server forced.
    result = run_wave(llama.base_url, engine, _wave(3, 2, max_tokens=24, deadline_s=60), prompts)
    assert result.server_closed >= 3  # each stream's first response ended its connection
    assert 3 < result.connections_opened <= 3 + result.server_closed
    bad = [r for r in result.records if r.prompt_id == "p2"]
    good = [r for r in result.records if r.prompt_id != "p2"]
    assert len(bad) == 2 and all(not r.ok and r.http_status == 400 and "context" in r.error for r in bad), bad
    assert len(good) == 4 and all(r.ok for r in good), [r.error for r in good]
    for r in good:
        assert r.output_tokens == 24 or r.finish_reason == "stop"
        assert 0 < r.ttft_s <= r.e2el_s and r.chunks >= 1  # equal when the whole stream came in one read
        # every token came in some chunk, bursts or not (a stop token is counted, never streamed)
        assert sum(r.chunk_tokens) == r.output_tokens or (r.finish_reason == "stop"
                                                          and sum(r.chunk_tokens) == r.output_tokens - 1)
    row = summarize("rehearsal", 3, [result])
    assert row.tokens_per_chunk >= 1.0 and row.unforced_reconnects == 0


def test_a_rate_sweep_validates_one_row_per_rate(fake):
    url, _ = fake
    rows = [summarize("l", 2, [run_wave(url, VLLM, _wave(2, 3, max_tokens=8, rate=r), _prompts("s"))], request_rate=r)
            for r in (20.0, 40.0)]
    assert [r.load_shape for r in rows] == ["open poisson 20 req/s, ceiling 2", "open poisson 40 req/s, ceiling 2"]
    df = pd.DataFrame([r.model_dump() for r in rows])
    assert validate("decode", df).success
    # what the waves really sent (a 3-request Poisson draw is far from its rate) and how late
    for row in rows:
        assert row.realized_rate > 0 and row.realized_rate != row.request_rate
        assert -0.001 <= row.send_late_p50_s <= row.send_late_p99_s < 0.5  # (busy box)
    v = validate("decode", pd.concat([df, df.iloc[[0]]], ignore_index=True))
    assert any("expect_compound_columns_to_be_unique(lane, request_rate)" in line for line in v.failed), v.failed


def test_bytes_read_late_keep_the_time_they_arrived():
    """The stamp is the kernel's receive time, not the time the loop got to the socket: bytes
    written while the event loop was busy for 80 ms are stamped when they were written."""
    import asyncio
    import socket

    from tasks.client import http

    listener = socket.create_server(("127.0.0.1", 0))

    async def scenario() -> tuple[float, float, float]:
        host, port = listener.getsockname()
        pool = http.Pool(host, port, 1)
        conn, _ = await pool.acquire()
        peer, _ = listener.accept()
        with peer:
            written = time.perf_counter()
            peer.sendall(b"first bytes")
            time.sleep(0.08)  # the loop is busy elsewhere: nothing reads the socket meanwhile
            stamped, data = await conn.proto.read()
            read = time.perf_counter()
        assert data == b"first bytes"
        pool.release(conn, keep=False)
        return written, stamped, read

    with listener:
        written, stamped, read = asyncio.run(scenario())
    assert read - written > 0.08
    # (-50 µs: the kernel's wall-clock stamp moved onto perf_counter, two clock reads apart)
    assert -5e-5 <= stamped - written < 0.005, (stamped - written, read - written)


def _event(ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": " tok" * len(ids), "token_ids": ids, "finish_reason": finish}
    return b"data: " + json.dumps({"id": "c", "object": "text_completion", "choices": [choice]}).encode() + b"\n\n"


def test_two_events_in_one_read_each_get_an_honest_stamp():
    """Two token events written 40 ms apart while the client's loop is busy reach it in one read.
    Linux merges the two segments in the receive queue and keeps the later one's stamp, so no
    read size separates them (docs/metrics.md): the later event's stamp must be its own, and the
    earlier one's chunk must say that its stamp is only an upper bound (coalesced), and stay out
    of ITL. A third event read alone keeps its own stamp."""
    import asyncio
    import socket
    import threading

    from tasks.client import metrics, waves

    listener = socket.create_server(("127.0.0.1", 0))
    host, port = listener.getsockname()
    times: dict[str, float] = {}
    head_sent = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            head, _, body = buf.partition(b"\r\n\r\n")
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            while len(body) < length:
                body += conn.recv(65536)
            times["recv"] = time.perf_counter()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            head_sent.set()

            def send(name: str, data: bytes, after: float) -> None:
                time.sleep(after)
                times[name] = time.perf_counter()
                conn.sendall(b"%x\r\n%s\r\n" % (len(data), data))

            send("e1", _event([1]), 0.03)
            send("e2", _event([2]), 0.04)  # 40 ms later: both wait in the receive queue
            send("e3", _event([3]), 0.20)  # the loop is free again: read alone
            send("end", _event([], "length") + b"data: [DONE]\n\n", 0.10)
            conn.sendall(b"0\r\n\r\n")
            conn.recv(1)  # until the client closes

    async def busy_loop() -> None:
        """The client's event loop doing other work (other streams, parsing) for 150 ms."""
        while not head_sent.is_set():
            await asyncio.sleep(0.001)
        time.sleep(0.15)

    async def scenario() -> waves.WaveResult:
        result, _ = await asyncio.gather(
            waves._run_wave(f"http://{host}:{port}", VLLM, _wave(1, 1, max_tokens=3), _prompts("x"), None), busy_loop())
        return result

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    with listener:
        result = asyncio.run(scenario())
    server.join(5)
    (r,) = result.records
    assert r.ok, r.error
    # One read carried e1 and e2: one chunk, two tokens, stamped when e2 arrived (e2's own time,
    # e1's upper bound) and marked coalesced; e3 came alone and its stamp is its own.
    assert r.chunk_tokens == [2, 1]
    assert r.chunk_coalesced == [True, False]
    # The send on the server's clock: its receipt, later by loopback and the server thread's
    # wake-up (ms on a busy box), so the absolute checks allow that much; the gap between the
    # two exact stamps needs no send time and is checked tighter.
    sent = times["recv"]
    first, third = (sent + a for a in r.chunk_arrivals_s)
    assert -0.0005 < first - times["e2"] < 0.015, first - times["e2"]  # e2's own arrival, not the read's (+80 ms)
    assert first - times["e1"] > 0.035  # an upper bound for e1, and the record says so
    assert -0.0005 < third - times["e3"] < 0.015, third - times["e3"]
    assert abs((third - first) - (times["e3"] - times["e2"])) < 0.005
    assert metrics.pooled_itl([r]) == []  # the only gap touches the coalesced chunk
    assert metrics.coalesced_share([r]) == 0.5


def test_the_kernel_keeps_one_stamp_for_segments_queued_before_a_read():
    """Why a shared read cannot be split by reading less (tasks/client/http.py EventSplitter):
    two segments that wait in a TCP receive queue are merged there and keep the later one's
    SO_TIMESTAMPNS stamp, so even a read of the first segment's bytes alone gets the second's
    time. If a kernel ever keeps them apart, this fails and small reads become worth having."""
    import socket
    import struct

    from tasks.client import stamped

    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as client:
        peer, _ = listener.accept()
        with peer:
            client.setsockopt(socket.SOL_SOCKET, stamped._SO_TIMESTAMPNS, 1)
            writes = []
            for _ in range(2):
                writes.append(time.time())
                peer.sendall(b"x" * 200)
                time.sleep(0.04)
            stamps = []
            for _ in range(2):
                _, anc, _, _ = client.recvmsg(200, stamped._ANC_SIZE)  # exactly one segment's bytes
                (sec, nsec), = [struct.unpack("qq", d[:16]) for lvl, kind, d in anc if kind == stamped._SCM_TIMESTAMPNS]
                stamps.append(sec + nsec * 1e-9)
    assert all(abs(s - writes[1]) < 0.005 for s in stamps), [s - writes[0] for s in stamps]


def test_a_wave_spread_over_workers_keeps_its_shape_and_one_clock(fake):
    """Two worker processes carry one closed wave and one open one: the records are the ones a
    single process writes (every stream, connections = concurrency, a valid decode row), and the
    open-loop requests leave at their scheduled times on the parent's clock (a worker that kept
    its own clock would be off by its start-up, a second or more)."""
    url, log = fake
    seen = []
    closed = run_wave(url, VLLM, _wave(4, 3, max_tokens=8, workers=2), _prompts("w"), seen.append)
    assert len(closed.records) == 12 and all(r.ok for r in closed.records), [r.error for r in closed.records]
    assert sorted(seen, key=lambda r: r.nonce) == sorted(closed.records, key=lambda r: r.nonce)  # live, as they end
    assert sorted({r.stream for r in closed.records}) == [0, 1, 2, 3]
    assert all(sum(r.stream == i for r in closed.records) == 3 for i in range(4))
    assert closed.connections_opened == 4 and closed.shape == "closed c=4"
    row = summarize("l", 4, [closed])
    assert row.unforced_reconnects == 0 and row.steady_window_s > 0
    assert validate("decode", pd.DataFrame([row.model_dump()])).success
    assert validate("requests", pd.DataFrame([r.model_dump() for r in closed.records])).success

    opened = run_wave(url, VLLM, _wave(4, 4, max_tokens=4, rate=50.0, arrival="constant", workers=2), _prompts("o"))
    assert len(opened.records) == 16 and all(r.ok for r in opened.records)
    assert [r.scheduled_s for r in opened.records] == pytest.approx([i / 50 for i in range(16)])
    late = [r.sent_s - r.scheduled_s - r.queued_s for r in opened.records]
    assert all(-0.001 <= x < 0.5 for x in late), late  # (busy box)
    # One clock: the server saw the requests of both workers as far apart as their sends say.
    time.sleep(0.2)  # the server logs a request after its last write
    recv = {r.nonce: [json.loads(x)["recv"] for x in log.read_text().splitlines() if r.nonce in x][0]
            for r in opened.records}
    first = opened.records[0]
    skew = [abs((recv[r.nonce] - recv[first.nonce]) - (r.sent_s - first.sent_s)) for r in opened.records]
    assert statistics.median(skew) < 0.01, skew
    rate = summarize("l", 4, [opened], request_rate=50.0)
    assert rate.realized_rate == pytest.approx(50.0, rel=0.2)


def test_wave_workers_are_kept_between_waves_and_replaced_when_one_dies(fake):
    """The worker processes of a spread wave serve the next wave too (a decode curve of 21 waves
    would otherwise spawn and import 21 times); a worker that died is replaced, not waited for."""
    url, _ = fake
    first = run_wave(url, VLLM, _wave(2, 1, max_tokens=4, workers=2), _prompts("k1"))
    pids = [p.pid for p in workers._pools[(2, None)].procs]
    second = run_wave(url, VLLM, _wave(2, 1, max_tokens=4, workers=2), _prompts("k2"))
    assert all(r.ok for r in first.records + second.records)
    assert [p.pid for p in workers._pools[(2, None)].procs] == pids  # the same processes
    os.kill(pids[0], signal.SIGKILL)
    workers._pools[(2, None)].procs[0].join(5)
    third = run_wave(url, VLLM, _wave(2, 1, max_tokens=4, workers=2), _prompts("k3"))
    assert len(third.records) == 2 and all(r.ok for r in third.records)
    assert not set(p.pid for p in workers._pools[(2, None)].procs) & set(pids)  # a fresh pool
    workers.close_pools()
    assert workers._pools == {}


def _splitter_by_slicing(chunks: list[tuple[float, bytes]]) -> list[tuple[float, bytes, bool]]:
    """The splitter as it was before one split a read: the rest sliced off event by event. Its
    output is the contract; only its cost (quadratic in a read's events) was wrong."""
    buf, t_first, out = b"", 0.0, []
    for t, data in chunks:
        if not buf:
            t_first = t
        buf += data.replace(b"\r\n", b"\n")
        while (i := buf.find(b"\n\n")) >= 0:
            raw, buf = buf[:i], buf[i + 2:]
            if raw.strip():
                out.append((t_first, raw, t_first == t and bool(buf.strip())))
            t_first = t
    return out + ([(t_first, buf, False)] if buf.strip() else [])


def test_the_one_split_splitter_gives_what_event_by_event_slicing_gave():
    """Random streams (comments, blank events, CRLF, multi-line data, a tail without its blank
    line) cut at random points: each event with the same stamp and the same shared mark."""
    import random

    from tasks.client.http import EventSplitter

    rng = random.Random(28)
    pieces = [b'data: {"a":1}', b": ping", b"", b"  ", b"data: x\r\ndata: y", b"event: error\ndata: {}"]
    for _ in range(3000):
        stream = b"".join(rng.choice(pieces) + rng.choice([b"\n\n", b"\r\n\r\n", b"\n\n\n"])
                          for _ in range(rng.randint(1, 8)))
        stream += b"data: tail" if rng.random() < 0.3 else b""
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randint(0, 6))))
        chunks = [(float(t), stream[a:b]) for t, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(stream)]))]
        splitter = EventSplitter()
        got = [e for t, data in chunks for e in splitter.feed(t, data)] + splitter.close()
        assert got == _splitter_by_slicing(chunks), chunks


def test_the_token_fast_path_takes_only_plain_token_events():
    """Engine.stream_token, the hot path: a plain token event as (text, tokens), the event
    parse_stream_event would build; anything else (final, usage, error, comment, a text that is not
    a string) is left to parse_stream_event; llama.cpp's running count is never read here, so its
    events are not parsed twice (malformed JSON passes through untouched)."""
    vllm, sglang, llama = engine_for("vllm"), engine_for("sglang"), engine_for("llamacpp")
    token = b'data: {"choices":[{"text":"ab","token_ids":[5,6],"finish_reason":null}],"usage":{"completion_tokens":2}}'
    assert vllm.stream_token(token) == ("ab", 2)
    ev = vllm.parse_stream_event(token)
    assert ev is not None and (ev.text, ev.tokens, ev.done) == ("ab", 2, False)
    for other in (b'data: {"choices":[{"text":"","token_ids":[],"finish_reason":"length"}]}',
                  b'data: {"choices":[],"usage":{"completion_tokens":9}}', b'data: {"error":{"message":"x"}}',
                  b'data: {"choices":[{"text":7,"finish_reason":null}]}', b": ping", b"data: [DONE]"):
        assert vllm.stream_token(other) is None, other
    assert sglang.stream_token(b'data: {"text":"a","output_ids":[1],"meta_info":{}}') == ("a", 1)
    assert sglang.stream_token(b'data: {"text":"","output_ids":[],"meta_info":{"finish_reason":{"type":"length"}}}') is None
    assert llama.stream_token(b'data: {"content":"a","tokens":[1],"stop":false,"tokens_predicted":1}') is None
    assert llama.stream_token(b'data: {"content": "a"') is None
    with pytest.raises(ValueError):
        vllm.stream_token(b'data: {"choices": [')


def test_a_read_decoded_whole_gives_what_event_by_event_gave():
    """Engine.stream_tokens decodes a read's events as one array (the hot path at full speed): random
    reads of token events with finals, usage, [DONE], comments, errors, NaN, multi-line and
    malformed events among them give, through Assembler.feed_read, the outcome that feed() event by
    event gives; a read of plain token events is decoded whole, and one of another kind is not."""
    import random

    from tasks.client.stream import Assembler

    vllm, sglang = engine_for("vllm"), engine_for("sglang")
    tok = {vllm: [b'data: {"id":"c","choices":[{"index":0,"text":" a","token_ids":[%d],"finish_reason":null}],'
                  b'"usage":{"completion_tokens":1}}', b'data: {"choices":[{"text":"","token_ids":[%d,9],"finish_reason":null}]}'],
           sglang: [b'data: {"text":" a","output_ids":[%d],"meta_info":{"id":"x"}}', b'data: {"text":"b","output_ids":[%d,1]}']}
    other = {vllm: [b'data: {"choices":[{"text":"","token_ids":[],"finish_reason":"length"}],"usage":{"completion_tokens":3}}',
                    b'data: {"choices":[],"usage":{"completion_tokens":3}}', b'data: {"error":{"message":"x"}}',
                    b'data: {"choices":[{"text":7,"finish_reason":null}]}', b'data: {"choices":{"0":1}}',
                    b'data: {"choices":[{"text":"n","token_ids":[1],"finish_reason":null,"lp":NaN}]}'],
             sglang: [b'data: {"text":"","output_ids":[],"meta_info":{"finish_reason":{"type":"length"},"completion_tokens":3}}',
                      b'data: {"error":"x"}', b'data: {"text":"m","output_ids":[1],"meta_info":[]}']}
    common = [b"data: [DONE]", b": ping", b'data: {"choices": [', b'event: message\ndata: {"text":"z"}', b"data: 5"]
    # Reads that decode as an array yet not one element an event, or skip what the old parse checked
    # (found by review, 2026-12-08): one event with two objects; a string one event leaves open,
    # closed by the next (the comma between them lands inside it); invalid UTF-8 in a field no
    # token_chunk reads; nesting deeper than msgspec goes but orjson reads.
    deep = b'"x":' + b"[" * 1000 + b"]" * 1000
    directed = {vllm: [[b'data: {"choices":[{"text":"a","token_ids":[1]}]},{"choices":[{"text":"b","token_ids":[1,2,3]}]}'],
                       [b'data: {"id":"', b'data: {","choices":[{"text":"a","token_ids":[1]}]}', b"data: [DONE]"],
                       [b'data: {"choices":[{"text":"a","token_ids":[1],"finish_reason":null}],"id":"\xff"}'],
                       [b'data: {"choices":[{"text":"a","token_ids":[1]}],' + deep + b"}"]],
                sglang: [[b'data: {"text":"a","output_ids":[1]},{"text":"b","output_ids":[2,3]}'],
                         [b'data: {"text":"', b'data: {","output_ids":[1]}',
                          b'data: {"text":"b","output_ids":[2]},{"text":"c","output_ids":[3,3]}'],
                         [b'data: {"text":"a","output_ids":[1],"\xc0\xaf":1}'],
                         [b'data: {"text":"a","output_ids":[1],' + deep + b"}"]]}
    rng = random.Random(28)
    for engine in (vllm, sglang):
        assert engine.stream_tokens([tok[engine][0] % i for i in range(5)] + [b"data: [DONE]"]) == \
            [(" a", 1)] * 5 + [None]
        assert engine.stream_tokens([b": ping", tok[engine][0] % 1]) is None
        for read in directed[engine]:
            whole, one = Assembler(engine, 0.0), Assembler(engine, 0.0)
            whole.feed_read([(1.0, raw, k < len(read) - 1) for k, raw in enumerate(read)])
            for k, raw in enumerate(read):
                if one.feed(1.0, raw, k < len(read) - 1):
                    break
            a, b = whole.finish(), one.finish()
            assert (a.error, a.tokens, a.events) == (b.error, b.tokens, b.events), read
        for _ in range(2000):
            reads, t = [], 0.0
            for _ in range(rng.randint(1, 4)):
                t += 1.0
                n = rng.randint(1, 6)
                events = [rng.choice(tok[engine]) % rng.randint(0, 99) if rng.random() < 0.8
                          else rng.choice(other[engine] + common) for _ in range(n)]
                reads.append([(t, raw, k < n - 1) for k, raw in enumerate(events)])
            whole, one = Assembler(engine, 0.0), Assembler(engine, 0.0)
            for read in reads:
                whole.feed_read(read)
                for ev in read:
                    if one.feed(*ev):
                        break
            a, b = whole.finish(), one.finish()
            assert (a.error, a.arrivals, a.tokens, a.coalesced, a.events, a.final, a.output_tokens) == \
                (b.error, b.arrivals, b.tokens, b.coalesced, b.events, b.final, b.output_tokens), reads


def test_the_fast_json_path_reads_what_the_standard_parser_read():
    """orjson refuses NaN and Infinity, which Python's json (and servers written with it) emit:
    such an event still parses, through the fallback, and malformed JSON is still an error."""
    engine = engine_for("vllm")
    ev = engine.parse_stream_event(b'data: {"choices":[{"text":"a","token_ids":[1],"finish_reason":null,'
                                   b'"logprob":NaN}],"usage":null}')
    assert ev is not None and ev.tokens == 1 and ev.text == "a"
    ev = engine.parse_stream_event(b'event: message\ndata: {"choices":[{"text":"b","token_ids":[2,3],'
                                   b'"finish_reason":null,"x":-Infinity}]}')
    assert ev is not None and ev.tokens == 2
    with pytest.raises(ValueError):
        engine.parse_stream_event(b'data: {"choices": [')
