"""Measure the testbed models with a real ``llama-server`` (stdlib only).

Checks, in order: ``/tokenize`` + ``/detokenize`` round-trip arbitrary ASCII exactly, one token
per byte; the target's greedy speed and a loop check; with ``--torch-check`` (the torch venv)
the torch model loaded from the GGUF predicts the server's greedy token at each generated
position (teacher forcing); speculative acceptance per class x drafter x K from ``/metrics``
deltas (1 + accepted / verification steps). README.md, "Measurements", has the results.

Every server it starts listens on 127.0.0.1 in ports 18100-18199 and is stopped on exit.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"
CLASSES = ("prose", "code", "math", "tool")
DRAFTERS = ("good", "weak")


def find_bin() -> Path:
    """llama-server from $LLAMA_SERVER or the build cache of scripts/build-llama-cpp.sh."""
    if os.environ.get("LLAMA_SERVER"):
        return Path(os.environ["LLAMA_SERVER"])
    cache = os.environ.get("LANEBENCH_CACHE", os.path.expanduser("~/.cache/lanebench"))
    for b in sorted(glob.glob(f"{cache}/llama.cpp/*/bin/llama-server")):
        if (Path(b).parent.parent / ".complete").exists():
            return Path(b)
    sys.exit("llama-server not found: run scripts/build-llama-cpp.sh")


def _req(port: int, path: str, body: dict | None = None, timeout: float = 120) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                               headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=timeout) as resp:
        raw = resp.read().decode()
    return json.loads(raw) if resp.headers.get_content_type() == "application/json" else raw


@contextmanager
def server(port: int, model: Path, drafter: Path | None = None, k: int = 4,
           log: Path | None = None) -> Iterator[int]:
    """Run llama-server for the duration of the block (bounded start-up wait)."""
    assert 18100 <= port <= 18199
    cmd = [str(find_bin()), "-m", str(model), "--metrics", "-c", "2048", "-np", "1",
           "-t", "2", "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if drafter is not None:
        cmd += ["--model-draft", str(drafter), "--spec-type", "draft-simple",
                "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                "--spec-draft-p-min", "0.0"]
    with open(log or os.devnull, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield _wait_healthy(proc, port, cmd)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, cmd: list[str]) -> int:
    """Poll /health until the server answers (60 s at most)."""
    deadline = time.time() + 60
    while proc.poll() is None:
        with suppress(OSError):
            if _req(port, "/health", timeout=2):
                return port
        if time.time() > deadline:
            raise TimeoutError("llama-server did not become healthy in 60 s")
        time.sleep(0.2)
    raise RuntimeError(f"llama-server exited {proc.returncode}: {' '.join(cmd)}")


def metrics(port: int) -> dict[str, float]:
    return {m[1]: float(m[2]) for line in str(_req(port, "/metrics")).splitlines()
            if (m := re.match(r"llamacpp:(\w+(?:\{[^}]*\})?) ([-0-9.e+]+)$", line))}


def load_prompts(n: int | None = None) -> dict[str, list[dict[str, str]]]:
    return {cls: [json.loads(x) for x in (HERE / "prompts" / f"{cls}.jsonl").read_text().splitlines()][:n or None]
            for cls in CLASSES}


def complete(port: int, prompt: str, n_predict: int) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True, "seed": 0}
    res = _req(port, "/completion", body)
    assert isinstance(res, dict)
    return res


# --------------------------------------------------------------------------- checks


def check_tokenizer(port: int) -> dict[str, object]:
    """Round-trip random ASCII through /tokenize and /detokenize; one token per byte."""
    rng = random.Random(7)
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\r", " ", " ", "{", "}", "\""]
    texts = ["", " ", "  leading and trailing  ", "a\nb\n\n{\"k\": [1, 2]}\n",
             "def f(x):\n    return x  # done\n"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300)))
              for _ in range(200)]
    bad = 0
    for t in texts:
        toks = _req(port, "/tokenize", {"content": t, "add_special": False})["tokens"]
        back = _req(port, "/detokenize", {"tokens": toks})["content"]
        if back != t or len(toks) != len(t.encode()):
            bad += 1
            print(f"  round-trip mismatch: {t!r} -> {toks[:12]} -> {back!r}")
    space = _req(port, "/tokenize", {"content": " ", "add_special": False})["tokens"]
    bos = _req(port, "/tokenize", {"content": "a", "add_special": True})["tokens"]
    special = _req(port, "/tokenize", {"content": "<tool_call>{}</tool_call><|im_end|>",
                                       "add_special": False})["tokens"]
    return {"texts": len(texts), "mismatches": bad, "space_ids": space,
            "with_bos": bos, "special_ids": special}


def loop_period(text: str) -> int | None:
    """Smallest period (<= 40 bytes) that repeats over the last 80 bytes, if any."""
    tail = text[-80:]
    if len(tail) < 80:
        return None
    return next((p for p in range(1, 41) if all(tail[i] == tail[i - p] for i in range(p, len(tail)))), None)


def greedy_runs(port: int, prompts: dict[str, list[dict[str, str]]], n_predict: int
                ) -> dict[str, list[dict]]:
    def run(r: dict[str, str]) -> dict:
        res = complete(port, r["prompt"], n_predict)
        return {"id": r["id"], "prompt": r["prompt"], "content": res["content"], "tokens": res.get("tokens", []),
                "tps": res["timings"]["predicted_per_second"], "n": res["timings"]["predicted_n"]}

    return {cls: [run(r) for r in rows] for cls, rows in prompts.items()}


def torch_agreement(runs: dict[str, list[dict]], model_path: Path) -> dict[str, float]:
    """Fraction of generated positions where torch's top-1 equals the server's token."""
    import torch

    sys.path.insert(0, str(HERE))
    import build_models as bm

    torch.set_num_threads(2)
    model = bm.load_gguf(model_path)
    out: dict[str, float] = {}
    for cls, rs in runs.items():
        agree = total = 0
        for r in rs:
            p = [bm.BOS, *bm.encode(r["prompt"])]
            seq = p + list(r["tokens"])
            with torch.no_grad():
                logits = model(torch.tensor([seq[:-1]]))[0]
            pred = logits.argmax(-1).tolist()
            agree += sum(pred[i] == seq[i + 1] for i in range(len(p) - 1, len(seq) - 1))
            total += len(seq) - len(p)
        out[cls] = agree / max(1, total)
    return out


def acceptance(port: int, prompts: dict[str, list[dict[str, str]]], n_predict: int
               ) -> dict[str, dict[str, float]]:
    """Per class: acceptance length and per-position acceptance from /metrics deltas."""
    out: dict[str, dict[str, float]] = {}
    for cls, rows in prompts.items():
        m0 = metrics(port)
        tps = [complete(port, r["prompt"], n_predict)["timings"]["predicted_per_second"] for r in rows]
        m1 = metrics(port)
        d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
        steps = d.get("spec_decode_num_drafts_total", 0.0)
        acc = d.get("spec_decode_num_accepted_tokens_total", 0.0)
        out[cls] = {"acc_len": 1 + acc / steps if steps else float("nan"),
                    "drafts": steps, "accepted": acc,
                    "drafted": d.get("spec_decode_num_draft_tokens_total", 0.0),
                    "tps": sum(tps) / len(tps)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Measure the testbed models with llama-server.")
    ap.add_argument("--models", type=Path, default=MODELS)
    ap.add_argument("--port", type=int, default=18150)
    ap.add_argument("--target", type=Path, help="target GGUF (default: MODELS/target-f16.gguf)")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 7])
    ap.add_argument("--drafters", nargs="+", default=list(DRAFTERS))
    ap.add_argument("--prompts", type=int, default=None, help="use the first N per class")
    ap.add_argument("--torch-check", action="store_true")
    ap.add_argument("--show", type=int, default=1, help="print N greedy outputs per class")
    ap.add_argument("--json", type=Path, help="write all results here")
    args = ap.parse_args()
    prompts = load_prompts(args.prompts)
    target = args.target or args.models / "target-f16.gguf"
    report: dict[str, object] = {}

    with server(args.port, target, log=Path("/tmp/testbed-target.log")) as port:
        report["tokenizer"] = tok = check_tokenizer(port)
        print(f"tokenizer: {tok}")
        runs = greedy_runs(port, prompts, args.n_predict)
    report["greedy"] = greedy = {c: {"tps": sum(r["tps"] for r in rs) / len(rs),
                                     "loops": sum(loop_period(r["content"]) is not None for r in rs)}
                                 for c, rs in runs.items()}
    for cls, rs in runs.items():
        print(f"greedy {cls}: {greedy[cls]['tps']:.0f} tok/s, {greedy[cls]['loops']}/{len(rs)} end in a short loop")
        for r in rs[:args.show]:
            print(f"  {r['id']}: ...{r['prompt'][-60:]!r} => {r['content']!r}")
    if args.torch_check:
        report["torch_agreement"] = agr = torch_agreement(runs, target)
        print("torch top-1 agreement with llama-server greedy:",
              {k: round(v, 4) for k, v in agr.items()})

    table: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for dname in args.drafters:
        table[dname] = {}
        for k in args.ks:
            drafter = args.models / f"drafter-{dname}-f16.gguf"
            with server(args.port, target, drafter, k, Path("/tmp/testbed-spec.log")) as port:
                table[dname][k] = res = acceptance(port, prompts, args.n_predict)
            print(f"{dname} K={k}: " + "  ".join(
                f"{c} {v['acc_len']:.2f} ({v['tps']:.0f} tok/s)" for c, v in res.items()),
                flush=True)
    report["acceptance"] = table

    print("\n| drafter | K | " + " | ".join(CLASSES) + " |")
    print("|---|---|" + "---|" * len(CLASSES))
    for dname, byk in table.items():
        for k, res in byk.items():
            print(f"| {dname} | {k} | " + " | ".join(f"{res[c]['acc_len']:.2f}" for c in CLASSES)
                  + " |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
