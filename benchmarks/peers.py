"""guidellm and aiperf as the load generator benchmark runs them: each in a throwaway venv under
/tmp (uv venv + uv pip install, never a project dependency), each run read back into the same
shape: requests ok, tokens, and per-request TTFT keyed so it can meet the server's write log.

Neither peer is allowed to reach a hub: guidellm reads a local JSONL of prompts (and takes token
counts from the server's usage); aiperf gets a tiny word-level tokenizer made here, on disk.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

VENVS = Path("/tmp/lb-peers")
PEERS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}


def venv(name: str) -> Path:
    """The peer's venv, made once (uv's cache makes a rerun fast)."""
    root = VENVS / name
    if not (root / "bin" / name).exists():
        subprocess.run(["uv", "venv", "-q", str(root)], check=True)
        subprocess.run(["uv", "pip", "install", "-q", "--python", str(root / "bin/python"), PEERS[name]], check=True)
    return root


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


def _guidellm(url: str, concurrency: int, requests: int, tokens: int, work: Path) -> dict:
    root = venv("guidellm")
    data, out = work / "guidellm-data.jsonl", work / "guidellm.json"
    data.write_text("".join(json.dumps({"prompt": f"benchmark prompt {i}", "output_tokens_count": tokens}) + "\n"
                            for i in range(requests)))
    out.unlink(missing_ok=True)
    subprocess.run([str(root / "bin/guidellm"), "run", "--backend", f"kind=openai_http,target={url},model=fake",
                    "--profile", f"kind=concurrent,streams={concurrency}",
                    "--constraint", f"kind=max_requests,count={requests}",
                    "--data", f"kind=json_file,path={data}", "--output", f"kind=json,path={out}",
                    "--disable-console"], check=True, capture_output=True, text=True, cwd=work, timeout=900)
    reqs = json.loads(out.read_text())["benchmarks"][0]["requests"]
    good = reqs["successful"]
    return {"ok": len(good), "n": len(good) + len(reqs["errored"]) + len(reqs["incomplete"]),
            "tokens": sum(int(r["output_tokens"] or 0) for r in good),
            "ttft_by_id": {int(r["response_id"].split("-")[-1]): r["time_to_first_token_ms"] / 1000 for r in good
                           if r.get("response_id") and r.get("time_to_first_token_ms") is not None}}


def _aiperf(url: str, concurrency: int, requests: int, tokens: int, work: Path) -> dict:
    root = venv("aiperf")
    tok, out = work / "aiperf-tokenizer", work / f"aiperf-{concurrency}"
    if not (tok / "tokenizer.json").exists():
        subprocess.run([str(root / "bin/python"), "-c", _TOKENIZER, str(tok)], check=True)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    subprocess.run([str(root / "bin/aiperf"), "profile", "--model", "fake", "--url", url, "--endpoint-type",
                    "completions", "--streaming", "--concurrency", str(concurrency), "--request-count", str(requests),
                    "--tokenizer", str(tok), "--output-tokens-mean", str(tokens), "--synthetic-input-tokens-mean",
                    "8", "--artifact-dir", str(out), "--use-server-token-count", "--ui-type", "none",
                    "--export-level", "records"], check=True, capture_output=True, text=True, cwd=work, timeout=900)
    rows = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    good = [r for r in rows if "time_to_first_token" in r.get("metrics", {})]
    good.sort(key=lambda r: r["metadata"]["request_start_ns"])
    return {"ok": len(good), "n": len(rows),
            "tokens": sum(int(r["metrics"].get("output_token_count", {}).get("value", 0)) for r in good),
            "ttft_in_order": [r["metrics"]["time_to_first_token"]["value"] / 1000 for r in good]}


def run_peer(name: str, url: str, concurrency: int, requests: int, tokens: int, work: Path) -> dict:
    return {"guidellm": _guidellm, "aiperf": _aiperf}[name](url, concurrency, requests, tokens, work)
