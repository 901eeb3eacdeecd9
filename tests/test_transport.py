"""The transports against the real thing: an OpenSSH server on loopback (lab/sshd.py), real
subprocesses, real dropped connections. No mocks: each test fails if the behaviour is missing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.sshd import Sshd, kill_sessions, make_keypair, start_sshd
from tasks.inventory.models import Host
from tasks.hosts.ssh import SSHTransport
from tasks.hosts.transport import (
    CommandTimeout,
    HostKeyError,
    LocalTransport,
    TransportError,
    local_pidfile,
)
from tasks.hosts.connect import transport_for

ODD_ARGS = ["a b", "it's", 'say "hi"', "$(touch {canary})", "`touch {canary}`", "; touch {canary}", "*",
            "$HOME", "tab\there", "new\nline", "", "-n", "back\\slash", "ünïcode"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def procs_with(token: str, exact: bool = False) -> list[int]:
    """Pids on this machine whose command line contains (or is) `token` (the sshd runs here too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if (cmdline.strip() == token) if exact else (token in cmdline):
                found.append(int(entry.name))
    return found


def wait_gone(token: str, seconds: float = 3.0) -> list[int]:
    end = time.monotonic() + seconds
    while (left := procs_with(token)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def kill_token(token: str) -> None:
    for pid in procs_with(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def group_alive(pgid: int, settle_s: float = 2.0) -> bool:
    """Whether a process group still exists, allowing `settle_s` for killed members to be reaped."""
    end = time.monotonic() + settle_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() >= end:
            return True
        time.sleep(0.05)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    make_keypair(d / "id_ed25519", comment="lanebench-test")
    (d / "authorized_keys").write_text((d / "id_ed25519.pub").read_text())
    return {"identity": d / "id_ed25519", "authorized_keys": d / "authorized_keys"}


class Sshds:
    """sshd servers a test started; all stopped at teardown, whatever happened."""

    def __init__(self, root: Path, keys: dict[str, Path]) -> None:
        self.root, self.keys, self.started = root, keys, []

    def start(self, name: str = "sshd", port: int | None = None) -> Sshd:
        s = start_sshd(self.root / name, "127.0.0.1", port or free_port(), self.keys["authorized_keys"])
        self.started.append(s)
        return s

    def stop_all(self) -> None:
        for s in self.started:
            s.stop()


@pytest.fixture(scope="module")
def shared_sshd(tmp_path_factory, keys) -> Iterator[Sshd]:
    servers = Sshds(tmp_path_factory.mktemp("sshd"), keys)
    try:
        yield servers.start()
    finally:
        servers.stop_all()


@pytest.fixture
def sshds(tmp_path, keys) -> Iterator[Sshds]:
    """For tests that kill or restart their server."""
    servers = Sshds(tmp_path, keys)
    try:
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture
def make_ssh(tmp_path, keys) -> Iterator:
    made: list[SSHTransport] = []

    def make(sshd: Sshd, *, known_hosts: Path | None = None, trusted: bool = True, **kw) -> SSHTransport:
        kh = known_hosts or tmp_path / f"known_hosts_{len(made)}"
        if trusted and not kh.exists():
            kh.write_text(sshd.known_hosts_line() + "\n")
        t = SSHTransport("box", sshd.address, port=sshd.port, user="root", identity_file=keys["identity"],
                         known_hosts=kh, **kw)
        made.append(t)
        return t

    try:
        yield make
    finally:
        for t in made:
            for spawned in list(t._spawns):
                try:
                    spawned.stop(grace_s=0.5)
                except TransportError:
                    pass
            t.close()


@pytest.fixture
def token() -> Iterator[str]:
    """A unique marker for the processes a test starts; anything left with it is killed."""
    tok = f"31.{uuid.uuid4().int % 10**6:06d}"
    yield tok
    kill_token(tok)


# -- 1. commands, exit codes, output, quoting -----------------------------------------------------

def test_ssh_run_returns_exit_code_output_and_passes_argv_literally(shared_sshd, make_ssh, tmp_path):
    ssh = make_ssh(shared_sshd)
    canary = tmp_path / "canary"
    args = [a.format(canary=canary) for a in ODD_ARGS]
    r = ssh.run(["printf", "[%s]", *args])
    assert r.exit_code == 0, r
    assert r.stdout == "".join(f"[{a}]" for a in args)
    assert not canary.exists(), "an argument was interpreted by the remote shell"

    r = ssh.run(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (r.exit_code, r.stdout, r.stderr, r.attempts) == (7, "out\n", "err\n", 1)
    assert ssh.run(["cat"], stdin=b"fed through stdin").stdout == "fed through stdin"
    assert ssh.run(["no-such-binary-lanebench"]).exit_code == 127


def test_ssh_run_streams_output_as_it_comes(shared_sshd, make_ssh):
    ssh = make_ssh(shared_sshd)
    seen: list[tuple[float, str]] = []
    r = ssh.run(["sh", "-c", "echo first; sleep 1.5; echo second >&2"],
                on_output=lambda s: seen.append((time.monotonic(), s)))
    done = time.monotonic()
    assert r.stdout == "first\n" and r.stderr == "second\n"
    assert seen[0][1] == "first\n" and done - seen[0][0] > 0.7, "output only arrived at the end"


# -- 2. host keys ------------------------------------------------------------------------------------

def _refused_connections(sshd: Sshd, before: int | None = None) -> int:
    """How many connections sshd saw end before authentication (once `before` + 1 are logged)."""
    end = time.monotonic() + 3
    while (n := sshd.log().count("[preauth]")) <= (before if before is not None else -1) and time.monotonic() < end:
        time.sleep(0.05)
    return n


def _fingerprint(sshd: Sshd) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(sshd.state_dir / "ssh_host_ed25519_key.pub")],
                         capture_output=True, text=True, check=True).stdout
    return out.split()[1]  # "256 SHA256:... comment (ED25519)"


def test_unknown_host_key_is_refused_with_fingerprint_and_fix(shared_sshd, make_ssh, tmp_path):
    kh = tmp_path / "known_hosts"
    ssh = make_ssh(shared_sshd, known_hosts=kh, trusted=False)
    refused = _refused_connections(shared_sshd)
    with pytest.raises(HostKeyError) as err:
        ssh.run(["true"], idempotent=True)
    assert _refused_connections(shared_sshd, refused) == refused + 1, "a host key refusal was retried"
    msg = str(err.value)
    for part in ("box", f"127.0.0.1:{shared_sshd.port}", "ssh-ed25519", _fingerprint(shared_sshd),
                 f"ssh-keyscan -p {shared_sshd.port} 127.0.0.1 >> {kh}", "trust_on_first_use: true"):
        assert part in msg, (part, msg)
    assert not kh.exists(), "an unknown key was recorded without trust_on_first_use"

    # Following the advice works: ssh-keyscan's `[addr]:port` line is honoured, hashed or not.
    scan = subprocess.run(["ssh-keyscan", "-t", "ed25519", "-p", str(shared_sshd.port), "127.0.0.1"],
                          capture_output=True, text=True, timeout=30)
    kh.write_text(scan.stdout)
    assert ssh.run(["true"]).exit_code == 0
    subprocess.run(["ssh-keygen", "-H", "-f", str(kh)], capture_output=True, check=True)
    assert "|1|" in kh.read_text()
    assert make_ssh(shared_sshd, known_hosts=kh).run(["true"]).exit_code == 0


def test_changed_host_key_is_refused_even_with_tofu(shared_sshd, make_ssh, tmp_path):
    other = make_keypair(tmp_path / "other_host_key")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{shared_sshd.port} {' '.join(other.split()[:2])}\n")
    before = kh.read_text()
    recorded_fp = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "other_host_key.pub")],
                                 capture_output=True, text=True, check=True).stdout.split()[1]
    ssh = make_ssh(shared_sshd, known_hosts=kh, trust_on_first_use=True)
    refused = _refused_connections(shared_sshd)
    with pytest.raises(HostKeyError) as err:
        ssh.run(["true"], idempotent=True)
    msg = str(err.value)
    assert "CHANGED" in msg and recorded_fp in msg and _fingerprint(shared_sshd) in msg, msg
    assert _refused_connections(shared_sshd, refused) == refused + 1, "a host key refusal was retried"
    assert kh.read_text() == before


def test_tofu_accepts_an_unknown_key_and_records_it(shared_sshd, make_ssh, tmp_path):
    kh = tmp_path / "sub" / "known_hosts"
    ssh = make_ssh(shared_sshd, known_hosts=kh, trusted=False, trust_on_first_use=True)
    assert ssh.run(["true"]).exit_code == 0
    assert kh.read_text() == shared_sshd.known_hosts_line() + "\n"
    # recorded once: a strict client now trusts it
    assert make_ssh(shared_sshd, known_hosts=kh).run(["true"]).exit_code == 0
    assert kh.read_text().count("\n") == 1


# -- 3. deadlines ------------------------------------------------------------------------------------

def test_ssh_deadline_kills_the_remote_command(shared_sshd, make_ssh, token):
    ssh = make_ssh(shared_sshd)
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout) as err:
        ssh.run(["sh", "-c", f"sleep {token} & sleep {token}; wait"], deadline_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert "was killed" in str(err.value)
    assert wait_gone(token) == [], "the remote command outlived its deadline"
    assert ssh.run(["true"]).exit_code == 0  # the connection is still usable


# -- 4. dropped connections ---------------------------------------------------------------------------

def _drop_after(sshd: Sshd, seconds: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), kill_sessions(sshd.pid)), daemon=True)
    t.start()
    return t


def test_idempotent_command_is_rerun_after_a_dropped_connection(sshds, make_ssh, tmp_path, token):
    sshd = sshds.start()
    ssh = make_ssh(sshd)
    counter = tmp_path / "runs"
    assert ssh.run(["true"]).exit_code == 0  # connected before the fault
    dropper = _drop_after(sshd, 0.8)
    r = ssh.run(["sh", "-c", 'echo run >> "$1"; sleep 1.5; echo done', "sh", str(counter)], idempotent=True)
    dropper.join()
    assert (r.exit_code, r.stdout, r.attempts) == (0, "done\n", 2)
    assert counter.read_text() == "run\nrun\n"


def test_non_idempotent_command_is_not_rerun_after_a_dropped_connection(sshds, make_ssh, tmp_path):
    sshd = sshds.start()
    ssh = make_ssh(sshd)
    counter = tmp_path / "runs"
    assert ssh.run(["true"]).exit_code == 0
    dropper = _drop_after(sshd, 0.8)
    with pytest.raises(TransportError) as err:
        ssh.run(["sh", "-c", 'echo run >> "$1"; sleep 1.5', "sh", str(counter)])
    dropper.join()
    assert not isinstance(err.value, CommandTimeout)
    assert "not re-run" in str(err.value) and "idempotent" in str(err.value)
    time.sleep(2.5)  # a hidden retry would have written by now
    assert counter.read_text() == "run\n"
    assert ssh.run(["true"]).exit_code == 0  # the transport reconnects for the next command


def test_connecting_is_retried_while_sshd_restarts(sshds, make_ssh, tmp_path):
    sshd = sshds.start("restart")
    ssh = make_ssh(sshd)
    assert ssh.run(["true"]).exit_code == 0
    sshd.stop()
    restart = threading.Thread(target=lambda: (time.sleep(0.3), sshds.start("restart", port=sshd.port)), daemon=True)
    restart.start()
    # Not idempotent, yet safe to retry: nothing had started while the connection was being opened.
    # The end state, not the attempt count (which depends on when sshd is back): it ran, once.
    ran = tmp_path / "ran"
    r = ssh.run(["sh", "-c", 'echo x >> "$1"; echo back', "sh", str(ran)])
    restart.join()
    assert (r.exit_code, r.stdout) == (0, "back\n") and r.attempts >= 1
    assert ran.read_text() == "x\n"  # the command ran exactly once, however many connections it took


def test_unreachable_host_fails_cleanly_after_retries(sshds, make_ssh):
    sshd = sshds.start()
    ssh = make_ssh(sshd)
    sshd.stop()
    t0 = time.monotonic()
    with pytest.raises(TransportError) as err:
        ssh.run(["true"], idempotent=True)
    assert "after 3 attempts" in str(err.value) and "ConnectionRefused" in str(err.value)
    assert time.monotonic() - t0 >= 1.5  # backed off 0.5 s then 1 s


# -- 5. spawn, poll, stop, leftovers ------------------------------------------------------------------

def test_ssh_spawn_poll_stop(shared_sshd, make_ssh, tmp_path, token):
    ssh = make_ssh(shared_sshd)
    name = f"test-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "logs" / "server.log"
    env_value = "two words $(touch nope) 'q'"
    # Ignores SIGTERM, so stop must escalate to SIGKILL after the grace period.
    script = f'trap "" TERM; echo "ready $LB_VALUE"; echo to-stderr >&2; while :; do sleep {token}; done'
    spawned = ssh.spawn(["sh", "-c", script], log, name=name, env={"LB_VALUE": env_value})
    pidfile = Path.home() / ".cache/lanebench/run" / f"{name}.pid"
    assert spawned.poll() is None
    assert pidfile.read_text().strip() == str(spawned.pid)
    assert group_alive(spawned.pid, settle_s=0) and procs_with(token)
    end = time.monotonic() + 5
    while "to-stderr" not in log.read_text() and time.monotonic() < end:
        time.sleep(0.05)
    assert f"ready {env_value}\n" in log.read_text() and "to-stderr" in log.read_text()

    t0 = time.monotonic()
    spawned.stop(grace_s=1.0)
    assert time.monotonic() - t0 >= 1.0, "a process ignoring SIGTERM was not given its grace period"
    assert wait_gone(token) == [] and not group_alive(spawned.pid)
    assert spawned.poll() is not None
    assert not pidfile.exists()
    spawned.stop()  # idempotent


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_stopped_group_is_stopped_without_waiting_out_the_grace(where, shared_sshd, make_ssh, tmp_path, token):
    """A server SIGSTOPped (hung, or stopped by hand) holds SIGTERM until it is continued: stop
    continues it, so it ends on SIGTERM at once rather than after the whole grace and a SIGKILL."""
    transport = LocalTransport() if where == "local" else make_ssh(shared_sshd)
    spawned = transport.spawn(["sh", "-c", f"sleep {token} & sleep {token}; wait"], tmp_path / "s.log",
                              name=f"test-{uuid.uuid4().hex[:8]}")
    end = time.monotonic() + 5
    while len(procs_with(f"sleep {token}", exact=True)) < 2 and time.monotonic() < end:
        time.sleep(0.05)
    os.killpg(spawned.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    spawned.stop(grace_s=30.0)
    assert time.monotonic() - t0 < 10.0, "the stopped group waited out its grace"
    assert wait_gone(token) == [] and not group_alive(spawned.pid)


def test_ssh_spawn_reports_its_exit_code(shared_sshd, make_ssh, tmp_path):
    ssh = make_ssh(shared_sshd)
    spawned = ssh.spawn(["sh", "-c", "echo bye; exit 4"], tmp_path / "s.log", name=f"test-{uuid.uuid4().hex[:8]}")
    end = time.monotonic() + 5
    while spawned.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    assert spawned.poll() == 4
    assert (tmp_path / "s.log").read_text() == "bye\n"
    spawned.stop()


def test_ssh_stop_leftover_kills_a_crashed_runs_group(shared_sshd, make_ssh, tmp_path, token):
    name = f"test-{uuid.uuid4().hex[:8]}"
    crashed = make_ssh(shared_sshd)
    spawned = crashed.spawn(["sh", "-c", f"sleep {token} & sleep {token}; wait"], tmp_path / "s.log", name=name)
    pgid = spawned.pid
    crashed.close()  # the run dies: its connection goes, the server stays
    time.sleep(0.3)
    assert group_alive(pgid, settle_s=0) and len(procs_with(f"sleep {token}", exact=True)) == 2

    fresh = make_ssh(shared_sshd)
    assert fresh.stop_leftover(name) is True
    assert wait_gone(token) == [] and not group_alive(pgid)
    assert not (Path.home() / ".cache/lanebench/run" / f"{name}.pid").exists()
    assert fresh.stop_leftover(name) is False
    spawned.stop()  # the stale handle finds nothing left


def test_ssh_spawn_survives_a_dropped_connection_and_stops_over_a_fresh_one(sshds, make_ssh, tmp_path, token):
    sshd = sshds.start()
    ssh = make_ssh(sshd)
    spawned = ssh.spawn(["sh", "-c", f"while :; do sleep {token}; done"], tmp_path / "s.log",
                        name=f"test-{uuid.uuid4().hex[:8]}")
    assert kill_sessions(sshd.pid) >= 1  # every session, as a pulled cable drops them
    end = time.monotonic() + 5
    while not spawned._chan.closed and time.monotonic() < end:
        time.sleep(0.05)
    assert spawned._chan.closed
    assert spawned.poll() is None  # asked the host over a new connection: still running
    spawned.stop(grace_s=1.0)
    assert wait_gone(token) == [] and not group_alive(spawned.pid)


def test_ssh_env_values_never_reach_a_command_line(shared_sshd, make_ssh, tmp_path, token):
    """A secret in `env` (a lane's HF_TOKEN) reaches the remote process's environment, never an
    argv: not the server's, not the wrapper shell's, not any process on the host (`ps` shows argv
    to every user, and sshd may log the command)."""
    ssh = make_ssh(shared_sshd)
    secret = f"hf_{uuid.uuid4().hex}"
    value = f"{secret} two words $(touch nope) 'q'"
    log = tmp_path / "server.log"
    spawned = ssh.spawn(["sh", "-c", f'echo "ready $LB_TOKEN"; while :; do sleep {token}; done'], log,
                        name=f"test-{uuid.uuid4().hex[:8]}", env={"LB_TOKEN": value, "LB_PLAIN": "x"})
    try:
        end = time.monotonic() + 5
        while "ready" not in log.read_text() and time.monotonic() < end:
            time.sleep(0.05)
        assert log.read_text() == f"ready {value}\n"  # the process got the value, whole
        members = [p for p in procs_with(token) if os.getpgid(p) == spawned.pid]
        assert members, "no process of the spawned group found"
        server = [p for p in members if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"sh\0-c\0echo")]
        environ = Path(f"/proc/{server[0]}/environ").read_bytes().split(b"\0")  # the wrapper's child
        assert f"LB_TOKEN={value}".encode() in environ
        assert procs_with(secret) == [], "the secret is on a command line on the host"
        assert secret not in spawned.argv and secret not in shared_sshd.log()
    finally:
        spawned.stop(grace_s=1.0)

    seen: list[list[int]] = []
    r = ssh.run(["sh", "-c", 'echo started; sleep 1; printf "%s|" "$LB_TOKEN"; cat'], env={"LB_TOKEN": value},
                stdin=b"stdin after the environment", on_output=lambda s: seen.append(procs_with(secret)))
    assert r.exit_code == 0 and r.stdout == f"started\n{value}|stdin after the environment", r
    assert seen and seen[0] == [], "the secret is on a command line while `run` runs"
    with pytest.raises(ValueError):
        ssh.run(["true"], env={"LB_TOKEN": "two\nlines"})


def test_spawn_rejects_unsafe_names_and_env_keys(shared_sshd, make_ssh, tmp_path):
    ssh = make_ssh(shared_sshd)
    with pytest.raises(ValueError):
        ssh.spawn(["true"], tmp_path / "x.log", name="../etc/passwd")
    with pytest.raises(ValueError):
        ssh.spawn(["true"], tmp_path / "x.log", name="ok", env={"A;B": "1"})


# -- 6. local transport ------------------------------------------------------------------------------

def test_local_run_exit_code_output_quoting_stdin(tmp_path):
    local = LocalTransport()
    canary = tmp_path / "canary"
    args = [a.format(canary=canary) for a in ODD_ARGS]
    r = local.run(["printf", "[%s]", *args])
    assert r.stdout == "".join(f"[{a}]" for a in args) and not canary.exists()
    r = local.run(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (r.exit_code, r.stdout, r.stderr) == (7, "out\n", "err\n")
    assert local.run(["cat"], stdin=b"in").stdout == "in"
    assert local.run(["no-such-binary-lanebench"]).exit_code == 127


def test_local_deadline_kills_the_process_group(token):
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout):
        LocalTransport().run(["sh", "-c", f"sleep {token} & sleep {token}; wait"], deadline_s=1.0)
    assert time.monotonic() - t0 < 4.0
    assert wait_gone(token) == []


def test_local_spawn_poll_stop_and_leftover(tmp_path, token):
    local = LocalTransport()
    name = f"test-{uuid.uuid4().hex[:8]}"
    spawned = local.spawn(["sh", "-c", f'echo "v=$LB_V"; sleep {token} & sleep {token}; wait'], tmp_path / "l.log",
                          name=name, env={"LB_V": "a b"})
    assert spawned.poll() is None and local_pidfile(name).read_text().split()[0] == str(spawned.pid)
    end = time.monotonic() + 5
    while len(procs_with(f"sleep {token}", exact=True)) < 2 and time.monotonic() < end:
        time.sleep(0.05)
    spawned.stop(grace_s=2.0)
    assert spawned.poll() is not None and wait_gone(token) == [] and not local_pidfile(name).exists()
    assert "v=a b" in (tmp_path / "l.log").read_text()

    # A crashed run's leftover: a process group recorded in the pidfile, not ours.
    leftover = subprocess.Popen(["sh", "-c", f"sleep {token} & sleep {token}; wait"], start_new_session=True)
    try:
        local_pidfile(name).write_text(f"{leftover.pid}\n")
        assert local.stop_leftover(name, grace_s=1.0) is True
        assert wait_gone(token) == [] and not local_pidfile(name).exists()
        assert local.stop_leftover(name) is False
    finally:
        leftover.kill()
        leftover.wait()


def test_a_live_lanebenchs_server_is_not_reclaimed_as_a_leftover(tmp_path, token):
    """Two orchestrators with separate Prefect homes share no host lock: the pidfile names who
    spawned the group, and only a dead owner's group is stopped."""
    from tasks.hosts.owner import Owner

    local, name = LocalTransport(), f"test-{uuid.uuid4().hex[:8]}"
    group = subprocess.Popen(["sh", "-c", f"sleep {token} & sleep {token}; wait"], start_new_session=True)
    try:
        owner = Owner.here()  # this test process: alive
        local_pidfile(name).write_text(f"{group.pid}\n{owner.model_dump_json()}\n")
        assert local.stop_leftover(name, grace_s=1.0) is False
        assert group.poll() is None and local_pidfile(name).exists()
        gone = owner.model_copy(update={"start": "1"})  # the same pid, another start time: a dead owner
        local_pidfile(name).write_text(f"{group.pid}\n{gone.model_dump_json()}\n")
        assert local.stop_leftover(name, grace_s=1.0) is True
        assert wait_gone(token) == [] and not local_pidfile(name).exists()
    finally:
        group.kill()
        group.wait()


def test_transport_for_builds_the_configured_transport(tmp_path):
    assert isinstance(transport_for("here", Host(), tmp_path), LocalTransport)
    host = Host(address="10.0.0.7", transport="ssh", user="bench", port=2222, identity_file="keys/id",
                known_hosts="~/kh", trust_on_first_use=True, keepalive_s=5, connect_timeout_s=3)
    t = transport_for("spark1", host, tmp_path)
    assert isinstance(t, SSHTransport)
    assert (t.host_name, t.address, t.port, t.user) == ("spark1", "10.0.0.7", 2222, "bench")
    assert t.identity_file == tmp_path / "keys" / "id"
    assert t.known_hosts == Path.home() / "kh"
    assert (t.trust_on_first_use, t.keepalive_s, t.connect_timeout_s) == (True, 5, 3)


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_spawn_knows_whether_the_listener_on_its_port_is_its_own(where, shared_sshd, make_ssh, tmp_path):
    """Boot's impostor check (tasks/hosts/listener.py): the listening socket's owner read from the
    host's /proc, here or over SSH; a server started through a wrapper is still in the group."""
    transport = make_ssh(shared_sshd) if where == "ssh" else LocalTransport()
    port, other = (18648, 18649) if where == "ssh" else (18646, 18645)
    serve = f"import http.server as h; h.HTTPServer(('127.0.0.1', {{}}), h.BaseHTTPRequestHandler).serve_forever()"
    spawned = transport.spawn(["sh", "-c", f'{sys.executable} -c "{serve.format(port)}"'], tmp_path / "s.log",
                              name=f"test-{uuid.uuid4().hex[:8]}")
    impostor = subprocess.Popen([sys.executable, "-c", serve.format(other)], start_new_session=True)
    try:
        end = time.monotonic() + 10
        while (found := spawned.listeners(port)).sockets == 0 and time.monotonic() < end:
            time.sleep(0.1)
        assert found.sockets == 1 and spawned.owns(found), found
        while (theirs := spawned.listeners(other)).sockets == 0 and time.monotonic() < end:
            time.sleep(0.1)
        assert theirs.sockets == 1 and not spawned.owns(theirs) and theirs.owners[0].pid == impostor.pid, theirs
        assert "python" in theirs.describe()
        assert spawned.listeners(18644).sockets == 0  # nothing listens there
    finally:
        impostor.kill()
        impostor.wait()
        spawned.stop(grace_s=1.0)
