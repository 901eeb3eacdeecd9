"""Issue 28's 16-core run on a lent H200 host (2026-12-03 11:42 and 11:48 UTC), kept as it came
back: the goals it met are checked here so a rerun that loses them is noticed (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

RUNS = Path(__file__).parent / "fixtures/loadgen-h200"


def rows(name: str, section: str) -> list[dict[str, str]]:
    """One markdown table of a kept benchmark output, as dicts keyed by its header ("|err|" read
    as "err": a header's own bars are not column bars)."""
    text = (RUNS / name).read_text().split(f"## {section}", 1)[1].replace("|err|", "err")
    table = text.split("\n\n")[1]  # the table: the first block after the heading's line
    lines = table.strip().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


@pytest.mark.parametrize("name", ["loadgen-2026-12-03-kernel-ref-aiperf.md", "loadgen-2026-12-03-kernel-ref-guidellm.md"])
def test_the_stamps_meet_their_goals_at_every_level(name):
    timed = [r for r in rows(name, "timed") if r["client"] == "lanebench"]
    assert [r["C"] for r in timed] == ["1", "4", "16"]
    for r in timed:
        assert r["requests ok"].split("/")[0] == r["requests ok"].split("/")[1]
        assert float(r["TTFT err p50 ms"]) <= 0.1 and float(r["ITL err p99 ms"]) <= 0.1, r


def test_the_raw_ceiling_passes_a_million_tokens_a_second_and_every_peer():
    raw = rows("loadgen-2026-12-03-kernel-ref-aiperf.md", "raw ceiling")
    raw += rows("loadgen-2026-12-03-kernel-ref-guidellm.md", "raw ceiling")
    assert all(r["requests ok"].split("/")[0] == r["requests ok"].split("/")[1] for r in raw)
    best = {}
    for r in raw:
        client = "lanebench" if r["client"].startswith("lanebench") else r["client"]
        best[client, r["C"]] = max(best.get((client, r["C"]), 0.0), float(r["tok/s"]))
    assert max(v for (c, _), v in best.items() if c == "lanebench") >= 1e6
    for level in ("1", "16", "64", "256"):
        assert best["lanebench", level] > 1.5 * max(best["aiperf", level], best["guidellm", level])


# The 17:34 and 18:04 UTC runs (two fresh lent hosts): every client on the same cores, and raw
# tok/s re-measured on each client's own span (the 17:34 rows use the servers' busy span, which
# overstates every client of a row alike by about rounds/(rounds - 1); docs/benchmarks.md).
SAME_CORES, CLIENT_SPAN = "loadgen-2026-12-03-same-cores.md", "loadgen-2026-12-03-client-span.md"


@pytest.mark.parametrize("name", [SAME_CORES, CLIENT_SPAN])
def test_the_stamps_hold_after_the_hot_path_cut(name):
    timed = [r for r in rows(name, "timed") if r["client"] == "lanebench"]
    assert [r["C"] for r in timed] == ["1", "4", "16"]
    assert all(float(r["TTFT err p50 ms"]) <= 0.1 and float(r["ITL err p99 ms"]) <= 0.1 for r in timed), timed


def test_every_client_on_the_same_cores_and_lanebench_ahead_on_each():
    raw = rows(SAME_CORES, "raw ceiling")
    assert all(r["requests ok"].split("/")[0] == r["requests ok"].split("/")[1] for r in raw)
    assert {r["client"] for r in raw} == {"lanebench", "aiperf", "guidellm"}
    assert {r["cores"] for r in raw} == {"1", "2", "4", "8", "12"}
    ratios = rows(SAME_CORES, "lanebench against the best peer, on the same cores")
    assert len(ratios) == 16 and min(float(r["lanebench / best"]) for r in ratios) > 1.5
    assert all(float(r["server busy %"]) < 50 for r in raw)  # the servers never set the pace


def test_lanebench_on_its_own_span_passes_a_million_tokens_a_second_from_eight_cores():
    raw = rows(CLIENT_SPAN, "raw ceiling")
    assert all(r["requests ok"].split("/")[0] == r["requests ok"].split("/")[1] for r in raw)
    assert all(float(r["tok/s"]) >= 1e6 for r in raw if int(r["cores"]) >= 8)
    scaling = {(r["C"], r["cores"]): float(r["x one core"]) for r in rows(CLIENT_SPAN, "lanebench's scaling over cores")}
    assert scaling["64", "12"] >= 7 and scaling["256", "12"] >= 7


def test_twelve_workers_lose_to_their_share_of_streams_not_to_the_merge(monkeypatch):
    """The 18:04 run's 12-core rows read 58-64 % of linear against one core at the same C. One
    process reading C streams takes more events a read than N workers of C/N streams each (one core:
    192k tok/s at C=16, 301k at C=256), and at C=16 four of twelve workers carry two streams and set
    the span. Held against that bound, every multi-core row is 85-96 %: the loss that is the
    workers' own is 4-15 %, at 2 cores as at 12."""
    import importlib.util

    monkeypatch.syspath_prepend(str(RUNS.parents[2] / "benchmarks"))  # its own `_common`
    spec = importlib.util.spec_from_file_location("load_generator", RUNS.parents[2] / "benchmarks/load_generator.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    raw = [r | {"C": int(r["C"]), "cores": int(r["cores"]), "tok/s": float(r["tok/s"])}
           for r in rows(CLIENT_SPAN, "raw ceiling")]
    _, scaling = bench.versus(raw, ["lanebench"])
    multi = [r for r in scaling if r["cores"] > 1]
    assert len(multi) == 12
    twelve = [r for r in multi if r["cores"] == 12]
    assert all(r["of linear %"] < 65 for r in twelve), twelve
    assert all(84 <= r["of workers' bound %"] <= 97 for r in multi), multi
    assert next(r for r in twelve if r["C"] == 16)["streams a worker"] == "1-2"


# 2026-12-08: weak scaling (16 streams a core, C = 16 x cores) with every client on its own span,
# on a fresh lent host's 16 cores (an H100 host: the H200 kind did not start), after the client
# decoded a read's token events as one msgspec array. Run 1 printed its rows up to 8 cores, then
# lost its 12-core row (the tree re-sent under it: scripts/loadgen-remote.sh now detaches from a
# copy); run 2 on the same host took the 1- and 12-core rows again, whole.
WEAK_1, WEAK_2 = "loadgen-2026-12-08-weak-1.md", "loadgen-2026-12-08-weak-2.md"


def printed(name: str) -> list[dict]:
    """The rows a run printed as it went (one dict a line), which a run cut short still has."""
    import ast

    lines = (RUNS / name).read_text().splitlines()
    return [ast.literal_eval(line.replace("nan", "None")) for line in lines if line.startswith("{'client'")]


def test_weak_scaling_every_client_on_its_own_span():
    raw = [r for r in printed(WEAK_1) + printed(WEAK_2) if "cores" in r]
    assert all(r["requests ok"].split("/")[0] == r["requests ok"].split("/")[1] for r in raw)
    assert all(r["C"] == 16 * r["cores"] for r in raw)
    by = {(r["client"], r["cores"]): r["tok/s"] for r in printed(WEAK_1) if "cores" in r}
    by |= {(r["client"], r["cores"]): r["tok/s"] for r in printed(WEAK_2) if "cores" in r and r["cores"] == 12}
    ratio = {n: by["lanebench", n] / max(by["guidellm", n], by["aiperf", n]) for n in (1, 2, 4, 8, 12)}
    assert min(ratio.values()) > 3.5 and ratio[2] > 5, ratio  # 5x the best peer in one row of five, not every
    assert by["lanebench", 12] > 3e6 and by["lanebench", 8] > 2e6
    # each multi-core row against its own run's one-core row
    one_core_2 = next(r["tok/s"] for r in printed(WEAK_2) if r["client"] == "lanebench" and r.get("cores") == 1)
    linear = {n: by["lanebench", n] / (n * by["lanebench", 1]) for n in (4, 8)} | {12: by["lanebench", 12] / (12 * one_core_2)}
    assert all(0.8 < v < 1.0 for v in linear.values()), linear  # 82-94 % of linear: not linear
    assert all(float(r["server busy %"]) < 50 for r in raw)  # the servers never set the pace


@pytest.mark.parametrize("name", [WEAK_1, WEAK_2])
def test_the_stamps_hold_after_the_read_is_decoded_whole(name):
    timed = [r for r in printed(name) if "cores" not in r and r["client"] == "lanebench"]
    assert [r["C"] for r in timed] == [1, 4, 16]
    assert all(r["TTFT err p50 ms"] <= 0.1 and r["ITL |err| p99 ms"] <= 0.1 for r in timed), timed
