"""Every class of bad input: one line naming file, field and fix; exit 2; no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.inventory.base import ConfigError
from tasks.inventory.load import load_inventory

from tasks.engines import engine_for

REPO = Path(__file__).resolve().parent.parent


def shipped() -> dict:
    return yaml.safe_load((REPO / "hosts.yaml").read_text())


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def write(tmp_path: Path, data: dict | str) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    for name in ("testbed",):  # keep shipped relative paths valid from tmp_path
        (tmp_path / name).symlink_to(REPO / name)
    return path


def test_shipped_inventory_is_valid():
    inv = load_inventory(REPO / "hosts.yaml", engine_for)
    assert "rehearsal" in inv.lanes


def test_requests_per_level_tops_up_the_low_levels_only():
    """bench.decode.requests_per_level: streams at low levels send more; none sends fewer than
    requests_per_stream; every level reaches the asked count over the repeats."""
    plan = load_inventory(REPO / "hosts.yaml", engine_for).lanes["rehearsal"].bench.decode
    assert plan.requests_per_level == 24 and plan.requests_per_stream == 2
    assert [plan.per_stream(c, 3) for c in (1, 2, 4, 8)] == [8, 4, 2, 2]
    assert all(c * plan.per_stream(c, 3) * 3 >= 24 for c in (1, 2, 3, 5, 7, 8))
    assert plan.model_copy(update={"requests_per_level": None}).per_stream(1, 3) == 2


def _mutate(path: str, value):
    def apply(d: dict) -> dict:
        keys = path.split(".")
        node = d
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if value is KeyError:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return d
    return apply


CASES = {
    # name: (mutation, field expected in message, words expected in the fix/problem)
    "unknown field (typo)": (_mutate("lanes.rehearsal.enigne", "llamacpp"), "lanes.rehearsal.enigne", "remove it"),
    "engine not supported": (_mutate("lanes.rehearsal.engine", "tgi"), "lanes.rehearsal.engine", "'llamacpp'"),
    "port not a number": (_mutate("lanes.rehearsal.port", "eighty"), "lanes.rehearsal.port", "whole number"),
    "port out of range": (_mutate("lanes.rehearsal.port", 80), "lanes.rehearsal.port", "larger value"),
    "unknown host": (_mutate("lanes.rehearsal.host", "gb300"), "lanes.rehearsal.host", "localhost"),
    "missing bench": (_mutate("lanes.rehearsal.bench", KeyError), "lanes.rehearsal.bench", "add this field"),
    "shell metacharacters in a flag": (_mutate("lanes.rehearsal.flags", ["--foo", "x; rm -rf /"]),
                                       "lanes.rehearsal.flags", "not allowed on a command line"),
    "image without digest": (_mutate("lanes.rehearsal.image", "lmsysorg/sglang:latest"), "lanes.rehearsal.image",
                             "documented form"),
    "gate without a source": (_mutate("lanes.rehearsal.gates.0.metric", KeyError), "lanes.rehearsal.gates[0]",
                              "exactly one of"),
    "gate regex without value group": (_mutate("lanes.rehearsal.gates.0", {"kind": "counter", "name": "g",
                                                                           "log_pattern": "steps=(\\d+)", "op": ">",
                                                                           "threshold": 0}),
                                       "lanes.rehearsal.gates[0]", "(?P<value>"),
    # Declared gates only add: one that cannot fail is a config error (a counter's increase is >= 0).
    "counter gate that cannot fail": (_mutate("lanes.rehearsal.gates.0.op", ">="), "lanes.rehearsal.gates[0].threshold",
                                      "cannot fail"),
    "counter gate above a negative": (_mutate("lanes.rehearsal.gates.0.threshold", -1),
                                      "lanes.rehearsal.gates[0].threshold", "cannot fail"),
    "gate of unknown kind": (_mutate("lanes.rehearsal.gates.1", {"kind": "vibes"}), "lanes.rehearsal.gates[1]",
                             "kind: counter"),
    "empty concurrency list": (_mutate("lanes.rehearsal.bench.decode.concurrency", []),
                               "lanes.rehearsal.bench.decode.concurrency", "at least one"),
    "requests per level of zero": (_mutate("lanes.rehearsal.bench.decode.requests_per_level", 0),
                                   "lanes.rehearsal.bench.decode.requests_per_level", "greater than or equal to 1"),
    "zero client workers": (_mutate("lanes.rehearsal.bench.decode.workers", 0),
                            "lanes.rehearsal.bench.decode.workers", "greater than or equal to 1"),
    "missing prompt file": (_mutate("lanes.rehearsal.bench.acceptance.classes.prose", "nope/prose.jsonl"),
                            "lanes.rehearsal.bench.acceptance.classes.prose", "JSONL"),
    "bad host address": (_mutate("hosts.localhost.address", "127.0.0.1; reboot"), "hosts.localhost.address",
                         "host name or an IP"),
    "bad sha256": (_mutate("lanes.rehearsal.model.sha256", "xyz"), "lanes.rehearsal.model.sha256", "documented form"),
    # Remote hosts, links and two-host lanes (docs/hosts.md): values that reach a shell or a peer.
    "docker host with a shell in it": (_mutate("hosts.localhost.docker_host", "unix:///run/d.sock;id"),
                                       "hosts.localhost.docker_host", "documented form"),
    "lane needs an undeclared link": (_mutate("lanes.rehearsal.links", ["spark-roce"]), "lanes.rehearsal.links[0]",
                                      "declare the link under 'links'"),
    "rpc on an engine without it": (lambda d: _mutate("lanes.rehearsal.engine", "vllm")(
                                        _mutate("lanes.rehearsal.rpc", {"workers": ["localhost"], "link": "x"})(d)),
                                    "lanes.rehearsal", "llama.cpp's RPC backend"),
    "link interface with a shell in it": (_mutate("links", [{"name": "l", "a": {"host": "localhost", "interface": "eth0;id",
                                                                               "address": "10.0.0.1"},
                                                             "b": {"host": "localhost", "interface": "eth1",
                                                                   "address": "10.0.0.2"}}]),
                                          "links[0].a.interface", "documented form"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_config_class_gives_one_clear_error(tmp_path, case):
    mutate, field, words = CASES[case]
    path = write(tmp_path, mutate(shipped()))
    r = run_cli("nightly", "--hosts", str(path), "--artifacts", str(tmp_path / "artifacts"))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert str(path) in lines[0] and field in lines[0] and "Fix:" in lines[0] and words in lines[0], lines[0]
    assert not (tmp_path / "artifacts").exists()  # nothing ran


@pytest.mark.parametrize("text,where", [("hosts: [unclosed\n", "line"), ("- just\n- a list\n", "(top level)")])
def test_malformed_yaml(tmp_path, text, where):
    path = write(tmp_path, text)
    r = run_cli("nightly", "--hosts", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and where in r.stderr and "Fix:" in r.stderr


def test_missing_file_and_unknown_lane(tmp_path):
    r = run_cli("nightly", "--hosts", str(tmp_path / "absent.yaml"))
    assert r.returncode == 2 and "absent.yaml" in r.stderr and "Fix:" in r.stderr
    r = run_cli("nightly", "--lane", "gb300-daily")
    assert r.returncode == 2 and "--lane gb300-daily" in r.stderr and "rehearsal" in r.stderr


def test_a_home_relative_path_is_checked_where_the_run_reads_it(tmp_path, monkeypatch):
    """`~/...` in an input file means the same file to the input check, preflight and the run (one
    `resolve`): a prompt set under ~ is accepted, a model under ~ has its magic bytes checked, an
    API key file under ~ is read. Each of these once joined `~` onto the inventory's folder."""
    from tasks.inventory import api_key
    from tasks.stages.input_files import check_prompt_files

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / "prose.jsonl").write_bytes((REPO / "testbed/prompts/prose.jsonl").read_bytes())
    (home / "target.gguf").write_bytes(b"not a model")
    (home / "key").write_text("k-123\n")
    data = _mutate("lanes.rehearsal.bench.acceptance.classes.prose", "~/prose.jsonl")(shipped())
    path = write(tmp_path, data)
    check_prompt_files(load_inventory(path, engine_for), path)  # the prompt set under ~ is found

    data = _mutate("lanes.rehearsal.model.path", "~/target.gguf")(data)
    (tmp_path / "m").mkdir()
    other = write(tmp_path / "m", data)
    with pytest.raises(ConfigError, match=r"lanes\.rehearsal\.model\.path.*is not a GGUF file"):
        check_prompt_files(load_inventory(other, engine_for), other)

    lane = load_inventory(path, engine_for).lanes["rehearsal"].model_copy(update={"api_key_file": "~/key"})
    assert api_key.resolve(lane, tmp_path) == "k-123"
