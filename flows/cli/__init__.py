"""The `lanebench` command.

Exit codes: 0 every lane that ran passed (skipped lanes named); 1 a gate, a bar, an
expectation or a regression failed; 2 bad input (one line naming file, field and fix; nothing
is run); 3 nothing was measured (every lane skipped by a precondition); 130 interrupted
(Ctrl-C or SIGTERM). The last line printed names the run folder.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import Any, NoReturn

from tasks.inventory.paths import REPO

DEFAULT_HOSTS = REPO / "hosts.yaml"
# Modules with their own subcommands (register_cli(subparsers)): cheap to import, no Prefect or GX.
# The flows themselves are imported only once a command has checked its input and launched the API server.
_SUBCOMMANDS: list[str] = ["flows.history", "flows.plan"]


def _bad_input(message: str) -> int:
    print(f"lanebench: error: {message}", file=sys.stderr)
    return 2


def artifacts_arg(value: str, resolve: bool = False) -> tuple[str, Path]:
    """--artifacts as the flow's parameter and the local folder the run folder appears in (a store
    URL's local mirror: tasks/record/store.py)."""
    from tasks.record.store import Store, StoreError, is_url

    if is_url(value):
        try:
            return value, Store(value).local_root
        except StoreError as e:
            raise SystemExit(_bad_input(str(e))) from None
    path = Path(value).resolve() if resolve else Path(value)
    return str(path), path


def _quiet_prefect() -> None:
    """Telemetry off, Prefect's logs at WARNING; before anything imports Prefect (it reads its settings once)."""
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The API server takes 15-25 s on 2 idle cores; its default 20 s limit fails on a busy box.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)


def run_flow(flow: str, build: Callable[[], Any], artifacts: Path, launched: tuple[Any, str] | None = None,
             **params: Any) -> tuple[Any, Path | None]:
    """Call a flow the way every flow command does; returns its final state and its run folder.

    Prefect's API server runs in a session of its own (flows/api_server.py), so a terminal's Ctrl-C
    spares it and the run records its own end (state Interrupted, exit 130); it is launched (or was,
    `launched`) before `build` imports the flow modules, so it boots meanwhile.
    """
    _quiet_prefect()
    from flows.api_server import api_server, launch

    launched = launched or launch()  # None again when PREFECT_API_URL names a server
    from tasks.record.interrupted import install_stop_handlers
    from tasks.record.prefect_redaction import install
    from tasks.record.progress import run_folder_of

    install_stop_handlers()
    install()  # before the flow run exists: its creation and first states are scrubbed too
    call = build()
    import prefect.flow_engine  # (Prefect imports its engines at the first flow call:
    import prefect.task_engine  # noqa: F401 - imported here, they load while the API server boots)
    with api_server(launched):
        state = call(**params, return_state=True)
    return state, run_folder_of(state, artifacts, flow)


def interrupted_exit(state: Any, folder: Path | None, flow: str) -> int | None:
    """130 with the closing line when the run was stopped by a signal, else None."""
    from tasks.record.progress import closing_verdict
    from tasks.record.verdict import EXIT_CODES, exit_code_of

    if exit_code_of(state) != EXIT_CODES["interrupted"]:
        return None
    return closing_verdict(state, folder, flow)


def cmd_nightly(args: argparse.Namespace) -> int:
    # Prefect's API server first (flows/api_server.py): it boots (~6 s on 2 cores) while the
    # inventory is checked and the flow modules import, instead of after them. Bad input stops it.
    from flows.api_server import launch, stop

    launched = launch()
    refused: int | None = 2  # an exception in the checks stops the server too
    try:
        refused = _refused_nightly(args)
    finally:
        if refused is not None:
            stop(launched)
    if refused is not None:
        return refused

    def build() -> Any:
        from flows.nightly import nightly, warm

        warm()  # GX and matplotlib load now, while the API server boots
        return nightly

    root, artifacts = artifacts_arg(args.artifacts)
    state, folder = run_flow("nightly", build, artifacts, launched=launched, hosts=str(Path(args.hosts).resolve()),
                             lanes=args.lane, artifacts_root=root)
    from tasks.record.progress import closing_verdict

    return closing_verdict(state, folder, "nightly")


def inventory_of(hosts: Path, lanes: list[str] | None, files: bool = False, named: str = "--lane ") -> Any:
    """The inventory holding every lane of `lanes` (`files`: its input files checked first), or the one-line problem."""
    from tasks.engines import engine_for
    from tasks.inventory.models import ConfigError
    from tasks.inventory.load import load_inventory

    try:
        inventory = load_inventory(hosts, engine_for)
        if files:
            from tasks.stages.input_files import check_prompt_files

            check_prompt_files(inventory, hosts)
    except ConfigError as e:
        return str(e)
    if unknown := [name for name in lanes or [] if name not in inventory.lanes]:
        return f"{named}{unknown[0]}: no such lane in {hosts}. Fix: use one of: {', '.join(inventory.lanes)}"
    return inventory


def _refused_nightly(args: argparse.Namespace) -> int | None:
    """Exit 2 with one line for an inventory the nightly cannot run; None when it can."""
    from tasks.engines import engine_for, planned
    from tasks.inventory.models import ConfigError
    from tasks.stages.input_files import check_prompt_files

    if isinstance(inventory := inventory_of(Path(args.hosts), args.lane), str):
        return _bad_input(inventory)
    # A lane whose own config caps running requests below its bench (and gates on capacity) fails
    # for sure: said before anything is pulled or booted (`lanebench plan` shows the computation).
    for name in args.lane or list(inventory.lanes):
        lane = inventory.lanes[name]
        if (reason := planned.check(lane, engine_for(lane.engine).planned_cap(lane))) is not None:
            return _bad_input(f"{Path(args.hosts)}: lanes.{name}.flags: {reason}")
    try:
        check_prompt_files(inventory, Path(args.hosts))
    except ConfigError as e:
        return _bad_input(str(e))
    return None


def cmd_kl(args: argparse.Namespace) -> int:
    """The KL gate (flows/kl.py): 0 every candidate meets the bars, 1 any does not (or no judgement)."""
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
    artifacts = Path(args.artifacts)
    state, folder = run_flow("kl", lambda: import_module("flows.kl").kl_gate, artifacts, kl_file=str(path.resolve()),
                             artifacts_root=str(artifacts), prompt_count=args.prompt_count)
    if (code := interrupted_exit(state, folder, "kl")) is not None:
        return code
    from tasks.record.progress import closing

    return 0 if closing(state, folder, "kl gate passed", "kl gate failed") else 1


def cmd_matrix(args: argparse.Namespace) -> int:
    """The drafter matrix (flows/matrix.py), each drafter's verdict printed: 0 the matrix ran
    completely whatever the verdict (`--require-bars`: 1 on a failed bar), 1 incomplete."""
    from tasks.inventory.models import ConfigError
    from tasks.matrix.config import load_matrix

    path = Path(args.file)
    try:
        load_matrix(path)
    except ConfigError as e:
        return _bad_input(str(e))
    root, artifacts = artifacts_arg(args.artifacts, resolve=True)
    state, folder = run_flow("matrix", lambda: import_module("flows.matrix").matrix, artifacts,
                             matrix_file=str(path.resolve()), artifacts_root=root)
    if (code := interrupted_exit(state, folder, "matrix")) is not None:
        return code
    from tasks.record.manifest import MatrixVerdict, read_manifest
    from tasks.record.progress import closing, say

    matrix = read_manifest(folder).flow.matrix if folder else None
    verdict = (matrix.verdict if matrix else None) or MatrixVerdict(complete=False)
    for name, d in verdict.drafters.items():
        if d["checks"]:
            colour = "green" if d["verdict"] == "PASSED" else "red"
            say(f"drafter [bold]{name}[/bold]: [{colour}]{d['verdict']}[/{colour}] "
                f"({d['passed']} passed, {d['failed']} failed, {d['no_data']} not measured of {d['checks']} checks)")
    if not closing(state, folder, f"matrix complete: {state.message}", "matrix incomplete"):
        return 1
    return 1 if args.require_bars and verdict.bars_failed else 0


def _tool_lanes(args: argparse.Namespace) -> list[str] | str:
    """`lanebench tools`: the lanes to run, or the one-line problem with them."""
    if isinstance(inventory := inventory_of(Path(args.hosts), args.lane, files=True), str):
        return inventory
    hosts = Path(args.hosts)
    gated = [n for n, lane in inventory.lanes.items() if lane.correctness and lane.correctness.tool_gate]
    names = args.lane or gated
    for name in names:
        if name not in gated:
            return (f"{hosts}: lanes.{name}.correctness.tool_gate: the lane declares no tool gate. "
                    "Fix: add correctness: {tool_gate: {dev: <suite.jsonl>}} (toolsuites/README.md)")
        if args.held_out and inventory.lanes[name].correctness.tool_gate.held_out is None:
            return (f"{hosts}: lanes.{name}.correctness.tool_gate.held_out: --held-out asked, but the lane "
                    "declares no held-out suite. Fix: add held_out: <suite.jsonl>, or run without --held-out")
    if not names:
        return f"{hosts}: no lane declares correctness.tool_gate. Fix: add one (toolsuites/README.md)"
    return names


def cmd_tools(args: argparse.Namespace) -> int:
    """The tool-gate flow (`tools` of flows/nightly.py), each gate's verdict printed; exit codes as the nightly's."""
    if isinstance(names := _tool_lanes(args), str):
        return _bad_input(names)
    artifacts = Path(args.artifacts).resolve()
    state, folder = run_flow("tools", lambda: import_module("flows.nightly").tools, artifacts,
                             hosts=str(Path(args.hosts).resolve()), lanes=names,
                             artifacts_root=str(artifacts), held_out=args.held_out)
    from tasks.record.progress import closing_verdict, say

    if folder:
        from tasks.record.manifest import read_manifest

        for lane, entry in read_manifest(folder).flow.correctness.items():
            for gate in entry.gates:
                colour = "green" if gate.passed else "red"
                say(f"[bold]{lane}[/bold] [{colour}]{gate.gate}[/{colour}]: {gate.detail}")
    return closing_verdict(state, folder, "tools")


def cmd_lab(args: argparse.Namespace) -> int:
    """`lanebench lab ...`: the users' topology as network namespaces (lab/README.md). `status`
    exits 1 when the lab is not (fully) up; one lab per machine, held by a test session too."""
    from lab.lab import Lab, LabError, lab_lock
    from lab.netns import NetnsError

    lab = Lab(say=lambda line: print(line, flush=True))
    try:
        if args.action == "status":
            ok, lines = lab.status()
            print("\n".join(lines))
            return 0 if ok else 1
        with lab_lock():
            return _lab_locked(lab, args.action)
    except (LabError, NetnsError) as e:
        print(f"lanebench: error: {e}", file=sys.stderr)
        return 1


def _lab_locked(lab: Any, action: str) -> int:  # lab: lab.lab.Lab (imported lazily)
    if action == "up":
        lab.up()
        ok, lines = lab.status()
        print("\n".join(lines))
        return 0 if ok else 1
    if action == "down":
        lab.down()
        left = lab.leftovers()
        print("lab: down" if not left else f"lab: still present: {', '.join(left)}")
        return 0 if not left else 1
    if not lab.state().get("complete"):
        print("lanebench: error: the lab is not up. Fix: run `lanebench lab up` first", file=sys.stderr)
        return 2
    lab.cut_link() if action == "cut-link" else lab.restore_link()
    print("\n".join(line for line in lab.status()[1] if line.startswith("direct link")))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lanebench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("nightly", help="run every lane (or the named ones) through the lane flow")
    p.add_argument("--hosts", default=str(DEFAULT_HOSTS), help="inventory file (default: the shipped hosts.yaml)")
    p.add_argument("--lane", action="append", help="run only this lane (repeatable)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"),
                   help="folder that receives the run folder, or a store URL (sftp://host/path) it is published to")
    p.set_defaults(func=cmd_nightly)
    artifacts_help = "folder that receives the run folder"
    p = sub.add_parser("kl", help="KL gate: score candidates teacher-forced against a reference lane")
    p.add_argument("file", help="KL file (e.g. kl/rehearsal.yaml)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"), help=artifacts_help)
    p.add_argument("--prompt-count", type=int, default=None,
                   help="score only the first N prompts (a quick check; the report says so)")
    p.set_defaults(func=cmd_kl)
    p = sub.add_parser("matrix", help="drafter matrix: drafters x K x prompt class, judged against registered bars")
    p.add_argument("file", help="matrix file (e.g. matrix/rehearsal.yaml)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"), help=artifacts_help)
    p.add_argument("--require-bars", action="store_true",
                   help="exit 1 when any bar fails (default: a failed bar is a verdict, exit 0)")
    p.set_defaults(func=cmd_matrix)
    p = sub.add_parser("tools", help="tool-call gate: boot each lane with a tool gate, smoke it, grade its suites")
    p.add_argument("--hosts", default=str(DEFAULT_HOSTS), help="inventory file (default: the shipped hosts.yaml)")
    p.add_argument("--lane", action="append", help="run only this lane (repeatable; default: every lane with a tool gate)")
    p.add_argument("--held-out", action="store_true",
                   help="also run the held-out suite (each run is counted in the manifest)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"), help=artifacts_help)
    p.set_defaults(func=cmd_tools)
    p = sub.add_parser("lab", help="the host lab: GB300 and a Spark pair as network namespaces (root)",
                       description="`lanebench lab`: the users' topology (GB300, a Spark pair, a direct cable) on this machine.")
    p.add_argument("action", choices=("up", "down", "status", "cut-link", "restore-link"),
                   help="up | down | status | cut-link | restore-link")
    p.set_defaults(func=cmd_lab)
    for module in _SUBCOMMANDS:
        import_module(module).register_cli(sub)
    args = parser.parse_args(argv)
    _quiet_prefect()  # before any command's checks import a module that imports Prefect
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("lanebench: interrupted; what was measured so far is in the run folder", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The `lanebench` script: `main`, then exit without the interpreter's teardown: freeing
    Prefect's, pandas' and GX's objects took 1.5 s after the last line (docs/benchmarks.md). The
    atexit and log handlers still run."""
    code = main()
    atexit._run_exitfuncs()  # what a normal exit runs first (logging.shutdown among them)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a reader that went away (`lanebench history runs | head`)
            pass
    os._exit(code)
