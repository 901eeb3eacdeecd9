"""vLLM's argv read as 0.33.0 reads it, for the checks before boot: the draft width and the head's ports."""

from __future__ import annotations

import json

from tasks.engines.facts import DraftPlan
from tasks.engines.planned import int_flag


def draft_plan(argv: list[str]) -> DraftPlan | None:
    """K as vLLM will run an argv: `num_speculative_tokens` of the last `--speculative-config`
    JSON, with its dotted keys (`--speculative-config.num_speculative_tokens 5`) applied over it,
    as FlexibleArgumentParser merges them. A `speculative_token_tree` drafts a tree."""
    config: dict = {}
    for i, token in enumerate(argv):
        head, eq, tail = token.partition("=")
        name, dot, key = head.partition(".")
        if name.replace("_", "-") != "--speculative-config":
            continue
        value = tail if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if not dot:
            try:
                config = json.loads(value) if value.strip().startswith("{") else {}
            except json.JSONDecodeError:
                config = {}
        else:
            config[key] = value
    if "method" not in config and "num_speculative_tokens" not in config:
        return None
    k = config.get("num_speculative_tokens")
    k = int(k) if isinstance(k, int) or (isinstance(k, str) and k.isdigit()) else None
    tree = bool(config.get("speculative_token_tree"))
    return DraftPlan(method=config.get("method"), k=k, flag=f"--speculative-config num_speculative_tokens={k}",
                     tree=tree, shape="tree (speculative_token_tree)" if tree else "chain")


DP_RPC_PORT = 29550  # vllm/config/parallel.py `data_parallel_rpc_port`: "shared by all nodes"


def listen_ports(argv: list[str], rank: int, spans_nodes: bool) -> list[tuple[int, str]]:
    """The head's data-parallel RPC port, when data-parallel spans nodes or the flag is given (the headless
    nodes connect to it: vllm/entrypoints/cli/serve.py run_headless)."""
    given = int_flag(argv, "--data-parallel-rpc-port")
    dp = int_flag(argv, "--data-parallel-size", "-dp") or 1
    if rank != 0 or (given is None and not (dp > 1 and spans_nodes)):
        return []
    return [(given or DP_RPC_PORT, "--data-parallel-rpc-port")]
