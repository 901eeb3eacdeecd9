"""The users' topology on one Linux machine: GB300 and a Spark pair as network namespaces.

    root namespace: bridge lbmgmt0 10.213.0.1/24 (the orchestrator), registry 10.213.0.1:5000
    gb300   mgmt0 10.213.0.10   sshd :22, its own dockerd (socket under .lab/gb300/docker)
    spark1  mgmt0 10.213.0.11   sshd :22, direct0 10.213.1.1/30 MTU 9000 --+ veth: the direct
    spark2  mgmt0 10.213.0.12   sshd :22, direct0 10.213.1.2/30 MTU 9000 --+ cable, cuttable

Everything the lab makes is recorded in `.lab/state.json` as it is made, so `down` (and an
`up` after a crash) can remove it from another process. `down` does not trust the record
alone: it also stops every process running in a lab namespace or naming `.lab` on its command
line, and unmounts whatever is mounted under `.lab`. Hosts are verified by their keys
(`.lab/known_hosts`), never trusted on first use.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import shutil
import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lab import netns, procs
from tasks.hosts.retry import retrying
from tasks.inventory.paths import REPO

LAB_DIR = REPO / ".lab"
INVENTORY = REPO / "hosts.lab.yaml"
TEMPLATE = Path(__file__).resolve().parent / "hosts.lab.yaml.in"

BRIDGE, BRIDGE_CIDR, ORCHESTRATOR = "lbmgmt0", "10.213.0.1/24", "10.213.0.1"
HOSTS: dict[str, str] = {"gb300": "10.213.0.10", "spark1": "10.213.0.11", "spark2": "10.213.0.12"}
MGMT_IF = "mgmt0"
DIRECT_IF, DIRECT_MTU = "direct0", 9000
DIRECT_A, DIRECT_B = ("spark1", "10.213.1.1"), ("spark2", "10.213.1.2")
REGISTRY_PORT = 5000
SSH_PORT = 22
# One lab per machine: a test session and a `lanebench lab` command must not pull it from under
# each other. Outside .lab, which down empties. A holder lets its children (the CLI under test) in.
LOCK_PATH = Path("/run/lanebench-lab.lock")
HOLDER_ENV = "LANEBENCH_LAB_LOCK_HOLDER"
# What down must keep: a place for caches worth more than one lab (nothing else survives).
KEEP = {"cache"}
# Killing lab processes: SIGTERM, then SIGKILL after this long (daemons clean up on SIGTERM).
_TERM_GRACE_S, _KILL_GRACE_S = 15.0, 5.0


def _root_end(host: str) -> str:
    return f"lbm-{host}"[:15]


class LabError(RuntimeError):
    """The lab could not be brought up (the message says which step); it was torn down again."""


class LabBusy(LabError):
    """Another process holds the lab (a test session, another `lanebench lab`)."""


def _lock_holder() -> int | None:
    try:
        return int(LOCK_PATH.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@contextmanager
def lab_lock(wait_s: float = 0.0) -> Iterator[None]:
    """Hold the machine's lab exclusively (waiting up to `wait_s`); re-entrant for the holder's children."""
    inherited = os.environ.get(HOLDER_ENV)
    if inherited and inherited.isdigit() and _lock_holder() == int(inherited) and procs.alive(int(inherited)):
        yield
        return
    with open(os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o644), "r+") as f:  # closing it releases the lock
        try:
            retrying(within_s=wait_s, wait_s=1.0, on=BlockingIOError)(fcntl.flock, f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder()
            what = procs.cmdline(holder).replace(b"\0", b" ").decode(errors="replace")[:100] if holder else "?"
            raise LabBusy(f"the lab is in use by pid {holder} ({what.strip()}). Fix: wait for it to finish") from None
        f.write(f"{os.getpid()}\n")
        f.truncate()  # flushes it too
        try:
            yield
        finally:
            f.truncate(0)


class Lab:
    """One lab on this machine. `up` and `down` are idempotent; `down` is safe to run twice."""

    def __init__(self, lab_dir: Path = LAB_DIR, inventory: Path = INVENTORY, say: Callable[[str], None] = print) -> None:
        self.dir = Path(lab_dir).resolve()
        self.state_path = self.dir / "state.json"
        self.inventory_path = Path(inventory).resolve()
        self.say = say
        self._live: list[Any] = []  # daemons started by this process, stopped first by down()

    # ---- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def _record(self, **changes: Any) -> None:
        state = self.state()
        state |= {k: state[k] | v if isinstance(v, dict) and isinstance(state.get(k), dict) else v
                  for k, v in changes.items()}
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_path)

    def host_dir(self, host: str) -> Path:
        return self.dir / "hosts" / host

    # ---- up ----------------------------------------------------------------------------------
    def leftovers(self) -> list[str]:
        """What a previous lab left on this machine (namespaces, bridge, state), if anything."""
        found = [f"namespace {n}" for n in HOSTS if n in netns.list_netns()]
        if netns.link_exists(BRIDGE):
            found.append(f"bridge {BRIDGE}")
        if self.state_path.exists():
            found.append(f"state {self.state_path}")
        return found

    def up(self) -> dict[str, Any]:
        """Bring the whole lab up (tearing a leftover one down first); returns the state record."""
        _require_root_and_tools()
        if left := self.leftovers():
            self.say(f"lab: removing a leftover lab first ({', '.join(left)})")
            self.down()
        self._record(started=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), lab_dir=str(self.dir),
                     namespaces=[], bridge=None, processes={}, complete=False)
        try:
            self._network()
            self._disks()
            self._sshds()
            registry, dockerd = self._docker()
            image = self._image(dockerd, registry)
            self._render(dockerd.docker_host, image)
        except BaseException as e:
            self.say(f"lab: up failed ({type(e).__name__}: {e}); tearing down what was started")
            self.down()
            if isinstance(e, Exception):
                raise LabError(f"lab up failed: {e}") from e
            raise
        self._record(complete=True)
        self.say(f"lab: up; inventory {self.inventory_path}")
        return self.state()

    def _network(self) -> None:
        self._record(bridge=BRIDGE)
        netns.add_bridge(BRIDGE, BRIDGE_CIDR)
        for host, address in HOSTS.items():
            self._record(namespaces=[*self.state().get("namespaces", []), host])
            netns.add_netns(host)
            netns.add_veth_to_bridge(_root_end(host), BRIDGE, host, MGMT_IF, f"{address}/24")
            self.say(f"lab: namespace {host}: {MGMT_IF} {address}/24 on bridge {BRIDGE}")
        (a, addr_a), (b, addr_b) = DIRECT_A, DIRECT_B
        netns.add_veth_between(a, DIRECT_IF, f"{addr_a}/30", b, DIRECT_IF, f"{addr_b}/30", mtu=DIRECT_MTU)
        self._record(direct={"a": [a, DIRECT_IF, addr_a], "b": [b, DIRECT_IF, addr_b], "mtu": DIRECT_MTU})
        self.say(f"lab: direct link {a} {DIRECT_IF} {addr_a} <-> {b} {DIRECT_IF} {addr_b}, MTU {DIRECT_MTU}")

    def _disks(self) -> None:
        """Each host's 'disk': its models (copies of the testbed's, so they are files on that host) and artifacts."""
        models = sorted((REPO / "testbed" / "models").glob("*.gguf"))
        for host in HOSTS:
            (self.host_dir(host) / "artifacts").mkdir(parents=True, exist_ok=True)
            (self.host_dir(host) / "models").mkdir(parents=True, exist_ok=True)
            for model in models:
                shutil.copy2(model, self.host_dir(host) / "models" / model.name)
        self.say(f"lab: copied {len(models)} model files to {self.dir / 'hosts'}/<host>/models")

    def _sshds(self) -> None:
        from lab.sshd import make_keypair

        (self.dir / "authorized_keys").write_text(make_keypair(self.dir / "id_ed25519", "lanebench-lab") + "\n")
        lines = []
        for host, address in HOSTS.items():
            sshd = self.start_sshd(host)
            lines.append(sshd.known_hosts_line())
            self.say(f"lab: sshd in {host} on {address}:{SSH_PORT} (pid {sshd.pid})")
        (self.dir / "known_hosts").write_text("\n".join(lines) + "\n")

    def _docker(self) -> tuple[Any, Any]:
        from lab.docker import start_dockerd

        registry = self.start_registry()
        self.say(f"lab: registry on {registry.url} (pid {registry.pid})")
        dockerd = start_dockerd(self.dir / "gb300" / "docker", netns="gb300", insecure_registries=[registry.url])
        self._live.insert(0, dockerd)  # stopped first: its containers go before anything else
        self._record(processes={"dockerd-gb300": dockerd.pid}, docker_host=dockerd.docker_host)
        self.say(f"lab: dockerd in gb300 on {dockerd.docker_host} (pid {dockerd.pid})")
        return registry, dockerd

    def _image(self, dockerd: Any, registry: Any) -> str:
        from lab.image import build_and_push

        self.say("lab: building and pushing the llama-server image (gb300's dockerd)")
        image = build_and_push(dockerd.docker_host, registry.url)
        # Built on gb300's daemon only because it is the lab's one daemon: the lane must still get
        # the image as a real host does, pulled by digest from the registry, so the copy goes.
        image_id = dockerd.docker("image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
        if image_id:
            dockerd.docker("image", "rm", "--force", image_id)
        self._record(image=image)
        self.say(f"lab: image {image}")
        return image

    def _render(self, docker_host: str, image: str) -> None:
        """hosts.lab.yaml from the template: this machine's image digest, paths and model sizes."""
        from tasks.engines import engine_for
        from tasks.hosts.files import file_sha256
        from tasks.inventory.load import load_inventory

        target, drafter = (REPO / "testbed" / "models" / name for name in ("target-f16.gguf", "drafter-good-f16.gguf"))
        text = string.Template(TEMPLATE.read_text()).substitute(
            lab=str(self.dir), image=image, gb300_docker_host=docker_host, target_bytes=target.stat().st_size,
            target_sha256=file_sha256(target), drafter_bytes=drafter.stat().st_size)
        tmp = self.inventory_path.with_suffix(".tmp")
        tmp.write_text(text)
        load_inventory(tmp, engine_for)  # raises ConfigError naming the field if the template is wrong
        tmp.replace(self.inventory_path)
        self._record(inventory=str(self.inventory_path))
        self.say(f"lab: wrote {self.inventory_path}")

    # ---- for tests and flows ---------------------------------------------------------------------
    def inventory(self):  # -> tasks.config.Inventory
        """The generated inventory (hosts.lab.yaml), validated."""
        from tasks.engines import engine_for
        from tasks.inventory.load import load_inventory

        return load_inventory(self.inventory_path, engine_for)

    def transports(self) -> dict[str, Any]:
        """A transport per lab host (SSH, keys checked against .lab/known_hosts); close them when done."""
        from tasks.hosts.connect import transport_for

        return {name: transport_for(name, host, self.inventory_path.parent) for name, host in self.inventory().hosts.items()}

    # ---- the direct link ---------------------------------------------------------------------
    def cut_link(self) -> None:
        """Cut the spark1<->spark2 cable: spark1's end admin-down; spark2's end loses carrier."""
        netns.set_link(DIRECT_IF, False, netns=DIRECT_A[0])

    def restore_link(self) -> None:
        netns.set_link(DIRECT_IF, True, netns=DIRECT_A[0])
        # a veth reports UP on both ends a moment after the admin change
        retrying(within_s=5.0, wait_s=0.05, until=bool)(
            lambda: all(netns.operstate(DIRECT_IF, netns=ns) == "UP" for ns in (DIRECT_A[0], DIRECT_B[0])))

    # ---- a host's sshd killed, and started again ------------------------------------------------
    def kill_sshd(self, host: str) -> int:
        """SIGKILL a host's sshd, its listener and every connection it serves (what an OOM kill or
        `pkill -9 sshd` does): clients lose their sessions and cannot reconnect. The processes the
        sessions started are left as they are. Returns how many sshd processes were killed."""
        from lab.sshd import kill_sessions

        pid = int(self.state()["processes"][f"sshd-{host}"])
        killed = kill_sessions(pid, pid)
        for daemon in self._live:  # reap it if this process started it
            if daemon.pid == pid:
                daemon._proc.wait(timeout=10)
        return 1 + killed

    def start_sshd(self, host: str) -> Any:
        """Start a host's sshd (again: the same host key, so known_hosts still holds)."""
        from lab.sshd import start_sshd

        old = self.state().get("processes", {}).get(f"sshd-{host}")
        sshd = start_sshd(self.dir / host / "sshd", HOSTS[host], SSH_PORT, self.dir / "authorized_keys", netns=host)
        self._live = [d for d in self._live if d.pid != old] + [sshd]
        self._record(processes={f"sshd-{host}": sshd.pid})
        return sshd

    # ---- faults for tests: the registry down, an image the host does not have ----------------
    def stop_registry(self) -> None:
        """Take the lab registry down (its storage stays): a pull that needs it must fail clearly."""
        pid = self.state().get("processes", {}).get("registry")
        if pid:
            procs.kill_all({int(pid)}, _TERM_GRACE_S, _KILL_GRACE_S)
        self._live = [d for d in self._live if d.pid != pid]

    def start_registry(self) -> Any:
        from lab.docker import start_registry

        registry = start_registry(self.dir / "registry", ORCHESTRATOR, REGISTRY_PORT)
        self._live.append(registry)
        self._record(processes={"registry": registry.pid}, registry=registry.url)
        return registry

    def drop_image(self) -> None:
        """Remove the pinned image from gb300's daemon, as on a host that never pulled it."""
        from lab.docker import docker

        if (state := self.state()).get("image"):
            docker(state["docker_host"], "image", "rm", "--force", state["image"])

    # ---- down --------------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Remove every container, process, mount, namespace, veth and bridge of the lab; returns what went."""
        removed: list[str] = []
        state = self.state()
        recorded = set(state.get("processes", {}).values())
        for daemon in self._live:  # this process's own daemons: their stop() knows them best
            if daemon.pid not in recorded:
                continue  # replaced by a later `up` in another process: the sweeps below handle it
            try:
                daemon.stop()
                removed.append(f"stopped {getattr(daemon, 'name', type(daemon).__name__)} (pid {daemon.pid})")
            except Exception as e:  # noqa: BLE001 - the sweeps below still run
                self.say(f"lab: stopping pid {daemon.pid} failed ({e}); killing it")
        self._live.clear()
        if state.get("docker_host"):
            from lab.docker import remove_containers

            removed += [f"container {i}" for i in remove_containers(state["docker_host"])]
        pids = _lab_pids(self.dir, HOSTS) | {p for p in state.get("processes", {}).values() if _same_lab_process(p, self.dir)}
        if pids:
            procs.kill_all(pids, _TERM_GRACE_S, _KILL_GRACE_S)
            removed.append(f"killed {len(pids)} processes ({', '.join(str(p) for p in sorted(pids))})")
        removed += [f"unmounted {point}" for point in procs.unmount_under(self.dir)]
        removed += [f"namespace {host}" for host in HOSTS if netns.del_netns(host)]
        removed += [f"link {ifname}" for ifname in [BRIDGE, *(_root_end(h) for h in HOSTS)] if netns.del_link(ifname)]
        if self.inventory_path.exists():
            self.inventory_path.unlink()
            removed.append(f"file {self.inventory_path}")
        doomed = [e for e in self.dir.iterdir() if e.name not in KEEP] if self.dir.exists() else []
        for entry in doomed:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if doomed:
            removed.append(f"files under {self.dir}")
        for line in removed:
            self.say(f"lab: removed {line}")
        return removed

    # ---- status ------------------------------------------------------------------------------
    def status(self) -> tuple[bool, list[str]]:
        """(healthy, lines): namespaces present, recorded processes alive, link state, registry and dockerd."""
        state = self.state()
        if not state:
            return False, ["lab: not up (no state)"]
        lines, ok = [], bool(state.get("complete"))
        if not ok:
            lines.append("lab: incomplete (up did not finish)")
        present = netns.list_netns()
        for host, address in HOSTS.items():
            ok &= (there := host in present)
            lines.append(f"namespace {host}: {'present' if there else 'MISSING'} ({MGMT_IF} {address})")
        for name, pid in state.get("processes", {}).items():
            ok &= (alive := procs.alive(pid))
            lines.append(f"process {name}: pid {pid} {'running' if alive else 'GONE'}")
        if DIRECT_A[0] in present and DIRECT_B[0] in present:
            a, b = netns.operstate(DIRECT_IF, DIRECT_A[0]), netns.operstate(DIRECT_IF, DIRECT_B[0])
            lines.append(f"direct link: {DIRECT_A[0]} {DIRECT_IF} {a}, {DIRECT_B[0]} {DIRECT_IF} {b}"
                         + ("" if a == b == "UP" else " (cut)"))
        lines += [f"{key}: {state[key]}" for key in ("image", "inventory") if state.get(key)]
        return ok, lines


# ---- helpers -------------------------------------------------------------------------------------
def _require_root_and_tools() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, sshd on port 22, dockerd). Fix: run as root")
    missing = [t for t in ("ip", "ping", "dockerd", "docker", "docker-registry", "iperf3", "ssh-keygen")
               if shutil.which(t) is None]
    if not Path("/usr/sbin/sshd").exists():
        missing.append("sshd")
    if missing:
        raise LabError(f"missing tools: {', '.join(missing)}. Fix: run ./setup (installs them)")


def _same_lab_process(pid: int, lab_dir: Path) -> bool:
    """A recorded pid still names the lab (pids are reused: never kill one that does not)."""
    return str(lab_dir).encode() in procs.cmdline(pid)


def _ancestors() -> set[int]:
    out: set[int] = set()
    pid: int | None = os.getpid()
    while pid is not None and pid > 1:
        out.add(pid)
        pid = procs.ppid(pid)
    return out


def _lab_pids(lab_dir: Path, hosts: dict[str, str]) -> set[int]:
    """Processes of the lab: running in a lab namespace, or naming the lab folder on their command line."""
    inodes = {i for i in (netns.netns_inode(h) for h in hosts) if i is not None}
    needle = str(Path(lab_dir).resolve()).encode()

    def in_lab(folder: Path, line: bytes) -> bool:
        try:
            return os.stat(folder / "ns" / "net").st_ino in inodes or needle in line
        except OSError:
            return needle in line

    return procs.matching(in_lab, skip=_ancestors())
