"""The SSH transport (contract in tasks/hosts/transport.py): commands and servers on a host over paramiko.
Long because one class implements the whole contract (run, spawn, stop, copy, host keys).

- Key authentication only, no agent, no password: a run must not depend on who is logged in, nor prompt.
- The host key is checked against a known_hosts file: an unknown key is refused with its
  fingerprint and the command that trusts it; a changed key is refused even with trust-on-first-use.
- A remote command runs as `setsid -w sh -c WRAPPER sh ARGV...` (`shlex.join`ed): the wrapper
  reports its pid (= process group) first, so a command past its deadline, or a server being
  stopped, is killed as a whole group from a fresh channel.
- Env values never ride on the command line (`ps`, sshd's logs): `NAME=value` lines on stdin, up
  to an empty line, exported by the wrapper (`_READ_ENV`). paramiko's `environment=` would need
  `AcceptEnv` in every host's sshd_config.
- After a dropped connection a command's fate is unknown: re-run only when declared idempotent.
  Opening the connection (nothing has run yet) is always retried.
"""

from __future__ import annotations

import atexit
import getpass
import os
import select
import shlex
import socket
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko
from tenacity import Retrying

from tasks.hosts.retry import Faults, retrying
from tasks.hosts.transport import (
    PIDFILE_DIR,
    CommandResult,
    CommandTimeout,
    HostKeyError,
    OutputCallback,
    Spawned,
    StreamText,
    Transport,
    TransportError,
    check_env,
    check_spawn_name,
    resolve_path,
)

if TYPE_CHECKING:
    from tasks.inventory.models import Host

_MARK = b"lanebench-pgid "
# Prefixed to a wrapper when the command has an environment: export the `NAME=value` lines read
# from stdin up to an empty line. `read` takes a pipe byte by byte, so the command's own stdin
# (sent after the block) is left whole.
_READ_ENV = 'while IFS= read -r kv && [ -n "$kv" ]; do export "$kv"; done; '
# Run "$@" as a child (not exec), and outlive a group-wide SIGTERM (the no-op trap resets to the
# default in the child), so the exit code is the child's own, 128+N when a signal killed it
# (paramiko ignores SSH's exit-signal message).
_RUN_WRAPPER = 'trap : TERM INT HUP; echo "lanebench-pgid $$" >&2; "$@"; exit $?'
# $1 = spawn name: record the group in the pidfile, report it on the (combined) output, run the rest.
_SPAWN_WRAPPER = ('trap : TERM INT HUP; d="$HOME/' + PIDFILE_DIR.removeprefix("~/") + '"; mkdir -p "$d" && '
                  'echo $$ > "$d/$1.pid" || exit 125; echo "lanebench-pgid $$"; shift; "$@"; exit $?')
# $1 = pgid (or empty: read it from the pidfile), $2 = grace in tenths of a second, $3 = spawn name or empty.
# Exit 0: a group was running and is stopped; 3: nothing was running. The pidfile is removed only
# while it still names this group (a newer spawn may have taken the name).
_STOP_SCRIPT = r'''
g=$1; n=$2; f=
[ -n "$3" ] && f="$HOME/''' + PIDFILE_DIR.removeprefix("~/") + r'''/$3.pid"
cur=
[ -n "$f" ] && [ -f "$f" ] && read -r cur < "$f"
[ -z "$g" ] && g=$cur
unrecord() { [ -n "$f" ] && [ "$cur" = "$g" ] && rm -f "$f"; return 0; }
case "$g" in ''|*[!0-9]*) exit 3;; esac
[ "$g" -gt 1 ] || exit 3
kill -0 -"$g" 2>/dev/null || { unrecord; exit 3; }
kill -TERM -"$g" 2>/dev/null
kill -CONT -"$g" 2>/dev/null  # a stopped (SIGSTOP) group acts on SIGTERM only once continued
i=0
while kill -0 -"$g" 2>/dev/null; do
  [ "$i" -eq "$n" ] && kill -KILL -"$g" 2>/dev/null
  [ "$i" -ge $((n + 50)) ] && break  # killed 5 s ago and still listed: zombies not reaped yet
  sleep 0.1; i=$((i+1))
done
unrecord
exit 0
'''

_CONNECTION_FAULTS = (paramiko.SSHException, OSError, EOFError)
_RSA_ALGORITHMS = ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"]  # the host-key algorithms of a known_hosts `ssh-rsa` key


class _Dropped(TransportError):
    """The connection broke after the command may have started."""


class _NotStarted(TransportError):
    """The connection broke before the command was sent (safe to retry)."""


def host_key_name(address: str, port: int) -> str:
    """How known_hosts names a host: the bare address on port 22, `[address]:port` otherwise."""
    return address if port == 22 else f"[{address}]:{port}"


def _wrap(wrapper: str, argv: list[str], env: dict[str, str] | None = None) -> str:
    """The remote command line: the wrapper and argv, never an environment value."""
    wrapper = _READ_ENV + wrapper if env else wrapper
    return f"exec setsid -w sh -c {shlex.quote(wrapper)} sh {shlex.join(argv)}"


def _env_block(env: dict[str, str] | None) -> bytes:
    """What `_READ_ENV` reads first on stdin (values checked by `check_env`: no newline)."""
    return "".join(f"{k}={v}\n" for k, v in check_env(env).items()).encode() + b"\n" if env else b""


class _FirstLine:
    """Takes the wrapper's `lanebench-pgid N` line off the front of a stream, passes the rest on."""

    def __init__(self, out: Callable[[bytes], None]) -> None:
        self.pgid: int | None = None
        self.done = False
        self.head = b""  # what came before the pid line was complete (or all of it, when none came)
        self._out = out

    def feed(self, data: bytes) -> None:
        if self.done:
            self._out(data)
            return
        self.head += data
        if b"\n" in self.head or len(self.head) >= 64:
            self.flush()

    def flush(self) -> None:
        if self.done:
            return
        self.done = True
        line, newline, rest = self.head.partition(b"\n")
        if newline and line.startswith(_MARK) and line[len(_MARK):].strip().isdigit():
            self.pgid = int(line[len(_MARK):])
        else:
            rest = self.head
        if rest:
            self._out(rest)


class SSHSpawned(Spawned):
    """A remote server started by `SSHTransport.spawn`; its output is copied into a local log."""

    transport: SSHTransport

    def __init__(self, transport: SSHTransport, chan: paramiko.Channel, argv: list[str], name: str,
                 log_path: Path) -> None:
        self.argv, self.name, self.log_path = argv, name, log_path
        self.pid = 0
        self.transport, self._chan = transport, chan
        self._exit: int | None = None
        self._stopped = False
        self._started = threading.Event()
        self._first = _FirstLine(self._write)
        self._reader = threading.Thread(target=self._copy_output, name=f"ssh-log-{name}", daemon=True)
        self._reader.start()

    def _write(self, data: bytes) -> None:
        self._log.write(data)
        self._log.flush()

    def _copy_output(self) -> None:
        with self.log_path.open("ab") as self._log:
            try:
                while data := self._chan.recv(65536):
                    self._first.feed(data)
                    if self._first.done and not self._started.is_set():
                        self.pid = self._first.pgid or 0
                        self._started.set()
            except _CONNECTION_FAULTS:
                pass
            finally:
                self._first.flush()
                self._started.set()

    def wait_started(self, timeout_s: float) -> None:
        if not self._started.wait(timeout_s) or not self.pid:
            head = self._first.head.decode(errors="replace").strip()[-2000:]
            self._chan.close()
            raise TransportError(f"{self.transport.host_name}: could not start {self.argv[0]} "
                                 f"(no pid reported within {timeout_s:g} s); output: {head or '(none)'}")

    def poll(self) -> int | None:
        """Exit code once it ended, else None. If the connection dropped, a fresh one asks the host
        (TransportError when it cannot be reached)."""
        if self._exit is not None:
            return self._exit
        if not self._chan.exit_status_ready():
            return None
        status = self._chan.recv_exit_status()
        if status != -1:
            # The exit status can arrive before the reader has copied the last output: let it
            # drain, so a caller reading the log on exit (a boot error's log tail) sees it all.
            self._reader.join(timeout=5.0)
            self._exit = status
            return status
        # The channel closed without an exit status: the connection dropped. Ask the host.
        if self.transport.run(["sh", "-c", 'kill -0 -"$1" 2>/dev/null', "sh", str(self.pid)], deadline_s=30.0,
                               idempotent=True).exit_code == 0:
            return None
        self._exit = 255  # gone while we were cut off: its own exit code is lost (255 as ssh says)
        return self._exit

    def stop(self, grace_s: float = 10.0) -> None:
        if self._stopped:
            return
        if self.pid:
            self.transport.stop_group(self.pid, grace_s, self.name)
        self._reader.join(timeout=5.0)
        self._chan.close()
        self._reader.join(timeout=1.0)
        self._stopped = True
        self.transport._spawns.discard(self)


class SSHTransport(Transport):
    """Commands on `user@address:port` over one paramiko connection, reopened when it drops."""

    def __init__(self, host_name: str, address: str, *, port: int = 22, user: str | None = None,
                 identity_file: Path | str = "~/.ssh/id_ed25519", known_hosts: Path | str = "~/.ssh/known_hosts",
                 trust_on_first_use: bool = False, keepalive_s: float = 15.0, connect_timeout_s: float = 10.0) -> None:
        self.host_name, self.address, self.port = host_name, address, port
        self.user = user or getpass.getuser()
        self.where = f"{self.user}@{address}:{port}"
        self.identity_file = Path(os.path.expanduser(identity_file))
        self.known_hosts = Path(os.path.expanduser(known_hosts))
        self.trust_on_first_use = trust_on_first_use
        self.keepalive_s, self.connect_timeout_s = keepalive_s, connect_timeout_s
        self.attempts = 3
        self._conn: paramiko.Transport | None = None
        self._lock = threading.RLock()
        self._spawns: set[SSHSpawned] = set()  # running spawns, stopped at exit if still running
        _TRANSPORTS.add(self)

    @classmethod
    def from_host(cls, host_name: str, host: Host, base_dir: Path) -> SSHTransport:
        return cls(host_name, host.address, port=host.port, user=host.user,
                   identity_file=resolve_path(host.identity_file, "~/.ssh/id_ed25519", base_dir),
                   known_hosts=resolve_path(host.known_hosts, "~/.ssh/known_hosts", base_dir),
                   trust_on_first_use=host.trust_on_first_use, keepalive_s=host.keepalive_s,
                   connect_timeout_s=host.connect_timeout_s)

    def _retrying(self, on: Faults) -> Retrying:
        return retrying(tries=self.attempts, wait_s=0.5, growth=2.0, on=on)  # 0.5 s, 1 s between

    # -- connection ---------------------------------------------------------------------------

    def _connection(self) -> paramiko.Transport:
        """The live connection, opened (with retries: nothing has run yet) when there is none."""
        with self._lock:
            if self._conn is not None and self._conn.is_active():
                return self._conn
            self._drop()
            key = self._load_key()
            try:
                self._conn = self._retrying(_CONNECTION_FAULTS)(self._open, key)
            except _CONNECTION_FAULTS as e:
                raise TransportError(f"{self.host_name}: cannot connect to {self.where} after {self.attempts} "
                                     f"attempts: {type(e).__name__}: {e}") from None
            return self._conn

    def _load_key(self) -> paramiko.PKey:
        try:
            return paramiko.PKey.from_path(self.identity_file)
        except FileNotFoundError:
            raise TransportError(f"{self.host_name}: identity file {self.identity_file} does not exist. Fix: "
                                 f"ssh-keygen -t ed25519 -N '' -f {self.identity_file}, then add the .pub "
                                 "to the host's authorized_keys (or set identity_file for this host)") from None
        except paramiko.PasswordRequiredException:
            raise TransportError(f"{self.host_name}: identity file {self.identity_file} is encrypted; lanebench "
                                 "uses keys without a passphrase and no agent: point identity_file at a "
                                 "dedicated key") from None
        except (paramiko.SSHException, ValueError, OSError) as e:
            raise TransportError(f"{self.host_name}: cannot read identity file {self.identity_file}: {e}") from None

    def _open(self, key: paramiko.PKey) -> paramiko.Transport:
        """One connection; a refused key or host key is a TransportError (never retried)."""
        sock = socket.create_connection((self.address, self.port), timeout=self.connect_timeout_s)
        conn = paramiko.Transport(sock)
        try:
            conn.banner_timeout = conn.handshake_timeout = conn.auth_timeout = self.connect_timeout_s
            known = self._known_keys()
            if known:  # ask for the key type we have on record, as OpenSSH does
                opts = conn.get_security_options()
                wanted = [t for k in known for t in (_RSA_ALGORITHMS if k == "ssh-rsa" else [k]) if t in opts.key_types]
                opts.key_types = wanted + [t for t in opts.key_types if t not in wanted]
            conn.start_client(timeout=self.connect_timeout_s)
            self._verify_host_key(conn.get_remote_server_key(), known)
            conn.set_keepalive(max(1, round(self.keepalive_s)))
            conn.auth_publickey(self.user, key)
            if not conn.is_authenticated():
                raise paramiko.AuthenticationException("further authentication required")
            return conn
        except BaseException as e:
            conn.close()
            if isinstance(e, paramiko.AuthenticationException):
                raise TransportError(
                    f"{self.host_name}: {self.where} refused key {self.identity_file} ({e}). Fix: add "
                    f"{self.identity_file}.pub to ~{self.user}/.ssh/authorized_keys on the host") from None
            raise

    def _known_keys(self) -> dict[str, paramiko.PKey]:
        """The keys the known_hosts file records for this host, by key type."""
        keys = paramiko.HostKeys()
        if self.known_hosts.exists():
            try:
                keys.load(str(self.known_hosts))
            except (paramiko.hostkeys.InvalidHostKey, OSError) as e:
                raise HostKeyError(f"{self.host_name}: cannot read known_hosts file {self.known_hosts}: {e}") from None
        found = keys.lookup(host_key_name(self.address, self.port))
        return dict(found.items()) if found else {}

    def _verify_host_key(self, key: paramiko.PKey, known: dict[str, paramiko.PKey]) -> None:
        name, kind, fp = host_key_name(self.address, self.port), key.get_name(), key.fingerprint
        if not known:
            if not self.trust_on_first_use:
                raise HostKeyError(
                    f"{self.host_name}: unknown host key for {self.address}:{self.port}: {kind} {fp} is not in "
                    f"{self.known_hosts}. Refused. Check that fingerprint on the host itself "
                    f"(ssh-keygen -lf /etc/ssh/ssh_host_{kind.removeprefix('ssh-')}_key.pub), then trust it with "
                    f"`ssh-keyscan -p {self.port} {self.address} >> {self.known_hosts}`, or set "
                    f"`trust_on_first_use: true` for host {self.host_name} to record it on first contact")
            self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with self.known_hosts.open("a") as f:
                f.write(f"{name} {kind} {key.get_base64()}\n")
            return
        if kind in known and known[kind].asbytes() == key.asbytes():
            return
        kind_on_record, recorded = (kind, known[kind]) if kind in known else next(iter(known.items()))
        raise HostKeyError(
            f"{self.host_name}: HOST KEY CHANGED for {self.address}:{self.port}: the server presents {kind} {fp}, "
            f"but {self.known_hosts} records {kind_on_record} {recorded.fingerprint} for {name}. Refused (also "
            "with trust_on_first_use): the host was reinstalled or someone is in between. If the change is "
            f"expected, check the new fingerprint on the host, then `ssh-keygen -R '{name}' -f {self.known_hosts}` "
            f"and add the new key (`ssh-keyscan -p {self.port} {self.address} >> {self.known_hosts}`)")

    def _drop(self, conn: paramiko.Transport | None = None) -> None:
        """Close and forget the connection (only `conn`, if given: another thread may have reopened it)."""
        with self._lock:
            if self._conn is not None and (conn is None or conn is self._conn):
                with suppress(Exception):  # already broken
                    self._conn.close()
                self._conn = None

    def _channel(self) -> tuple[paramiko.Transport, paramiko.Channel]:
        conn = self._connection()
        try:
            return conn, conn.open_session(timeout=self.connect_timeout_s)
        except _CONNECTION_FAULTS as e:
            self._drop(conn)
            raise _NotStarted(f"{type(e).__name__}: {e}") from None

    # -- commands -----------------------------------------------------------------------------

    def run(self, argv: list[str], *, deadline_s: float = 60.0, idempotent: bool = False,
            stdin: bytes | None = None, on_output: OutputCallback | None = None,
            env: dict[str, str] | None = None) -> CommandResult:
        """Run argv on the host; `deadline_s` bounds each attempt. Re-run after a dropped connection
        only when `idempotent`. `env` goes over stdin, ahead of `stdin`."""
        if not argv:
            raise ValueError("empty argv")
        env = check_env(env)
        t0 = time.monotonic()
        try:
            for attempt in self._retrying((_NotStarted, _Dropped) if idempotent else _NotStarted):
                with attempt:
                    result = self._run_once(argv, deadline_s, stdin, on_output, env)
        except (_NotStarted, _Dropped) as e:
            if isinstance(e, _Dropped) and not idempotent:
                raise TransportError(
                    f"{self.host_name}: the connection to {self.where} dropped while `{shlex.join(argv)}` was "
                    f"running ({e}); it was not re-run because it is not declared idempotent (its effect on "
                    "the host is unknown)") from None
            raise TransportError(f"{self.host_name}: the connection to {self.where} dropped on each of "
                                 f"{self.attempts} attempts of `{shlex.join(argv)}`: {e}") from None
        return result.model_copy(update={"attempts": attempt.retry_state.attempt_number,
                                         "seconds": time.monotonic() - t0})

    def _run_once(self, argv: list[str], deadline_s: float, stdin: bytes | None,
                  on_output: OutputCallback | None, env: dict[str, str] | None = None) -> CommandResult:
        conn, chan = self._channel()
        t0 = time.monotonic()
        out, err = StreamText(on_output), StreamText(on_output)
        head = _FirstLine(err.feed)
        try:
            try:
                chan.exec_command(_wrap(_RUN_WRAPPER, argv, env))
            except _CONNECTION_FAULTS as e:
                self._drop(conn)
                raise _NotStarted(f"{type(e).__name__}: {e}") from None
            if stdin or env:
                threading.Thread(target=_send_stdin, args=(chan, _env_block(env) + (stdin or b"")),
                                 daemon=True).start()
            else:
                chan.shutdown_write()
            end = t0 + deadline_s
            while True:
                busy = False
                if chan.recv_ready():
                    out.feed(chan.recv(65536))
                    busy = True
                if chan.recv_stderr_ready():
                    head.feed(chan.recv_stderr(65536))
                    busy = True
                if not busy and chan.exit_status_ready():
                    break
                if time.monotonic() > end:
                    chan.close()
                    killed = self._kill_after_timeout(head.pgid)
                    raise CommandTimeout(f"{self.host_name}: `{shlex.join(argv)}` still running after its "
                                         f"{deadline_s:g} s deadline; {killed}")
                if not busy:
                    select.select([chan], [], [], 0.05)  # wakes on stdout; stderr and exit within 50 ms
            status = chan.recv_exit_status()
        except _CONNECTION_FAULTS as e:
            self._drop(conn)
            raise _Dropped(f"{type(e).__name__}: {e}") from None
        finally:
            chan.close()
        if status == -1 and not conn.is_active():
            self._drop(conn)
            raise _Dropped("connection lost before the command reported its exit code")
        head.flush()
        out.feed(b"", final=True)
        err.feed(b"", final=True)
        return CommandResult(argv=argv, exit_code=status if status != -1 else 255, stdout=out.text,
                             stderr=err.text, seconds=time.monotonic() - t0)

    def _kill_after_timeout(self, pgid: int | None) -> str:
        if pgid is None:
            return "it had not reported its pid, so it could not be killed on the host"
        try:
            self.stop_group(pgid, grace_s=0.0)
            return f"its process group {pgid} was killed"
        except TransportError as e:
            return f"killing its process group {pgid} failed: {e}"

    # -- process groups -----------------------------------------------------------------------

    def stop_group(self, pgid: int, grace_s: float, name: str | None = None) -> bool:
        """SIGTERM a remote process group, SIGKILL after `grace_s`; True if it was running."""
        args = [str(pgid) if pgid else "", str(max(0, round(grace_s * 10))), check_spawn_name(name) if name else ""]
        r = self.run(["sh", "-c", _STOP_SCRIPT, "sh", *args], deadline_s=grace_s + 30.0, idempotent=True)
        if r.exit_code not in (0, 3):
            raise TransportError(f"{self.host_name}: stopping process group {pgid or name} failed "
                                 f"(exit {r.exit_code}): {r.stderr.strip()}")
        return r.exit_code == 0

    def stop_leftover(self, name: str, grace_s: float = 5.0) -> bool:
        return self.stop_group(0, grace_s, name)

    def spawn(self, argv: list[str], log_path: Path, *, name: str, env: dict[str, str] | None = None) -> Spawned:
        """Start argv on the host in its own session, pid recorded in ~/.cache/lanebench/run/NAME.pid."""
        if not argv:
            raise ValueError("empty argv")
        check_spawn_name(name)
        env = check_env(env)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        conn, chan = self._channel()
        try:
            chan.set_combine_stderr(True)
            chan.exec_command(_wrap(_SPAWN_WRAPPER, [name, *argv], env))
            chan.sendall(_env_block(env))  # read by the wrapper (when there is an env), never on a command line
            chan.shutdown_write()  # the server's stdin sees EOF, as with DEVNULL locally
        except _CONNECTION_FAULTS as e:
            self._drop(conn)
            raise TransportError(f"{self.host_name}: could not start {argv[0]} on {self.where}: {e}") from None
        spawned = SSHSpawned(self, chan, argv, name, log_path)
        spawned.wait_started(self.connect_timeout_s + 5.0)
        self._spawns.add(spawned)
        return spawned

    def close(self) -> None:
        """Close the connection (stop spawned servers first: their output stream goes with it)."""
        self._drop()


def _send_stdin(chan: paramiko.Channel, data: bytes) -> None:
    with suppress(*_CONNECTION_FAULTS):
        chan.sendall(data)
        chan.shutdown_write()


_TRANSPORTS: weakref.WeakSet[SSHTransport] = weakref.WeakSet()


@atexit.register
def _stop_spawns() -> None:
    """Best effort on exit: a run that dies leaves no remote server (stop_leftover covers the rest)."""
    for transport in list(_TRANSPORTS):
        if transport._conn is None or not transport._conn.is_active():
            continue  # unreachable now: do not stall the exit; the next boot's stop_leftover cleans up
        for spawned in list(transport._spawns):
            with suppress(Exception):  # exiting anyway
                spawned.stop(grace_s=1.0)
        transport.close()
