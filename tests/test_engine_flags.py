"""Every flag the SGLang and vLLM adapters emit exists in the pinned release's own argument definitions.

The definitions come from the release's wheel, read with `ast` and never imported
(tasks/engines/release_flags.py); `scripts/engine-flags.py` writes them, with the sha256 of
each source file, to tasks/engines/flags/. When the wheel is cached (~/.cache/lanebench/wheels,
where the script puts it) the list is extracted again and must match what is committed.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from tasks.engines import engine_for, release_flags
from tasks.engines.releases import PINNED
from tasks.inventory.models import Agentic, Lane

METHODS = {"sglang": ["EAGLE", "EAGLE3", "NEXTN", "draft-simple", "DFLASH", "DSPARK", "NGRAM"],
           "vllm": ["eagle3", "dflash", "draft-simple", "mtp", "ngram", "dspark"]}


def emitted(engine_name: str) -> list[list[str]]:
    """Every argv shape the adapter builds: plain, each speculative method, agentic, each node rank."""
    engine = engine_for(engine_name)
    base = {"host": "h", "engine": engine_name, "model": {"path": "/m"}, "bench": {"decode": {"prompts": "p.jsonl"}}}
    lanes = [Lane.model_validate(base)]
    for method in METHODS[engine_name]:
        drafter = {} if method.lower() == "ngram" else {"drafter": {"path": "/d"}}
        lanes.append(Lane.model_validate({**base, **drafter, "speculative": {"method": method, "k": 4}}))
    argvs = []
    for lane in lanes:
        argv = engine.launch_command(lane, "bin", "0.0.0.0")
        argvs.append(argv)
        for rank in (0, 1):
            argvs.append(argv + engine.node_flags(rank, 2, "10.0.0.1", 29501))
    agentic = Agentic(tools=True, reasoning=True, tool_parser="glm47", reasoning_parser="glm45", chat_template="t.jinja")
    argvs.append(engine.agentic_flags(agentic, "/t.jinja"))
    return argvs


def test_adapters_emit_only_flags_the_pinned_release_defines():
    for engine_name, version in PINNED.items():
        known = release_flags.load(engine_name, version)
        assert known is not None, f"no flag list for {engine_name} {version}: run scripts/engine-flags.py --all"
        assert known.version == version and known.sources and all(len(h) == 64 for h in known.sources.values())
        for argv in emitted(engine_name):
            assert release_flags.unknown_flags(argv, known) == [], (engine_name, argv)
        # The check can fail: a made-up flag, and one each release no longer (or never) had.
        assert release_flags.unknown_flags(["--max-num-seqs-typo", "--stream-output"], known) == \
            ["--max-num-seqs-typo", "--stream-output"]


def test_vllm_boolean_flags_take_their_no_form_and_equals_values():
    known = release_flags.load("vllm", PINNED["vllm"])
    assert known is not None
    assert release_flags.unknown_flags(["--no-enforce-eager", "--max-model-len=4096", "--headless"], known) == []


def test_extraction_reads_each_declaration_shape_without_importing(tmp_path):
    """A wheel holding the shapes SGLang 0.5.23 and vLLM 0.33.0 declare flags with (nothing importable)."""
    sglang = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(sglang, "w") as z:
        z.writestr("sglang/srt/server_args.py", "import nothing_that_exists\n"
                   "def add_cli_args(parser):\n    parser.add_argument('--config', type=str)\n")
        z.writestr("sglang/srt/arg_groups/fields/parallel.py",
                   "class Parallel(msgspec.Struct):\n"
                   "    nnodes: A[int, 'The number of nodes.'] = 1\n"
                   "    tp_size: A[int, Arg(help='tp', aliases=['--tensor-parallel-size'])] = 1\n"
                   "    hidden: A[int, Arg(no_cli=True)] = 0\n"
                   "    fp8: A[str, Arg(cli_name='--fp8-gemm-backend')] = 'auto'\n"
                   "    derived = Derived(doc='not a flag')\n")
    found = release_flags.extract("sglang", sglang)
    assert found.version == "9.9.9" and set(found.sources) == {"sglang/srt/server_args.py",
                                                               "sglang/srt/arg_groups/fields/parallel.py"}
    assert found.flags == ["--config", "--fp8-gemm-backend", "--nnodes", "--tensor-parallel-size", "--tp-size"]
    vllm = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(vllm, "w") as z:
        z.writestr("vllm/engine/arg_utils.py", "def f(g, kw):\n    g.add_argument('--nnodes', '-n', **kw['nnodes'])\n")
        z.writestr("vllm/entrypoints/common/cli_args.py",
                   "class FrontendArgs(BaseFrontendArgs):\n    host: str | None = None\n    _private: int = 0\n"
                   "class Other:\n    not_a_flag: int = 0\n")
    assert release_flags.extract("vllm", vllm).flags == ["--host", "--nnodes"]


def test_the_committed_lists_match_the_cached_wheels():
    """Re-extracted from the wheel where one is cached; otherwise the committed list names its wheel."""
    for engine_name, version in PINNED.items():
        known = release_flags.load(engine_name, version)
        assert known is not None and known.wheel.startswith(f"{engine_name}-{version}-")
        wheel = release_flags.cached_wheel(engine_name, version)
        if wheel is None:  # CI: no 336 MB download; `scripts/engine-flags.py --all` puts the wheels there
            continue
        fresh = release_flags.extract(engine_name, wheel)
        assert fresh.wheel_sha256 == known.wheel_sha256, f"{wheel} is not the wheel the list was made from"
        assert fresh.sources == known.sources and fresh.flags == known.flags


def test_the_flag_lists_are_where_the_script_writes_them():
    assert release_flags.FLAGS_DIR == Path(release_flags.__file__).parent / "flags"
    assert sorted(p.name for p in release_flags.FLAGS_DIR.glob("*.json")) == \
        sorted(f"{e}-{v}.json" for e, v in PINNED.items())


def test_boolean_flags_carry_the_inverses_their_action_adds(tmp_path):
    """argparse's BooleanOptionalAction adds --no-x; vLLM's parser swaps in EnableDisableAction,
    which also pairs --enable-y with --disable-y. Which vLLM flags are boolean comes from the
    config dataclass field type that get_kwargs reads (a shape of each, nothing importable)."""
    vllm = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(vllm, "w") as z:
        z.writestr("vllm/config/cache.py", "class CacheConfig:\n    enable_prefix_caching: bool | None = None\n"
                   "    block_size: int = 16\n    kv_offloading: bool | str | None = None\n")
        z.writestr("vllm/config/model.py", "class Base:\n    enforce_eager: bool = False\n"
                   "class ModelConfig(Base):\n    disable_sliding_window: 'bool' = False\n")
        z.writestr("vllm/engine/arg_utils.py",
                   "def add_cli_args(parser):\n"
                   "    cache_kwargs = get_kwargs(CacheConfig)\n    model_kwargs = get_kwargs(ModelConfig)\n"
                   "    parser.add_argument('--enable-prefix-caching', **{**cache_kwargs['enable_prefix_caching'], 'default': None})\n"
                   "    parser.add_argument('--block-size', **cache_kwargs['block_size'])\n"
                   "    parser.add_argument('--kv-offloading', **cache_kwargs['kv_offloading'])\n"
                   "    parser.add_argument('--enforce-eager', **model_kwargs['enforce_eager'])\n"
                   "    parser.add_argument('--disable-sliding-window', **model_kwargs['disable_sliding_window'])\n"
                   "    parser.add_argument('--async-scheduling', action=argparse.BooleanOptionalAction)\n")
        z.writestr("vllm/entrypoints/common/cli_args.py",
                   "class BaseFrontendArgs:\n    enable_auto_tool_choice: bool = False\n    host: str | None = None\n")
    assert release_flags.extract("vllm", vllm).flags == sorted([
        "--enable-prefix-caching", "--no-enable-prefix-caching", "--disable-prefix-caching",
        "--block-size", "--kv-offloading",
        "--enforce-eager", "--no-enforce-eager",
        "--disable-sliding-window", "--no-disable-sliding-window", "--enable-sliding-window",
        "--async-scheduling", "--no-async-scheduling",
        "--enable-auto-tool-choice", "--no-enable-auto-tool-choice", "--disable-auto-tool-choice", "--host"])
    sglang = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(sglang, "w") as z:
        z.writestr("sglang/srt/arg_groups/fields/exec_.py",
                   "class Exec(msgspec.Struct):\n"
                   "    enable_tf32_matmul: A[bool, Arg(help='x', action=argparse.BooleanOptionalAction)] = True\n"
                   "    enable_metrics: A[bool, 'store_true: no inverse'] = False\n")
    assert release_flags.extract("sglang", sglang).flags == ["--enable-metrics", "--enable-tf32-matmul",
                                                              "--no-enable-tf32-matmul"]


def test_a_flag_the_release_accepts_is_never_refused():
    """Every inverse in the pinned lists is consistent with its action, and the flags the issue
    saw refused (vLLM's --disable-prefix-caching printed WOULD FAIL) are accepted."""
    vllm = release_flags.load("vllm", PINNED["vllm"])
    sglang = release_flags.load("sglang", PINNED["sglang"])
    assert vllm is not None and sglang is not None
    flags = set(vllm.flags)
    booleans = {f for f in flags if not f.startswith("--no-") and "--no-" + f[2:] in flags}
    for flag in booleans:  # EnableDisableAction: --enable-x <-> --disable-x
        for prefix, inverse in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
            if flag.startswith(prefix):
                assert inverse + flag.removeprefix(prefix) in flags, flag
    inverses = [f for f in flags - booleans if not f.startswith("--no-")
                and any(f.startswith(p) and q + f.removeprefix(p) in booleans
                        for p, q in (("--enable-", "--disable-"), ("--disable-", "--enable-")))]
    assert len(inverses) == 50  # vLLM 0.33.0's parser, as the issue counted it
    accepted = ["--disable-prefix-caching", "--no-enable-prefix-caching", "--enable-prefix-caching",
                "--disable-chunked-prefill", "--no-enforce-eager", "--disable-log-requests",
                "--no-enable-auto-tool-choice", "--speculative-config.num_speculative_tokens", "--max_num_seqs"]
    assert release_flags.unknown_flags(accepted, vllm) == []
    assert release_flags.unknown_flags(["--no-enable-tf32-matmul", "--speculative-draft-model"], sglang) == []
    # Not every flag has a --no- form: a value flag's is refused.
    assert release_flags.unknown_flags(["--no-host", "--no-max-model-len"], vllm) == ["--no-host", "--no-max-model-len"]
