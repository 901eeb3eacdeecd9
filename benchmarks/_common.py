"""What the benchmark scripts share: the machine's CPU, load and steal, a settled start, the run
folder a lanebench command names, comma lists of numbers, markdown tables and the fake server.

Standard library only at import (http_layers.py runs under a peer's venv); importing it puts the
checkout first on sys.path, so `tasks` imports from it wherever a script runs.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def loadavg() -> list[str]:
    """The 1-, 5- and 15-minute load as /proc/loadavg writes them."""
    return Path("/proc/loadavg").read_text().split()[:3]


def steal() -> tuple[int, int]:
    """(steal ticks, total ticks) from /proc/stat's cpu line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return fields[7] if len(fields) > 7 else 0, sum(fields)


def settle(quiet: float, limit_s: float, poll_s: float) -> float:
    """Wait (up to `limit_s`) for the 1-minute load to fall under `quiet`; returns the load then
    (speed rows are only worth quoting from an idle machine)."""
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] >= quiet and time.monotonic() < deadline:
        time.sleep(poll_s)
    return os.getloadavg()[0]


def run_folder(r: subprocess.CompletedProcess, what: str) -> Path:
    """The run folder a lanebench command names on its last line; none is a SystemExit with its output."""
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if not last.startswith("run folder: "):
        raise SystemExit(f"{what} exited {r.returncode}, naming no run folder:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return Path(last.removeprefix("run folder: "))


def ints(text: str) -> list[int]:
    """A comma list of numbers ("1,16,64"): concurrency levels, cores, worker counts."""
    return [int(x) for x in text.split(",")]


def table(rows: list[dict]) -> str:
    """Rows of one shape as a markdown table: a float under 100 to three decimals, a larger one to none."""
    from tasks.record.markdown import table as lines

    return "\n".join(lines(list(rows[0]), (r.values() for r in rows), lambda v: f"{v:.3f}" if isinstance(v, float)
                           and abs(v) < 100 else f"{v:.0f}" if isinstance(v, float) else str(v)))


class FakeServer(AbstractContextManager["FakeServer"]):
    """benchmarks/fake_server.py, one process per core in `cpus` (None: not pinned; several share the
    port: --reuse-port), each with its own log; read together, as one server."""

    def __init__(self, port: int, *flags: str, cpus: Sequence[int | None] = (None,), log: Path | None = None):
        self.log, self.url = log, f"http://127.0.0.1:{port}"
        share = ["--reuse-port"] if len(cpus) > 1 else []
        self.procs = [subprocess.Popen([sys.executable, str(REPO / "benchmarks/fake_server.py"), "--port", str(port),
                                        *([] if cpu is None else ["--cpu", str(cpu)]),
                                        *([] if log is None else ["--log", str(self._log(i))]), *share, *flags],
                                       stdout=subprocess.PIPE, text=True) for i, cpu in enumerate(cpus)]
        for proc in self.procs:
            assert proc.stdout is not None  # stdout=PIPE
            if "listening" not in proc.stdout.readline():
                self.stop()
                raise SystemExit(f"{Path(sys.argv[0]).name}: the fake server did not start on port {port} "
                                 "(--port picks another)")

    def _log(self, index: int) -> Path:
        assert self.log is not None
        return self.log if index == 0 else self.log.with_suffix(f".{index}.jsonl")

    def reset(self) -> None:
        for i in range(len(self.procs)):
            self._log(i).write_text("")

    def entries(self) -> list[dict]:
        time.sleep(0.2)  # the server logs a request after its last write
        return [json.loads(line) for i in range(len(self.procs)) if self._log(i).exists()
                for line in self._log(i).read_text().splitlines()]

    def cpu_s(self) -> float:
        """The CPU seconds every server process has used so far (user + system)."""
        total = 0
        for proc in self.procs:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        self.stop()
