"""Network-link preflight: a lane that needs a direct cable runs only when the cable works.

A Spark pair with its direct link down, at the wrong MTU or slow does not fail loudly: the
tensor-parallel or RPC lane boots over whatever path is left and reports another machine's
numbers. So each end is read where it lives (operstate, carrier, MTU, address), the peer pinged
over the link from end a (also full-MTU, unfragmentable, when an MTU is declared), and with
`min_gbps` bandwidth measured (iperf3, else ib_write_bw, where on both hosts). The first problem
is the lane's skip reason, naming host, interface and state.
"""

from __future__ import annotations

import json
import re
import time

from pydantic import BaseModel

from tasks.inventory.models import Lane, Link, LinkEnd
from tasks.hosts.retry import retrying
from tasks.hosts.transport import Transport, TransportError

IPERF_PORT = 5201
IB_PORT = 18515  # perftest's default


class EndFacts(BaseModel):
    """One end of a link as its host sees it."""

    host: str
    interface: str
    address: str
    exists: bool = False
    admin_up: bool = False
    operstate: str = "UNKNOWN"
    carrier: int | None = None  # None: unreadable (the kernel refuses while the interface is admin-down)
    mtu: int | None = None
    has_address: bool = False
    error: str = ""

    @property
    def up(self) -> bool:
        # a veth or NIC reads UP; some drivers report UNKNOWN while carrying (then carrier decides)
        return self.admin_up and self.carrier == 1 and self.operstate in ("UP", "UNKNOWN")


class Bandwidth(BaseModel):
    tool: str  # iperf3 | ib_write_bw
    gbps: float
    seconds: float = 1.0


class LinkCheck(BaseModel):
    link: str
    ok: bool
    reason: str = ""
    a: EndFacts
    b: EndFacts
    ping_ok: bool | None = None
    rtt_ms: float | None = None
    mtu_ping_ok: bool | None = None  # a full-MTU packet with don't-fragment crossed
    bandwidth: Bandwidth | None = None
    bandwidth_note: str = ""  # why bandwidth was not measured, when it was not


def lane_links(lane: Lane) -> list[str]:
    """The links a lane needs: its `links` plus its RPC plan's and its nodes' link."""
    extra = [lane.rpc.link if lane.rpc else None, lane.nodes.link if lane.nodes else None]
    return [*lane.links, *(n for n in dict.fromkeys(extra) if n is not None and n not in lane.links)]


def _run(t: Transport, argv: list[str], deadline_s: float = 20.0):
    return t.run(argv, deadline_s=deadline_s, idempotent=True)


def end_facts(end: LinkEnd, t: Transport) -> EndFacts:
    """operstate, flags and MTU from `ip -j link show`, carrier from sysfs, the address from `ip -j addr`."""
    facts = EndFacts(host=end.host, interface=end.interface, address=end.address)
    try:
        shown = _run(t, ["ip", "-j", "addr", "show", "dev", end.interface])
        if shown.exit_code != 0:
            facts.error = shown.stderr.strip() or f"ip exited {shown.exit_code}"
            return facts
        info = (json.loads(shown.stdout) or [{}])[0]
        facts.exists = True
        facts.admin_up = "UP" in info.get("flags", [])
        facts.operstate = info.get("operstate", "UNKNOWN")
        facts.mtu = info.get("mtu")
        facts.has_address = any(a.get("local") == end.address for a in info.get("addr_info", []))
        carrier = _run(t, ["cat", f"/sys/class/net/{end.interface}/carrier"])
    except TransportError as e:
        facts.exists, facts.error = False, f"{end.host} unreachable ({e})"
        return facts
    if carrier.exit_code == 0 and carrier.stdout.strip() in ("0", "1"):
        facts.carrier = int(carrier.stdout.strip())
    return facts


def _end_problems(link: Link, f: EndFacts) -> list[str]:
    if f.error and not f.exists:
        if "does not exist" in f.error:
            return [f"{f.host} has no interface {f.interface}"]
        if f.error.startswith(f"{f.host} unreachable"):
            return [f.error]
        return [f"{f.host} {f.interface} could not be read: {f.error}"]
    out = []
    if not f.up:
        why = "administratively down" if not f.admin_up else f"carrier {f.carrier if f.carrier is not None else 'unknown'}"
        out.append(f"{f.host} {f.interface} is {f.operstate} ({why})")
    if link.mtu is not None and f.mtu != link.mtu:
        out.append(f"{f.host} {f.interface} MTU {f.mtu}, expected {link.mtu}")
    if not f.has_address:
        out.append(f"{f.host} {f.interface} does not hold {f.address}")
    return out


_RTT = re.compile(r"= [0-9.]+/([0-9.]+)/")


def _ping(t: Transport, iface: str, peer: str, size: int | None = None) -> tuple[bool, float | None]:
    argv = ["ping", "-n", "-c", "2", "-W", "1", "-i", "0.2", "-I", iface]
    if size is not None:
        argv += ["-M", "do", "-s", str(size)]
    r = _run(t, [*argv, peer])
    m = _RTT.search(r.stdout)
    return r.exit_code == 0, float(m.group(1)) if m else None


def _has(t: Transport, tool: str) -> bool:
    return _run(t, ["sh", "-c", 'command -v "$1" >/dev/null', "sh", tool]).exit_code == 0


def _iperf3(link: Link, ta: Transport, tb: Transport) -> Bandwidth | str:
    """A one-shot iperf3 server on b (daemon, exits after one client or 10 s idle), 1 s client from a."""
    pidfile = f"/tmp/lanebench-iperf3-{link.name}.pid"
    started = _run(tb, ["iperf3", "-s", "-1", "-D", "--idle-timeout", "10", "-B", link.b.address,
                        "-p", str(IPERF_PORT), "-I", pidfile])
    if started.exit_code != 0:
        return f"iperf3 server on {link.b.host} did not start: {started.stderr.strip()[-200:]}"

    def client() -> Bandwidth | str:
        r = _run(ta, ["iperf3", "-c", link.b.address, "-B", link.a.address, "-p", str(IPERF_PORT),
                      "-t", "1", "-J"], deadline_s=30)
        try:
            data = json.loads(r.stdout)
        except ValueError:
            data = {}
        end = data.get("end") or {}
        bps = (end.get("sum_received") or end.get("sum_sent") or {}).get("bits_per_second")
        if r.exit_code == 0 and bps is not None:
            return Bandwidth(tool="iperf3", gbps=bps / 1e9)
        return data.get("error") or r.stderr.strip() or r.stdout.strip()[-200:]

    try:  # the daemon listens a moment after it forks
        got = retrying(tries=10, wait_s=0.3, until=lambda got: isinstance(got, Bandwidth))(client)
        return got if isinstance(got, Bandwidth) else f"iperf3 from {link.a.host} to {link.b.address} failed: {got}"
    finally:
        _run(tb, ["sh", "-c", 'test -f "$1" && kill "$(cat "$1")" 2>/dev/null; rm -f "$1"; true', "sh", pidfile])


_IB_LINE = re.compile(r"^\s*\d+\s+\d+\s+[0-9.]+\s+([0-9.]+)\s", re.M)


def _ib_write_bw(link: Link, ta: Transport, tb: Transport) -> Bandwidth | str:
    """perftest's ib_write_bw: server on b (exits after one test; `timeout` bounds a no-show), client on a."""
    server = ["timeout", "20", "ib_write_bw", "--report_gbits", "-F", "-p", str(IB_PORT), "-D", "1"]
    started = _run(tb, ["sh", "-c", '"$@" >/dev/null 2>&1 &', "sh", *server])
    if started.exit_code != 0:
        return f"ib_write_bw server on {link.b.host} did not start"

    def client() -> Bandwidth | str:
        r = _run(ta, ["ib_write_bw", "--report_gbits", "-F", "-p", str(IB_PORT), "-D", "1", link.b.address], deadline_s=30)
        m = _IB_LINE.findall(r.stdout)
        if r.exit_code == 0 and m:
            return Bandwidth(tool="ib_write_bw", gbps=float(m[-1]))
        return (r.stderr or r.stdout).strip()[-200:]

    time.sleep(1.0)  # the server listens a moment after it starts
    got = retrying(tries=5, wait_s=1.0, until=lambda got: isinstance(got, Bandwidth))(client)
    return got if isinstance(got, Bandwidth) else f"ib_write_bw from {link.a.host} to {link.b.address} failed: {got}"


def check_link(link: Link, transports: dict[str, Transport]) -> LinkCheck:
    """Both ends up with the declared MTU and address, the peer reachable over the link, bandwidth
    at least `min_gbps` where iperf3 or ib_write_bw is on both hosts; the reason names the first fault."""
    ta, tb = transports[link.a.host], transports[link.b.host]
    a, b = end_facts(link.a, ta), end_facts(link.b, tb)
    check = LinkCheck(link=link.name, ok=False, a=a, b=b)
    try:
        fault = _fault(link, check, ta, tb)
    except TransportError as e:  # a host dropped out between the steps
        fault = f"a host stopped answering during the check ({e})"
    check.ok, check.reason = not fault, f"link {link.name}: {fault}" if fault else ""
    return check


def _fault(link: Link, check: LinkCheck, ta: Transport, tb: Transport) -> str:
    """The link's first fault, "" when none; the facts go into `check` on the way."""
    if problems := _end_problems(link, check.a) + _end_problems(link, check.b):
        return "; ".join(problems)
    check.ping_ok, check.rtt_ms = _ping(ta, link.a.interface, link.b.address)
    if not check.ping_ok:
        return f"{link.b.host} {link.b.address} unreachable from {link.a.host} over {link.a.interface}"
    if link.mtu is not None:
        payload = link.mtu - (48 if ":" in link.b.address else 28)  # IP + ICMP headers
        check.mtu_ping_ok, _ = _ping(ta, link.a.interface, link.b.address, size=payload)
        if not check.mtu_ping_ok:
            return (f"{link.mtu}-byte packets do not pass from {link.a.host} to {link.b.host} {link.b.address} "
                    f"over {link.a.interface} (a smaller MTU on the path)")
    if link.min_gbps is None:
        return ""
    if _has(ta, "iperf3") and _has(tb, "iperf3"):
        measured = _iperf3(link, ta, tb)
    elif _has(ta, "ib_write_bw") and _has(tb, "ib_write_bw"):
        measured = _ib_write_bw(link, ta, tb)
    else:
        check.bandwidth_note = f"neither iperf3 nor ib_write_bw is on both {link.a.host} and {link.b.host}: not measured"
        return ""
    if isinstance(measured, str):
        return f"bandwidth probe failed: {measured}"
    check.bandwidth = measured
    if measured.gbps < link.min_gbps:
        return (f"{measured.gbps:.3g} Gbit/s from {link.a.host} to {link.b.host} over {link.a.interface} "
                f"({measured.tool}), below the declared minimum {link.min_gbps:g}")
    return ""
