"""guidellm and aiperf as the load generator benchmark runs them: each in a throwaway venv under
/tmp (uv venv + uv pip install, never a project dependency), each run read back into the same
shape: requests ok, tokens, and per-request TTFT keyed so it can meet the server's write log.

Where no registry can be reached (a lent GPU machine), LANEBENCH_PEERS_SITE names a folder with
one `pip install --target` folder per peer (scripts/peers-bundle.sh makes them for cp312): the
peer then runs under this interpreter with its folder first on PYTHONPATH, on top of the
packages the interpreter already has (torch, transformers, numpy ... on that machine's image).

Neither peer is allowed to reach a hub: guidellm reads a local JSONL of prompts (and takes token
counts from the server's usage); aiperf gets a tiny word-level tokenizer made here, on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VENVS = Path("/tmp/lb-peers")
PEERS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}
PEER_TIMEOUT_S = 300  # one peer run; a hung one fails its row, not the whole benchmark
ENTRY = {"guidellm": "from guidellm.__main__ import cli as main", "aiperf": "from aiperf.cli import app as main"}


def python(name: str) -> tuple[list[str], dict[str, str]]:
    """The interpreter that has the peer (argv prefix) and the environment to run it in: its
    venv, made once (uv's cache makes a rerun fast), or its folder under LANEBENCH_PEERS_SITE."""
    site = os.environ.get("LANEBENCH_PEERS_SITE")
    if site:
        folder = Path(site) / name
        if not folder.is_dir():
            raise SystemExit(f"peers.py: LANEBENCH_PEERS_SITE={site} has no {name}/ folder "
                             "(make it with scripts/peers-bundle.sh)")
        path = os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])
        return [sys.executable], {**os.environ, "PYTHONPATH": path}
    root = VENVS / name
    if not (root / "bin" / name).exists():
        subprocess.run(["uv", "venv", "-q", str(root)], check=True)
        subprocess.run(["uv", "pip", "install", "-q", "--python", str(root / "bin/python"), PEERS[name]], check=True)
    return [str(root / "bin/python")], dict(os.environ)


def command(name: str) -> tuple[list[str], dict[str, str]]:
    """The peer's own CLI (its console script's entry point), with its environment."""
    argv, env = python(name)
    return [*argv, "-c", f"import sys; {ENTRY[name]}; sys.argv[0] = {name!r}; sys.exit(main())"], env


_TOKENIZER = """
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers
d = sys.argv[1]; os.makedirs(d, exist_ok=True)
words = ["<unk>", "<s>", "</s>", "tok", "benchmark", "prompt"] + [f"w{i}" for i in range(2000)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.save(os.path.join(d, "tokenizer.json"))
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
           "eos_token": "</s>", "model_max_length": 100000}, open(os.path.join(d, "tokenizer_config.json"), "w"))
"""


def _guidellm(url: str, concurrency: int, requests: int, tokens: int, work: Path, workers: int | None) -> dict:
    cli, env = command("guidellm")
    if workers:
        env = {**env, "GUIDELLM__MAX_WORKER_PROCESSES": str(workers)}
    data, out = work / "guidellm-data.jsonl", work / "guidellm.json"
    data.write_text("".join(json.dumps({"prompt": f"benchmark prompt {i}", "output_tokens_count": tokens}) + "\n"
                            for i in range(requests)))
    out.unlink(missing_ok=True)
    subprocess.run([*cli, "run", "--backend", f"kind=openai_http,target={url},model=fake",
                    "--profile", f"kind=concurrent,streams={concurrency}",
                    "--constraint", f"kind=max_requests,count={requests}",
                    "--data", f"kind=json_file,path={data}", "--output", f"kind=json,path={out}",
                    "--disable-console"], check=True, capture_output=True, text=True, cwd=work, timeout=PEER_TIMEOUT_S, env=env)
    reqs = json.loads(out.read_text())["benchmarks"][0]["requests"]
    good = reqs["successful"]
    return {"ok": len(good), "n": len(good) + len(reqs["errored"]) + len(reqs["incomplete"]),
            "tokens": sum(int(r["output_tokens"] or 0) for r in good),
            "span_s": max(r["request_end_time"] for r in good) - min(r["request_start_time"] for r in good) if good else 0.0,
            "ttft_by_id": {int(r["response_id"].split("-")[-1]): r["time_to_first_token_ms"] / 1000 for r in good
                           if r.get("response_id") and r.get("time_to_first_token_ms") is not None}}


def _aiperf(url: str, concurrency: int, requests: int, tokens: int, work: Path, workers: int | None) -> dict:
    cli, env = command("aiperf")
    tok, out = work / "aiperf-tokenizer", work / f"aiperf-{concurrency}"
    if not (tok / "tokenizer.json").exists():
        interpreter, _ = python("aiperf")
        subprocess.run([*interpreter, "-c", _TOKENIZER, str(tok)], check=True, env=env)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    subprocess.run([*cli, "profile", "--model", "fake", "--url", url, "--endpoint-type",
                    "completions", "--streaming", "--concurrency", str(concurrency), "--request-count", str(requests),
                    "--tokenizer", str(tok), "--output-tokens-mean", str(tokens), "--synthetic-input-tokens-mean",
                    "8", "--artifact-dir", str(out), "--use-server-token-count", "--ui-type", "none",
                    "--export-level", "records", *(["--workers-max", str(workers)] if workers else [])],
                   check=True, capture_output=True, text=True, cwd=work, timeout=PEER_TIMEOUT_S, env=env)
    rows = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    good = [r for r in rows if "time_to_first_token" in r.get("metrics", {})]
    good.sort(key=lambda r: r["metadata"]["request_start_ns"])
    return {"ok": len(good), "n": len(rows),
            "tokens": sum(int(r["metrics"].get("output_token_count", {}).get("value", 0)) for r in good),
            "span_s": (max(r["metadata"]["request_end_ns"] for r in good)
                       - min(r["metadata"]["request_start_ns"] for r in good)) / 1e9 if good else 0.0,
            "ttft_in_order": [r["metrics"]["time_to_first_token"]["value"] / 1000 for r in good]}


def run_peer(name: str, url: str, concurrency: int, requests: int, tokens: int, work: Path,
             workers: int | None = None) -> dict:
    """One run of a peer; `workers`: the most worker processes it may start (its own knob: aiperf's
    --workers-max, guidellm's GUIDELLM__MAX_WORKER_PROCESSES; None: its default, which counts the
    host's cores, not the ones it is pinned to)."""
    return {"guidellm": _guidellm, "aiperf": _aiperf}[name](url, concurrency, requests, tokens, work, workers)
