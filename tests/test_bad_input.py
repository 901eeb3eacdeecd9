"""Bad input found at load time: one line naming file, field and fix, exit 2, never a traceback.

Hand-picked cases from the field (a model path that is a directory or a FIFO, an empty prompt
set, binary or non-UTF-8 files, 100k-deep nesting, an oversized file, a duplicated lane,
`port: true`, a path out of the folder, a model that is not GGUF), then property-based fuzzing
of the inventory with hypothesis: whatever it finds must be a ConfigError or a valid inventory.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.inventory.base import ConfigError
from tasks.inventory.load import load_inventory
from tasks.engines import engine_for
from tasks.stages.input_files import check_prompt_files
from tests.conftest import REPO, shipped_inventory, write_inventory


def _cli(hosts: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "nightly", "--hosts", str(hosts)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


def _lane(inv: dict) -> dict:
    return inv["lanes"]["rehearsal"]


def _model_dir(tmp: Path, inv: dict) -> None:
    (tmp / "adir").mkdir()
    _lane(inv)["model"] = {"path": "adir"}


def _model_fifo(tmp: Path, inv: dict) -> None:
    os.mkfifo(tmp / "afifo")
    _lane(inv)["model"] = {"path": "afifo"}


def _not_gguf(tmp: Path, inv: dict) -> None:
    (tmp / "fake.gguf").write_bytes(b"PK\x03\x04 not a model")
    _lane(inv)["model"] = {"path": "fake.gguf"}


def _escape(tmp: Path, inv: dict) -> None:
    _lane(inv)["model"] = {"path": "../../etc/passwd"}


def _empty_prompts(tmp: Path, inv: dict) -> None:
    (tmp / "empty.jsonl").write_text("\n")
    _lane(inv)["bench"]["decode"]["prompts"] = "empty.jsonl"


def _port_true(tmp: Path, inv: dict) -> None:
    _lane(inv)["port"] = True


CASES = {
    "model path is a directory": (_model_dir, "lanes.rehearsal.model.path", "not a regular file"),
    "model path is a FIFO": (_model_fifo, "lanes.rehearsal.model.path", "not a regular file"),
    "model is not GGUF": (_not_gguf, "lanes.rehearsal.model.path", "not a GGUF file"),
    "model path escapes its folder": (_escape, "lanes.rehearsal.model.path", "climbs out"),
    "empty prompt set": (_empty_prompts, "lanes.rehearsal.bench.decode.prompts", "holds no prompt"),
    "port: true": (_port_true, "lanes.rehearsal.port", "boolean"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_lane_is_one_line_exit_2(case, tmp_path):
    mutate, field, words = CASES[case]
    inv = shipped_inventory()
    mutate(tmp_path, inv)
    hosts = write_inventory(tmp_path, inv)
    with pytest.raises(ConfigError) as e:
        check_prompt_files(load_inventory(hosts, engine_for), hosts)
    assert e.value.field == field and words in str(e.value), str(e.value)


RAW = {
    "binary": (b"\x00\x01\x02hosts", "binary file"),
    "not UTF-8": (b"hosts:\n  a: \xff\xfe\n", "not UTF-8"),
    "100k-deep nesting": (b"hosts: " + b"[" * 100_000, "nested deeper"),
    "oversized": (b"# " + b"x" * (2 << 20) + b"\n", "more than the"),
    "duplicate lane key": (b"hosts: {localhost: {}}\nlanes:\n  a: {}\n  a: {}\n", "appears twice"),
    "alias bomb": (b"a: &a [1,1,1,1,1,1,1,1,1,1]\n" + b"".join(
        b"%s: &%s [%s]\n" % (bytes([98 + i]), bytes([98 + i]), b",".join([b"*" + bytes([97 + i])] * 10))
        for i in range(6)), "aliases"),
}


@pytest.mark.parametrize("case", RAW)
def test_unreadable_inventory_is_one_line(case, tmp_path):
    data, words = RAW[case]
    path = tmp_path / "hosts.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as e:
        load_inventory(path, engine_for)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cli_says_one_line_and_exits_2(tmp_path):
    """Through the CLI a user runs: exit 2, one line on stderr, nothing on stdout, no traceback."""
    path = tmp_path / "hosts.yaml"
    path.write_bytes(b"hosts: " + b"[" * 100_000)
    r = _cli(path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "nested deeper" in r.stderr
    inv = shipped_inventory()
    _not_gguf(tmp_path, inv)
    r = _cli(write_inventory(tmp_path, inv))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not a GGUF file" in r.stderr, r.stderr


# --- fuzzing: any value anywhere, and any bytes -------------------------------------------------

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=30), st.binary(max_size=10).map(lambda b: b.decode("latin-1")))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=12)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


_BASE = shipped_inventory()
_ALL_PATHS = [p for p in _paths(_BASE) if p]


def _set(doc, path, value):
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz")
    (d / "testbed").symlink_to(REPO / "testbed")
    return d


def _load_all(path: Path) -> None:
    try:
        check_prompt_files(load_inventory(path, engine_for), path)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith(str(path)), str(e)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(_ALL_PATHS), value=_VALUES)
def test_fuzz_any_value_anywhere(fuzz_dir, where, value):
    doc = copy.deepcopy(_BASE)
    _set(doc, where, value)
    path = fuzz_dir / "hosts.yaml"
    try:
        path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    except (yaml.YAMLError, UnicodeEncodeError):
        return  # not representable as a YAML file: nothing a user could write
    _load_all(path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                      st.sampled_from([b"hosts:", b"lanes:", b"- ", b"{", b"[", b"&a ", b"*a", b"!!python/object ",
                                       b"\t", b": ", b"\n  "]).flatmap(
                          lambda s: st.lists(st.just(s), max_size=50).map(b"".join))))
def test_fuzz_any_bytes(fuzz_dir, data):
    path = fuzz_dir / "raw.yaml"
    path.write_bytes(data)
    _load_all(path)
