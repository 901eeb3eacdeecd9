"""Container lanes against a real dockerd and a real registry (lab/docker.py), on loopback only.

The engine image is built from the pinned llama.cpp build (lab/image.py), pushed to the
registry and pulled by digest into a second, empty dockerd; the container then serves the
testbed target model. The last test stops the lab and asserts nothing is left.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, no_llama_server_left
from docker_fixture import DockerLab, free_loopback_port

from lab.procs import alive as _alive
from lab.image import LABEL_BUILD, REPOSITORY, build_and_push, build_identity
from tasks.inventory.models import ContainerSettings
from tasks.hosts.containers import (
    ContainerError,
    ImageError,
    container_name,
    pull_by_digest,
    remove_leftover,
    run_container,
    verify_repo_digests,
)
from tasks.hosts.transport import LocalTransport

PORTS = range(18600, 18620)
MODELS = REPO / "testbed" / "models"
ZERO_DIGEST = "sha256:" + "0" * 64


@pytest.fixture(scope="module")
def lab(llama_bin: Path):
    """Registry + build daemon (A) + empty pull daemon (B); the image built and pushed once."""
    lab = DockerLab()
    try:
        lab.registry_daemon = lab.registry()
        lab.build = lab.dockerd("a")
        lab.pull = lab.dockerd("b")
        t0 = time.monotonic()
        lab.image_ref = build_and_push(lab.build.docker_host, lab.registry_daemon.url, llama_bin)
        lab.build_seconds = time.monotonic() - t0
        lab.engine_pids = set()
        yield lab
    finally:
        lab.stop()
        lab.remove()


@pytest.fixture(scope="module")
def local() -> LocalTransport:
    return LocalTransport()


def _registry_get(lab: DockerLab, path: str, **headers: str) -> httpx.Response:
    return httpx.get(f"http://{lab.registry_daemon.url}{path}", headers=headers, timeout=10)


def test_image_is_built_from_the_pinned_build_and_pushed(lab: DockerLab, llama_bin: Path) -> None:
    identity = build_identity(llama_bin)
    repo, digest = lab.image_ref.split("@")
    assert repo == f"{lab.registry_daemon.url}/{REPOSITORY}"
    tag = identity[LABEL_BUILD][:12]
    # The registry holds the tag, and the tag's manifest is the digest we were handed.
    assert tag in _registry_get(lab, f"/v2/{REPOSITORY}/tags/list").json()["tags"]
    manifest = _registry_get(lab, f"/v2/{REPOSITORY}/manifests/{tag}",
                             Accept="application/vnd.docker.distribution.manifest.v2+json")
    assert manifest.headers["Docker-Content-Digest"] == digest
    # The image says which build is inside, and holds only our binaries and their libraries.
    labels = json.loads(lab.build.docker("image", "inspect", "--format", "{{json .Config.Labels}}", lab.image_ref).stdout)
    assert {k: labels[k] for k in identity} == identity
    entry = lab.build.docker("image", "inspect", "--format", "{{json .Config.Entrypoint}}", lab.image_ref).stdout
    assert json.loads(entry) == ["/llama-server"]
    version = lab.build.docker("run", "--rm", "--pull", "never", "--network", "none", lab.image_ref, "--version")
    assert version.returncode == 0, version.stderr
    assert "version:" in version.stdout + version.stderr
    # Same build again: nothing rebuilt (same image id), same pinned reference.
    image_id = lab.build.docker("image", "inspect", "--format", "{{.Id}}", lab.image_ref).stdout
    t0 = time.monotonic()
    assert build_and_push(lab.build.docker_host, lab.registry_daemon.url, llama_bin) == lab.image_ref
    assert time.monotonic() - t0 < lab.build_seconds + 5
    assert lab.build.docker("image", "inspect", "--format", "{{.Id}}", lab.image_ref).stdout == image_id


def test_pull_by_digest_into_an_empty_daemon_verifies_the_digest(lab: DockerLab, local: LocalTransport) -> None:
    assert lab.pull.docker("images", "-q").stdout.strip() == ""
    facts = pull_by_digest(local, lab.pull.docker_host, lab.image_ref)
    assert facts.pulled and facts.reference == lab.image_ref
    assert facts.digest == lab.image_ref.split("@")[1]
    assert lab.image_ref in facts.repo_digests
    built_id = lab.build.docker("image", "inspect", "--format", "{{.Id}}", lab.image_ref).stdout.strip()
    assert facts.image_id == built_id  # the same config blob travelled
    again = pull_by_digest(local, lab.pull.docker_host, lab.image_ref)
    assert not again.pulled and again.image_id == facts.image_id


def test_a_digest_that_is_not_the_local_image_is_refused(lab: DockerLab) -> None:
    repo = lab.image_ref.split("@")[0]
    with pytest.raises(ImageError, match=f"pinned digest {ZERO_DIGEST} but the local image has .*sha256:"):
        verify_repo_digests(f"{repo}@{ZERO_DIGEST}", [lab.image_ref])


def test_a_wrong_digest_fails_clearly(lab: DockerLab, local: LocalTransport) -> None:
    repo = lab.image_ref.split("@")[0]
    t0 = time.monotonic()
    with pytest.raises(ImageError) as err:
        pull_by_digest(local, lab.pull.docker_host, f"{repo}@{ZERO_DIGEST}", deadline_s=60)
    message = str(err.value)
    assert f"registry {lab.registry_daemon.url} would not give {repo}@{ZERO_DIGEST}" in message
    assert "manifest unknown" in message or "not found" in message  # docker's own words
    assert time.monotonic() - t0 < 30


def test_a_registry_that_is_down_gives_one_clear_failure(lab: DockerLab, local: LocalTransport) -> None:
    down = lab.registry("reg-down")
    moved = f"{down.url}/{REPOSITORY}:moved"
    assert lab.build.docker("tag", lab.image_ref, moved).returncode == 0
    push = lab.build.docker("push", moved)
    assert push.returncode == 0, push.stderr
    digest = lab.image_ref.split("@")[1]
    assert f"digest: {digest}" in push.stdout  # same manifest, other registry
    down.stop()
    t0 = time.monotonic()
    with pytest.raises(ImageError) as err:
        pull_by_digest(local, lab.pull.docker_host, f"{down.url}/{REPOSITORY}@{digest}", deadline_s=60)
    seconds = time.monotonic() - t0
    assert str(err.value).startswith(f"registry {down.url} did not answer: ")
    assert "connection refused" in str(err.value)  # docker's own message
    assert seconds < 20


def test_run_container_serves_the_target_model(lab: DockerLab, local: LocalTransport, tmp_path: Path) -> None:
    port = free_loopback_port(PORTS)
    log_path = tmp_path / "engine.log"
    assert remove_leftover(local, lab.pull.docker_host, "rehearsal-c") is False
    argv = ["-m", str(MODELS / "target-f16.gguf"), "--host", "127.0.0.1", "--port", str(port),
            "--threads", "1", "-c", "512", "-np", "1"]
    handle = run_container(local, lab.pull.docker_host, "rehearsal-c", lab.image_ref, argv, ContainerSettings(),
                           gpus=0, mounts=[f"{MODELS}:{MODELS}"], env={"LLAMA_ARG_BATCH": "64"}, log_path=log_path)
    try:
        assert handle.pid > 0 and _alive(handle.pid)
        lab.engine_pids.add(handle.pid)
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline:
            assert handle.poll() is None, log_path.read_text(errors="replace")[-2000:]
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
                if status == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        assert status == 200, log_path.read_text(errors="replace")[-2000:]
        info = json.loads(lab.pull.docker("inspect", handle.container_id).stdout)[0]
        assert info["Name"] == "/" + container_name("rehearsal-c")
        assert info["HostConfig"]["NetworkMode"] == "host"
        assert [(m["Source"], m["RW"]) for m in info["Mounts"]] == [(str(MODELS), False)]
        assert "LLAMA_ARG_BATCH=64" in info["Config"]["Env"]
        assert "LLAMA_ARG_BATCH" in handle.argv and "LLAMA_ARG_BATCH=64" not in handle.argv  # no value on argv
        assert info["Config"]["Labels"]["lanebench.lane"] == "rehearsal-c"
        time.sleep(0.5)
        assert "target-f16.gguf" in log_path.read_text(errors="replace")  # the engine's log reached the file
    finally:
        handle.stop(grace_s=5)
    assert handle.poll() is not None
    assert handle.logs.poll() is not None
    gone = lab.pull.docker("ps", "-a", "--filter", "label=lanebench.lane", "--format", "{{.Names}}")
    assert gone.stdout.strip() == ""
    assert not _alive(handle.pid)
    handle.stop()  # idempotent
    assert no_llama_server_left(PORTS)


def test_remove_leftover_removes_a_stale_container_and_only_ours(lab: DockerLab, local: LocalTransport,
                                                                 tmp_path: Path) -> None:
    port = free_loopback_port(PORTS)
    # A crashed run: its container still serves (rpc-server: cheap), its handle is lost.
    stale = lab.pull.docker("run", "-d", "--name", container_name("crashed"), "--network", "host",
                            "--label", "lanebench.lane=crashed", "--entrypoint", "/rpc-server", lab.image_ref,
                            "-H", "127.0.0.1", "-p", str(port), "-t", "1")
    assert stale.returncode == 0, stale.stderr
    pid = int(lab.pull.docker("inspect", "--format", "{{.State.Pid}}", "lanebench-crashed").stdout)
    lab.engine_pids.add(pid)
    with pytest.raises(ContainerError, match="already in use|remove_leftover first"):
        run_container(local, lab.pull.docker_host, "crashed", lab.image_ref, ["--version"], ContainerSettings(),
                      gpus=0, mounts=[], env={}, log_path=tmp_path / "x.log")
    assert remove_leftover(local, lab.pull.docker_host, "crashed") is True
    assert remove_leftover(local, lab.pull.docker_host, "crashed") is False
    assert lab.pull.docker("ps", "-aq", "--filter", "name=lanebench-crashed").stdout.strip() == ""
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    # A container under a lane's name that lanebench did not label is not ours to remove.
    foreign = lab.pull.docker("create", "--name", container_name("foreign"), lab.image_ref)
    assert foreign.returncode == 0, foreign.stderr
    with pytest.raises(ContainerError, match="lanebench did not start it"):
        remove_leftover(local, lab.pull.docker_host, "foreign")
    assert lab.pull.docker("rm", "-f", "lanebench-foreign").returncode == 0


def test_names_and_values_reaching_docker_are_checked(lab: DockerLab, local: LocalTransport, tmp_path: Path) -> None:
    bad: list[dict] = [{"name": "a b"}, {"image_ref": lab.image_ref.split("@")[0] + ":latest"},
                       {"argv": ["--x", "$(id)"]}, {"mounts": ["relative:/models"]}, {"env": {"lower": "1"}}]
    for override in bad:
        kwargs = {"name": "ok", "image_ref": lab.image_ref, "argv": ["--version"], "mounts": [], "env": {}} | override
        with pytest.raises(ValueError):
            run_container(local, lab.pull.docker_host, kwargs["name"], kwargs["image_ref"], kwargs["argv"],
                          ContainerSettings(), gpus=0, mounts=kwargs["mounts"], env=kwargs["env"],
                          log_path=tmp_path / "x.log")
    with pytest.raises(ValueError):
        pull_by_digest(local, lab.pull.docker_host, lab.image_ref.split("@")[0] + ":latest")
    assert lab.pull.docker("ps", "-aq").stdout.strip() == ""


def test_a_dockerd_in_a_network_namespace_runs_containers_there(lab: DockerLab) -> None:
    """The lab's hosts are network namespaces: their dockerd must run (cgroups visible) and its
    host-network containers listen inside the namespace, not here."""
    netns = f"lbt-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
        inside = lab.dockerd("n", netns=netns)
        saved = subprocess.run(["docker", "--host", lab.build.docker_host, "save", lab.image_ref], capture_output=True,
                               check=True).stdout
        loaded = subprocess.run(["docker", "--host", inside.docker_host, "load", "-q"], input=saved,
                                capture_output=True, check=True).stdout.decode()
        image_id = loaded.strip().split()[-1]
        port = free_loopback_port(PORTS)
        run = inside.docker("run", "-d", "--network", "host", "--entrypoint", "/rpc-server", image_id,
                            "-H", "127.0.0.1", "-p", str(port))
        assert run.returncode == 0, run.stderr
        lab.engine_pids.add(int(inside.docker("inspect", "--format", "{{.State.Pid}}", run.stdout.strip()).stdout))
        probe = f"import socket,time; time.sleep(1); socket.create_connection(('127.0.0.1', {port}), 2)"
        assert subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", probe], check=False).returncode == 0
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), 2)
        inside.stop()
        assert not _alive(inside.pid)
    finally:
        for daemon in lab.daemons:
            if daemon.name == "dockerd[n]":
                daemon.stop()
        subprocess.run(["ip", "netns", "del", netns], check=False)


def test_stopping_the_lab_leaves_no_container_daemon_or_mount(lab: DockerLab) -> None:
    port = free_loopback_port(PORTS)
    # A container still running when its dockerd stops must not outlive it.
    running = lab.build.docker("run", "-d", "--name", "lanebench-left-running", "--network", "host",
                               "--entrypoint", "/rpc-server", lab.image_ref, "-H", "127.0.0.1", "-p", str(port))
    assert running.returncode == 0, running.stderr
    lab.engine_pids.add(int(lab.build.docker("inspect", "--format", "{{.State.Pid}}", "lanebench-left-running").stdout))
    lab.stop()
    lab.stop()  # idempotent
    assert lab.leftovers() == []
    assert not [pid for pid in lab.engine_pids if _alive(pid)]
    assert no_llama_server_left(PORTS)
