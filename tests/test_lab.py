"""The host lab and the host/link preflight checks, run for real on it.

The lab is GB300 and a Spark pair as network namespaces (tests/lab_fixture.py): every check
here goes over real SSH to a real sshd in a namespace, a real dockerd, a real registry and a
real veth "cable" that the tests cut, mis-set and restore. Tests run in file order: the last
ones take the lab down and bring it up again.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import run_cli

from lab import netns
from lab.lab import BRIDGE, DIRECT_IF, HOSTS, ORCHESTRATOR, REGISTRY_PORT
from tasks.inventory.models import FileRef, Link
from tasks.hosts.checks import check_host
from tasks.hosts.links import check_link, lane_links
from tasks.hosts.connect import transport_for
from tasks.hosts.transport import HostKeyError

pytest_plugins = ["lab_fixture"]  # the session `lab` fixture, one instance for every module that uses it


@pytest.fixture
def transports(lab):
    ts = lab.transports()
    yield ts
    for t in ts.values():
        t.close()


@pytest.fixture
def direct(lab) -> Link:
    return lab.inventory().links[0]


# ---- the topology ------------------------------------------------------------------------------

def test_namespaces_reachable_over_ssh_on_the_management_network(lab, transports):
    assert set(HOSTS) <= set(netns.list_netns())
    for name, address in HOSTS.items():
        r = transports[name].run(["ip", "-j", "addr", "show", "dev", "mgmt0"], deadline_s=20)
        assert r.exit_code == 0, r.stderr
        addrs = [a["local"] for a in json.loads(r.stdout)[0]["addr_info"]]
        assert address in addrs, f"{name}: the SSH session runs in the wrong namespace ({addrs})"
        # no default route: nothing in the lab can send traffic off this machine
        routes = subprocess.run(["ip", "-n", name, "-j", "route", "show", "default"], capture_output=True,
                                text=True, check=True).stdout
        assert json.loads(routes or "[]") == [], f"{name} has a default route"


def test_hosts_are_verified_by_key_never_trusted_on_first_use(lab, tmp_path):
    host = lab.inventory().hosts["spark1"]
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    t = transport_for("spark1", host.model_copy(update={"known_hosts": str(empty)}), lab.inventory_path.parent)
    try:
        with pytest.raises(HostKeyError):
            t.run(["true"], deadline_s=20)
    finally:
        t.close()
    assert empty.read_text() == "", "an unknown host key was recorded"


def test_gb300_dockerd_and_registry_answer(lab, transports):
    inv = lab.inventory()
    docker_host = inv.hosts["gb300"].docker_host
    assert docker_host == lab.state()["docker_host"]
    # gb300's dockerd, asked from gb300 itself over SSH
    r = transports["gb300"].run(["docker", "--host", docker_host, "info", "--format", "{{json .RegistryConfig}}"],
                                deadline_s=30)
    assert r.exit_code == 0, r.stderr
    assert f"{ORCHESTRATOR}:{REGISTRY_PORT}" in r.stdout  # it may pull from the lab registry over plain HTTP
    # the registry holds the image the inventory pins, by digest
    image = inv.lanes["gb300-container"].image
    assert image == lab.state()["image"]
    repo, digest = image.split("/", 1)[1].split("@")
    base = f"http://{ORCHESTRATOR}:{REGISTRY_PORT}/v2"
    assert httpx.get(f"{base}/", timeout=5).status_code == 200
    manifest = httpx.get(f"{base}/{repo}/manifests/{digest}", timeout=5, headers={
        "Accept": "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"})
    assert manifest.status_code == 200, manifest.text


def test_inventory_declares_the_lanes_and_the_link(lab):
    inv = lab.inventory()
    assert set(inv.hosts) == set(HOSTS) and all(h.transport == "ssh" for h in inv.hosts.values())
    assert lane_links(inv.lanes["spark-pair"]) == ["spark-direct"]
    assert inv.lanes["spark-pair"].rpc.workers == ["spark2"]
    for host in inv.hosts.values():
        assert Path(host.paths.models).is_dir() and Path(host.paths.artifacts).is_dir()
    gb = inv.lanes["gb300-container"]
    assert Path(gb.model.path).stat().st_size == gb.model.bytes
    assert run_cli("lab", "status", timeout=60).returncode == 0


# ---- link preflight ----------------------------------------------------------------------------

def test_direct_link_passes_with_mtu_and_bandwidth(direct, transports):
    check = check_link(direct, transports)
    assert check.ok, check.reason
    assert (check.a.operstate, check.b.operstate) == ("UP", "UP")
    assert check.a.mtu == check.b.mtu == 9000
    assert check.ping_ok and check.mtu_ping_ok
    assert check.bandwidth is not None and check.bandwidth.tool == "iperf3"
    assert check.bandwidth.gbps >= direct.min_gbps


def test_cut_link_names_host_interface_and_state_then_restore_passes(lab, direct, transports):
    lab.cut_link()
    try:
        check = check_link(direct, transports)
        assert not check.ok
        assert check.reason.startswith("link spark-direct: spark1 direct0 is DOWN"), check.reason
        assert "spark2 direct0 is " in check.reason and "(carrier 0)" in check.reason, check.reason
        assert check.b.carrier == 0 and not check.a.admin_up
        assert check.ping_ok is None  # nothing was sent over a link known to be down
    finally:
        lab.restore_link()
    check = check_link(direct, transports)
    assert check.ok, check.reason


def test_mtu_mismatch_is_named(direct, transports):
    netns.ip("link", "set", DIRECT_IF, "mtu", "1500", netns="spark2")
    try:
        check = check_link(direct, transports)
        assert not check.ok
        assert check.reason == "link spark-direct: spark2 direct0 MTU 1500, expected 9000"
    finally:
        netns.ip("link", "set", DIRECT_IF, "mtu", "9000", netns="spark2")


def test_peer_that_does_not_answer_is_unreachable(direct, transports):
    # both ends up and well configured, but spark2 stops answering ARP: only the ping can tell
    netns.ip("link", "set", "dev", DIRECT_IF, "arp", "off", netns="spark2")
    netns.ip("neigh", "flush", "dev", DIRECT_IF, netns="spark1")
    try:
        check = check_link(direct, transports)
        assert not check.ok and check.b.operstate == "UP"
        assert check.reason == "link spark-direct: spark2 10.213.1.2 unreachable from spark1 over direct0"
    finally:
        netns.ip("link", "set", "dev", DIRECT_IF, "arp", "on", netns="spark2")


def test_other_link_faults_are_named(lab, direct, transports):
    check = check_link(direct.model_copy(update={"min_gbps": 10_000.0}), transports)
    assert not check.ok and check.bandwidth is not None
    assert "below the declared minimum 10000" in check.reason and "(iperf3)" in check.reason
    missing = direct.model_copy(update={"a": direct.a.model_copy(update={"interface": "direct9"})})
    check = check_link(missing, transports)
    assert check.reason == "link spark-direct: spark1 has no interface direct9"
    host = lab.inventory().hosts["spark2"].model_copy(update={"port": 2222, "connect_timeout_s": 2.0})
    dead = transport_for("spark2", host, lab.inventory_path.parent)
    try:
        check = check_link(direct, {**transports, "spark2": dead})
    finally:
        dead.close()
    assert check.reason.startswith("link spark-direct: spark2 unreachable ("), check.reason


# ---- host preflight ----------------------------------------------------------------------------

def test_gb300_host_check_passes_and_caches_sha256(lab, transports, tmp_path):
    inv = lab.inventory()
    host, lane = inv.hosts["gb300"], inv.lanes["gb300-container"]
    cache = tmp_path / "sha256-cache.json"
    first = check_host("gb300", host, transports["gb300"], [lane.model, lane.drafter], True, cache_path=cache)
    assert first.ok, first.reason
    assert first.reachable and first.docker_server
    assert [d.role for d in first.disks] == ["models", "artifacts"] and all(d.avail_bytes > 0 for d in first.disks)
    assert first.files[0].sha256 == lane.model.sha256 and not first.files[0].sha256_cached
    again = check_host("gb300", host, transports["gb300"], [lane.model], False, cache_path=cache)
    assert again.ok and again.files[0].sha256_cached and again.docker_server is None
    os.utime(lane.model.path)  # touched: the cached digest no longer vouches for it
    third = check_host("gb300", host, transports["gb300"], [lane.model], False, cache_path=cache)
    assert third.ok and not third.files[0].sha256_cached


def test_host_check_failures_name_the_fault(lab, transports, tmp_path):
    inv = lab.inventory()
    host, lane, t = inv.hosts["gb300"], inv.lanes["gb300-container"], transports["gb300"]
    cache = tmp_path / "cache.json"

    def reason(files=(), needs_docker=False, h=host, **kw) -> str:
        result = check_host("gb300", h, t, list(files), needs_docker, cache_path=cache, **kw)
        assert not result.ok
        return result.reason

    path = lane.model.path
    assert reason([FileRef(path=path, bytes=lane.model.bytes + 1)]) == \
        f"model file {path} on gb300 has {lane.model.bytes} bytes, the lane declares {lane.model.bytes + 1}"
    assert reason([FileRef(path=path, sha256="0" * 64)]).startswith(f"model file {path} on gb300 has sha256 ")
    assert reason([FileRef(path=path + ".gone")]) == f"model file {path}.gone is missing on gb300"
    no_daemon = host.model_copy(update={"docker_host": "unix:///run/lanebench-no-such.sock"})
    assert reason(needs_docker=True, h=no_daemon).startswith(
        "docker daemon on gb300 (unix:///run/lanebench-no-such.sock) not answering")
    assert reason(h=host.model_copy(update={"gpus": 1})).startswith("gb300 declares 1 GPU(s) but nvidia-smi failed")
    assert "MiB free, less than" in reason(min_free_bytes=2**62)
    gone = host.model_copy(update={"paths": host.paths.model_copy(update={"models": "/nonexistent/models"})})
    assert reason(h=gone).startswith("models path /nonexistent/models on gb300")


def test_host_check_on_a_local_host_resolves_paths_from_the_inventory(tmp_path):
    from conftest import REPO, shipped_inventory

    from tasks.inventory.models import Inventory
    from tasks.hosts.transport import LocalTransport

    inv = Inventory.model_validate(shipped_inventory())
    lane = inv.lanes["rehearsal"]
    result = check_host("localhost", inv.hosts["localhost"], LocalTransport("localhost"), [lane.model, lane.drafter],
                        False, base_dir=REPO, cache_path=tmp_path / "c.json")
    assert result.ok, result.reason
    assert result.files[0].path == str(REPO / lane.model.path) and result.disks[0].path == str(REPO)


def test_unreachable_host_is_named(lab):
    host = lab.inventory().hosts["spark2"].model_copy(update={"port": 2222, "connect_timeout_s": 2.0})
    t = transport_for("spark2", host, lab.inventory_path.parent)
    try:
        t0 = time.monotonic()
        result = check_host("spark2", host, t, [], False)
    finally:
        t.close()
    assert not result.ok and not result.reachable
    assert result.reason.startswith("host spark2 (10.213.0.12:2222) unreachable"), result.reason
    assert time.monotonic() - t0 < 60


# ---- up over a running lab, down, down again ---------------------------------------------------

def test_up_replaces_a_leftover_lab(lab):
    # another process, which knows nothing of this one's daemons: the crashed-run case
    before = lab.state()["processes"]
    result = run_cli("lab", "up", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "removing a leftover lab first" in result.stdout
    after = lab.state()["processes"]
    assert set(after) == set(before) and not set(after.values()) & set(before.values())
    assert all(not Path(f"/proc/{pid}").exists() or b".lab" not in Path(f"/proc/{pid}/cmdline").read_bytes()
               for pid in before.values())
    ts = lab.transports()  # new host keys, new known_hosts: still verified
    try:
        assert all(t.run(["true"], deadline_s=20).exit_code == 0 for t in ts.values())
    finally:
        for t in ts.values():
            t.close()


def test_down_leaves_nothing_behind_and_is_safe_twice(lab):
    from lab_fixture import residue  # imported once the plugin is registered (assertion rewriting)

    inv = lab.inventory()
    docker_host, image = inv.hosts["gb300"].docker_host, inv.lanes["gb300-container"].image
    # a container (rpc-server stays up) and a stray process in a namespace the lab never recorded
    run = subprocess.run(["docker", "--host", docker_host, "run", "-d", "--network", "host", "--entrypoint",
                          "/rpc-server", image, "-H", "127.0.0.1", "-p", "50099"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    stray = subprocess.Popen(["ip", "netns", "exec", "spark2", "sleep", "600"], start_new_session=True)
    try:
        seen = residue(lab.dir)  # the checker sees a live lab, so an empty answer below means something
        assert any(s.startswith("namespace") for s in seen) and any(s.startswith("process") for s in seen), seen
        assert any(b"rpc-server" in line for line in _cmdlines())
        assert lab.down()
        assert residue(lab.dir) == []
        assert stray.wait(timeout=10) is not None
        assert not any(b"rpc-server" in line for line in _cmdlines())
        assert not netns.link_exists(BRIDGE) and not lab.inventory_path.exists()
        assert lab.leftovers() == []
        lab.down()  # twice: nothing to do, no error
        assert residue(lab.dir) == []
    finally:
        if stray.poll() is None:
            stray.kill()
        lab.up()  # the session's other users get their lab back
    assert lab.status()[0]


def _cmdlines() -> list[bytes]:
    lines = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            lines.append(p.read_bytes())
        except OSError:
            continue
    return lines


def test_cli_needs_an_up_lab_for_link_commands():
    # `lanebench lab` is registered with the CLI and validates its action
    result = run_cli("lab", "sideways", timeout=60)
    assert result.returncode == 2 and "invalid choice" in result.stderr
