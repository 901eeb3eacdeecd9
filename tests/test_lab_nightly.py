"""The nightly on the host lab, as a user runs it: `lanebench nightly --hosts hosts.lab.yaml`.

The lab (tests/lab_fixture.py) is GB300 and a Spark pair as network namespaces with sshd, gb300's
own dockerd and a local registry. Its inventory has two lanes: `gb300-container`, llama-server in
a container pulled by digest from the registry, and `spark-pair`, llama-server on spark1 with its
layers on an rpc-server on spark2, across the direct link. Each test shows one thing the issue
asks for: digests and link checks in the manifest; a cut link skips only the lane that needs it;
a registry that is down fails its lane clearly; and the two-host lane really crosses the link.
Faults mid-run on the two-host lane (the link cut, its host's sshd killed, its worker killed) end
it within a bounded time, naming stage and reason, and leave nothing behind.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from conftest import manifest_of, run_cli, run_folder_of
from tasks.inventory.load import load_inventory
from tasks.engines import engine_for

pytest_plugins = ["lab_fixture"]  # the session `lab` fixture, shared with tests/test_lab.py


def _nightly(lab, artifacts: Path) -> tuple[subprocess.CompletedProcess, Path, dict]:
    result = run_cli("nightly", "--hosts", str(lab.inventory_path), "--artifacts", str(artifacts), timeout=600)
    folder = run_folder_of(result)
    return result, folder, manifest_of(folder)


def _engines_left(lab) -> list[str]:
    """Engine containers on gb300 and engine processes anywhere (the lab shares this kernel)."""
    state = lab.state()
    left = subprocess.run(["docker", "--host", state["docker_host"], "ps", "-a", "--format", "{{.Names}}"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.split()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv0 = (proc / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if argv0.endswith((b"llama-server", b"rpc-server")):
                left.append(f"pid {proc.name} {argv0.decode()}")
    return left


def test_lab_nightly_runs_the_container_lane_by_digest_and_the_two_host_lane(lab, tmp_path):
    lab.drop_image()  # gb300 starts without the image, so the lane must pull it from the registry
    result, folder, m = _nightly(lab, tmp_path / "art")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    gb300, pair = m["lanes"]["gb300-container"], m["lanes"]["spark-pair"]
    assert gb300["status"] == "passed" and pair["status"] == "passed", (gb300["reason"], pair["reason"])

    pinned = load_inventory(lab.inventory_path, engine_for).lanes["gb300-container"].image
    image = gb300["image"]
    assert image["pulled"] is True and image["reference"] == pinned
    assert image["digest"] == pinned.split("@")[1] and pinned in image["repo_digests"]
    assert image["image_id"].startswith("sha256:")
    assert gb300["launch_command"].startswith("/llama-server ")  # the image's entrypoint, not a host binary
    assert gb300["preflight"]["hosts"][0]["docker_server"]

    link = pair["preflight"]["links"][0]
    assert link["link"] == "spark-direct" and link["ok"] and link["ping_ok"] and link["mtu_ping_ok"]
    assert {link["a"]["operstate"], link["b"]["operstate"]} == {"UP"} and link["a"]["mtu"] == 9000
    assert link["bandwidth"]["gbps"] > 0.1
    assert "--rpc 10.213.1.2:50052" in pair["launch_command"]
    assert [h["host"] for h in pair["preflight"]["hosts"]] == ["spark1", "spark2"]
    assert "Accepted client connection" in (folder / "spark-pair" / "worker-spark2.log").read_text()
    for lane in ("gb300-container", "spark-pair"):
        assert (folder / lane / "acceptance.parquet").is_file()
    # Different hosts, different locks: the two lanes measured at the same time.
    assert gb300["host_lock"]["limit"] == "gpu:gb300" and pair["host_lock"]["limit"] == "gpu:spark1,gpu:spark2"
    assert gb300["started_at"] < pair["finished_at"] and pair["started_at"] < gb300["finished_at"], (
        gb300["started_at"], gb300["finished_at"], pair["started_at"], pair["finished_at"])

    report = (folder / "report.md").read_text()
    assert f"image `{pinned}`: pulled" in report and "link **spark-direct** ok" in report
    assert _engines_left(lab) == []
    verify = run_cli("verify", str(folder))
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_cut_link_skips_the_two_host_lane_and_the_rest_still_runs(lab, tmp_path):
    lab.cut_link()
    try:
        result, folder, m = _nightly(lab, tmp_path / "art")
    finally:
        lab.restore_link()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    pair = m["lanes"]["spark-pair"]
    assert pair["status"] == "skipped" and pair["stage"] == "preflight"
    assert pair["reason"].startswith("link spark-direct: spark1 direct0 is DOWN"), pair["reason"]
    assert "spark2 direct0 is DOWN (carrier 0)" in pair["reason"]
    assert not pair["launch_command"]  # nothing was booted for it
    assert m["lanes"]["gb300-container"]["status"] == "passed"
    report = (folder / "report.md").read_text()
    assert f"| spark-pair | **skipped** | preflight | {pair['reason']} |" in report
    assert _engines_left(lab) == []


def test_the_two_host_lane_truly_needs_the_link(lab, tmp_path):
    """Past preflight, the link still carries the lane: with it cut, llama-server cannot reach its
    RPC worker and dies at boot (the seeds' lane that could not boot for an unplugged cable)."""
    from tasks.engines.build import llama_cpp_bin_dir

    transports = lab.transports()
    bin_dir = llama_cpp_bin_dir()
    model = str(lab.host_dir("spark1") / "models" / "target-f16.gguf")
    lab.cut_link()
    worker = server = None
    try:
        worker = transports["spark2"].spawn([str(bin_dir / "rpc-server"), "--host", "10.213.1.2", "--port", "50061"],
                                            tmp_path / "worker.log", name="needs-link-worker")
        server = transports["spark1"].spawn(
            [str(bin_dir / "llama-server"), "--model", model, "--host", "10.213.0.11", "--port", "18709",
             "--ctx-size", "512", "--threads", "1", "--rpc", "10.213.1.2:50061"],
            tmp_path / "server.log", name="needs-link-server")
        deadline = time.monotonic() + 60
        while server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        code = server.poll()
        assert code not in (None, 0), f"llama-server still running or exited 0 with the link cut:\n" \
                                      f"{(tmp_path / 'server.log').read_text()[-1500:]}"
    finally:
        for spawned in (server, worker):
            if spawned is not None:
                spawned.stop(5)
        lab.restore_link()
        for t in transports.values():
            t.close()
    assert _engines_left(lab) == []


def test_a_registry_that_is_down_fails_the_container_lane_clearly(lab, tmp_path):
    lab.drop_image()
    lab.stop_registry()
    try:
        result, folder, m = _nightly(lab, tmp_path / "art")
    finally:
        lab.start_registry()
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    gb300 = m["lanes"]["gb300-container"]
    assert gb300["status"] == "failed" and gb300["stage"] == "image pull"
    assert gb300["reason"].startswith("image pull: registry 10.213.0.1:5000 did not answer"), gb300["reason"]
    assert m["lanes"]["spark-pair"]["status"] == "passed"  # the other lane still ran
    said = " ".join((result.stderr + result.stdout).split())  # the console wraps long lines
    assert "nightly failed (1 passed, 1 failed): gb300-container: image pull: registry 10.213.0.1:5000 did not answer" in said
    assert "Traceback" not in result.stderr
    assert _engines_left(lab) == []


def _lab_rpc_servers() -> list[int]:
    """The lab's spark2 rpc-server (bound to spark2's end of the direct link), nothing else's."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"rpc-server") and b"10.213.1.2" in argv and b"50052" in argv:
                out.append(int(proc.name))
    return out


def test_killing_the_worker_node_mid_run_fails_the_lane_and_leaves_nothing(lab, tmp_path):
    """The two-node lane (`nodes: [spark1, spark2]`: llama-server on node 0, rpc-server on node 1)
    boots across the link; its worker node's process is killed once measuring has begun. The lane
    fails naming the dead node, and no process is left on either host. One boot."""
    import os
    import signal
    import sys

    from conftest import REPO

    artifacts = tmp_path / "art"
    nightly = subprocess.Popen([sys.executable, "-m", "flows.cli", "nightly", "--hosts", str(lab.inventory_path),
                                "--lane", "spark-pair", "--artifacts", str(artifacts)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 420
        while killed is None and time.monotonic() < deadline and nightly.poll() is None:
            records = list(artifacts.glob("*/spark-pair/requests.jsonl"))
            if records and records[0].read_text().strip() and (workers := _lab_rpc_servers()):
                os.kill(workers[0], signal.SIGKILL)  # the worker host's process, mid-run
                killed = workers[0]
            time.sleep(0.2)
        out, err = nightly.communicate(timeout=420)
    finally:
        if nightly.poll() is None:
            nightly.kill()
            nightly.wait()
    assert killed is not None, "the lane never started measuring"
    assert nightly.returncode == 1, out[-3000:] + err[-3000:]
    m = manifest_of(Path(out.strip().splitlines()[-1].removeprefix("run folder: ")))
    pair = m["lanes"]["spark-pair"]
    assert pair["status"] == "failed" and pair["launch_command"], pair
    assert "rpc-server on spark2 exited with code" in pair["reason"], pair["reason"]
    assert pair["reason"].endswith("(a worker of this lane across hosts is gone)")
    assert pair["config"]["nodes"]["hosts"] == ["spark1", "spark2"]
    # Nothing of the lane on either host (only the lab's: this machine is shared with other runs).
    left = [e for e in _engines_left(lab) if not e.startswith("pid ") or _on_the_lab(int(e.split()[1]))]
    assert left == []


def _on_the_lab(pid: int) -> bool:
    try:
        return b"10.213." in (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False


def test_the_kl_gate_serves_lab_lanes_over_ssh_like_the_nightly(lab, tmp_path):
    """`lanebench kl` on lab lanes: the reference across the Spark pair's link, the candidate in
    gb300's container, both reached over SSH; the same target bytes, so the candidate passes."""
    from conftest import REPO

    kl_file = tmp_path / "lab-kl.yaml"
    kl_file.write_text(f"""
inventory: {lab.inventory_path}
prompts: {REPO / "kl" / "prompts.jsonl"}
prompt_count: 3
tokens_per_prompt: 24
reference: pair
candidates: [container]
lanes:
  pair: {{lane: spark-pair}}
  container: {{lane: gb300-container}}
bars: {{max_mean_abs_dlogprob: 0.02}}
""")
    result = run_cli("kl", str(kl_file), "--artifacts", str(tmp_path / "art"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    m = manifest_of(run_folder_of(result))
    pair, container = m["lanes"]["pair"], m["lanes"]["container"]
    assert pair["status"] == "passed" and container["status"] == "passed", (pair["reason"], container["reason"])
    assert "--rpc 10.213.1.2:50052" in pair["launch_command"] and pair["preflight"]["links"][0]["ok"]
    assert container["launch_command"].startswith("/llama-server ") and container["image"]["digest"]
    assert pair["host_lock"]["limit"] == "gpu:spark1,gpu:spark2" and container["host_lock"]["limit"] == "gpu:gb300"
    assert m["flow"]["kl"]["positions"] > 0
    assert _engines_left(lab) == []


# ---- faults mid-run on the two-host lane: the link cut, the lane host's sshd killed -----------------

LAB_DEADLINE_S = 15  # the two-host lane's declared request deadline in these tests (its derived one is 62 s)


def _lab_inventory(lab, folder: Path) -> Path:
    """hosts.lab.yaml with the Spark pair's decode requests under a short declared wall deadline."""
    import yaml

    from conftest import write_inventory

    inv = yaml.safe_load(lab.inventory_path.read_text())
    inv["lanes"]["spark-pair"]["bench"]["decode"]["deadline_s"] = LAB_DEADLINE_S
    return write_inventory(folder, inv)


class _Nightly:
    """`lanebench nightly` running in the background, its output in a file (a pipe could fill and stall it)."""

    def __init__(self, hosts: Path, artifacts: Path, *extra: str) -> None:
        import sys

        from conftest import REPO

        self.artifacts, self.log = artifacts, artifacts.parent / "nightly.out"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "nightly", "--hosts", str(hosts),
                                      "--artifacts", str(artifacts), *extra], cwd=REPO, stdout=self._out,
                                     stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        return self.log.read_text()

    def measuring(self, lane: str, timeout: float = 420) -> None:
        """Wait until the lane's decode curve has kept a record (warmup and boot gates are behind it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the nightly ended early:\n{self.output()[-3000:]}"
            for path in self.artifacts.glob(f"*/{lane}/requests.jsonl"):
                if '"stage":"decode"' in path.read_text():
                    return
            time.sleep(0.1)
        raise AssertionError(f"{lane} never started its decode curve")

    def wait(self, timeout: float) -> tuple[int, Path]:
        rc = self.proc.wait(timeout)
        self._out.close()
        return rc, Path(self.output().strip().splitlines()[-1].removeprefix("run folder: "))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _lab_engines_left(lab) -> list[str]:
    """Engine containers on gb300, engine processes of the lab (this machine is shared with other runs)."""
    return [e for e in _engines_left(lab) if not e.startswith("pid ") or _on_the_lab(int(e.split()[1]))]


def _ended(lane: dict) -> float:
    """When the lane's teardown ended (seconds since the epoch)."""
    return next(m["at"] for m in lane["timeline"] if m["stage"] == "done")


def test_a_link_cut_mid_curve_fails_the_two_host_lane_at_its_deadline_and_the_rest_runs(lab, tmp_path, monkeypatch):
    """The direct link is cut once the two-host lane is measuring (past preflight, boot and warmup):
    llama-server on spark1 waits on its RPC worker for ever and still answers its health, so only the
    request deadline can end it. The lane fails naming the stage and the deadline within a bounded
    time, its records are kept and listed (verify passes), the container lane of the same nightly
    passes, and no engine process or container is left on any host. One boot per lane."""
    # The declared wall deadline is what this test holds; the stall bound from the lane's own
    # steady state (floor 10 s, test_faults_proof.py) would cut the request first on a quiet box.
    monkeypatch.setenv("LANEBENCH_STALL_FLOOR_S", "300")
    n = _Nightly(_lab_inventory(lab, tmp_path), tmp_path / "art")
    try:
        n.measuring("spark-pair")
        lab.cut_link()
        cut = time.time()
        rc, folder = n.wait(timeout=420)
    finally:
        n.kill()
        lab.restore_link()
    m = manifest_of(folder)
    pair, gb300 = m["lanes"]["spark-pair"], m["lanes"]["gb300-container"]
    assert rc == 1, n.output()[-3000:]
    assert pair["status"] == "failed" and pair["reason"].startswith("decode curve: "), pair["reason"]
    assert f"ran past the {LAB_DEADLINE_S} s wall deadline" in pair["reason"], pair["reason"]
    took = _ended(pair) - cut
    assert took < LAB_DEADLINE_S + 60, f"the lane took {took:.1f} s to end after the cut"
    assert gb300["status"] == "passed", gb300["reason"]  # the other lane of the night still ran
    assert any(a["path"] == "spark-pair/requests.jsonl" for a in m["artifacts"])
    verify = run_cli("verify", str(folder))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert _lab_engines_left(lab) == []
    print(f"\n[reliability] link cut mid curve: lane ended {took:.1f} s after the cut (deadline "
          f"{LAB_DEADLINE_S} s); load {Path('/proc/loadavg').read_text().split()[0]}; reason: {pair['reason'][:200]}")


def test_the_lane_hosts_sshd_killed_mid_run_fails_the_lane_and_leaves_nothing(lab, tmp_path):
    """spark1's sshd (listener and every connection, lanebench's own too) is SIGKILLed while the
    two-host lane measures: lanebench can no longer ask spark1 after its server, nor stop it. The
    lane fails at the next check naming the stage and the unreachable host, without a hang, exit 1;
    teardown still ends (the timeline has `done`), stops what it can reach (spark2's rpc-server) and
    says what it left on spark1. Once sshd is back, the next run's first step (reclaim, from the
    pidfile) stops that server: nothing of the lane is left on either host. Records kept, verify passes."""
    from tasks.hosts.reclaim import reclaim_leftovers

    n = _Nightly(_lab_inventory(lab, tmp_path), tmp_path / "art", "--lane", "spark-pair")
    try:
        n.measuring("spark-pair")
        assert lab.kill_sshd("spark1") >= 2  # the listener and lanebench's connection
        t0 = time.time()
        rc, folder = n.wait(timeout=300)
        took = time.time() - t0
        reachable_left = _lab_rpc_servers()
    finally:
        n.kill()
        lab.start_sshd("spark1")
    m = manifest_of(folder)
    pair = m["lanes"]["spark-pair"]
    assert rc == 1, n.output()[-3000:]
    assert pair["status"] == "failed" and pair["reason"].startswith("decode curve: "), pair["reason"]
    assert "cannot be reached" in pair["reason"] and "spark1" in pair["reason"], pair["reason"]
    assert took < 90, f"took {took:.1f} s to end"
    assert reachable_left == []  # spark2, still reachable, has no worker left
    assert any(w.startswith("teardown: spark1") and "left on its host" in w for w in pair["warnings"]), pair["warnings"]
    assert _ended(pair) - t0 < took  # teardown ended, it did not raise past the lane
    assert any(a["path"] == "spark-pair/requests.jsonl" for a in m["artifacts"])
    verify = run_cli("verify", str(folder))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # sshd back: the next run reclaims what spark1 kept (its server, if it outlived its session).
    inv = lab.inventory()
    transports = lab.transports()
    try:
        lines = reclaim_leftovers("spark-pair", inv.lanes["spark-pair"], inv.hosts["spark1"], transports, "spark1")
    finally:
        for t in transports.values():
            t.close()
    assert not any("not done" in line for line in lines), lines
    assert _lab_engines_left(lab) == []
    print(f"\n[reliability] sshd killed mid run: ended in {took:.1f} s; "
          f"load {Path('/proc/loadavg').read_text().split()[0]}; reason: {pair['reason'][:200]}; then {lines}")
