"""The KL gate: is a quantized (or otherwise changed) checkpoint close enough to its reference?

    quantize (where asked) -> reference: preflight, boot, tokenizer probe, greedy continuations,
    teacher-forced scoring twice (exactness) -> each candidate in turn: preflight, boot,
    tokenizer probe, teacher-forced scoring of the same token ids -> tables (GX), histogram,
    report.md, Prefect artifacts                                   (teardown on every path)

The seeds' "Which NVFP4? Measured, not vibes", made rerunnable for every new checkpoint. The
gate refuses to judge when the instrument is not exact (the reference's two scorings of its
own text differ) and refuses a candidate whose tokenizer differs; a candidate that dies
mid-scoring keeps its partial results, marked, and fails.

`lanebench kl FILE` exits 0 when every candidate meets the bars, 1 when any does not (or the
gate refused to judge), 2 on bad input, 130 when Ctrl-C or SIGTERM stopped it (the lane torn
down, the run folder marked interrupted, no verdict); its last line names the run folder.
This module stays cheap to import: Prefect is imported on first use of the flow (`kl_gate`,
built lazily).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

_flow: Any = None


def run_gate(kl_file: str, artifacts_root: str = "artifacts", prompt_count: int | None = None) -> Any:
    """The flow body: one KL run of `kl_file`, into a new run folder under `artifacts_root`."""
    from prefect.runtime import flow_run
    from prefect.states import Completed, Failed

    from tasks.record.run_folder import RunFolder
    from tasks.kl.config import load_kl_file, resolve, resolve_lanes
    from tasks.kl.gate import Gate
    from tasks.client.prompts import load_prompts
    from tasks.record.interrupted import interrupts, raise_if_stopped, record_stop

    path = Path(kl_file).resolve()
    spec = load_kl_file(path)
    lanes = resolve_lanes(spec, path)
    prompts = load_prompts(resolve(path.parent, spec.prompts), prompt_count or spec.prompt_count)
    run = RunFolder(Path(artifacts_root), "kl", str(flow_run.get_id()), path)
    title = path.name + (f" (first {len(prompts)} prompts only)" if prompt_count else "")
    gate = Gate(run, spec, lanes, prompts, title)
    try:
        gate.prepare_models()
        raise_if_stopped()
        if gate.reference():
            for name in spec.candidates:
                raise_if_stopped()
                gate.candidate(name)
        raise_if_stopped()
    except interrupts() as e:  # no verdict from a gate cut short: the scores so far are kept
        stopped = record_stop(run, "kl", e, [spec.reference, *spec.candidates])
        run.finish()
        return Failed(name="Interrupted", message=stopped)
    except BaseException:
        gate.finish()
        raise
    passed, reasons = gate.finish()
    return Completed(message=str(run.path)) if passed else Failed(message="; ".join(reasons))


def __getattr__(name: str) -> Any:
    """`flows.kl.kl_gate`: the Prefect flow, built on first access (PEP 562)."""
    global _flow
    if name != "kl_gate":
        raise AttributeError(name)
    if _flow is None:
        from prefect import flow

        _flow = flow(name="kl", flow_run_name="kl-{kl_file}")(run_gate)
    return _flow


def cmd_kl(args: argparse.Namespace) -> int:
    from flows.cli import _bad_input, interrupted_exit, run_flow
    from tasks.inventory.models import ConfigError
    from tasks.kl.config import load_kl_file, resolve, resolve_lanes
    from tasks.client.prompts import load_prompts

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

    artifacts = Path(args.artifacts)
    state, folder = run_flow("kl", lambda: __getattr__("kl_gate"), artifacts, kl_file=str(path.resolve()),
                             artifacts_root=str(artifacts), prompt_count=args.prompt_count)
    if (code := interrupted_exit(state, folder, "kl")) is not None:
        return code
    from tasks.record.progress import closing

    return 0 if closing(state, folder, "kl gate passed", "kl gate failed") else 1


def register_cli(subparsers: Any) -> None:
    from tasks.engines.build import REPO

    p = subparsers.add_parser("kl", help="KL gate: score candidates teacher-forced against a reference lane")
    p.add_argument("file", help="KL file (e.g. kl/rehearsal.yaml)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"), help="folder that receives the run folder")
    p.add_argument("--prompt-count", type=int, default=None,
                   help="score only the first N prompts (a quick check; the report says so)")
    p.set_defaults(func=cmd_kl)
