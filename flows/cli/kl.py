"""`lanebench kl FILE`: check the KL file, then run the KL gate flow (flows/kl.py).

Exit codes: 0 every candidate meets the bars, 1 any does not (or the gate refused to judge),
2 bad input, 130 Ctrl-C or SIGTERM stopped it. The last line names the run folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows.cli import _bad_input, interrupted_exit, run_flow


def cmd_kl(args: argparse.Namespace) -> int:
    from tasks.client.prompts import load_prompts
    from tasks.inventory.models import ConfigError
    from tasks.kl.config import load_kl_file, resolve, resolve_lanes

    path = Path(args.file)
    try:
        spec = load_kl_file(path)
        resolve_lanes(spec, path)
        prompts = load_prompts(resolve(path.resolve().parent, spec.prompts))
    except ConfigError as e:
        return _bad_input(str(e))
    except (ValueError, KeyError) as e:
        return _bad_input(f"{path}: prompts: the prompt file is not JSONL of {{id, class, prompt}} ({e}). "
                          "Fix: one JSON object per line with those keys")
    wanted = args.prompt_count or spec.prompt_count
    if args.prompt_count is not None and args.prompt_count < 2:
        return _bad_input(f"--prompt-count {args.prompt_count}: a paired bootstrap needs at least 2 prompts. Fix: pass 2 or more")
    if len(prompts) < wanted:
        return _bad_input(f"{path}: prompt_count: asks for {wanted} prompts, the prompt file has {len(prompts)}. "
                          "Fix: lower prompt_count or add prompts")
    if len({p.id for p in prompts}) != len(prompts):
        return _bad_input(f"{path}: prompts: prompt ids repeat in the prompt file. Fix: give every prompt its own id")

    def build() -> Any:
        from flows.kl import kl_gate

        return kl_gate

    artifacts = Path(args.artifacts)
    state, folder = run_flow("kl", build, artifacts, kl_file=str(path.resolve()), artifacts_root=str(artifacts),
                             prompt_count=args.prompt_count)
    if (code := interrupted_exit(state, folder, "kl")) is not None:
        return code
    from tasks.record.progress import closing

    return 0 if closing(state, folder, "kl gate passed", "kl gate failed") else 1


def register_cli(subparsers: Any) -> None:
    from tasks.inventory.paths import REPO

    p = subparsers.add_parser("kl", help="KL gate: score candidates teacher-forced against a reference lane")
    p.add_argument("file", help="KL file (e.g. kl/rehearsal.yaml)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"), help="folder that receives the run folder")
    p.add_argument("--prompt-count", type=int, default=None,
                   help="score only the first N prompts (a quick check; the report says so)")
    p.set_defaults(func=cmd_kl)
