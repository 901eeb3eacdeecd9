"""A random-weight F16 llama model of 1-3 B parameters, for a decode curve that means something.

The shipped testbed target is 1.9 M parameters: on a GPU its decode is bound by kernel launches,
not by memory, so its share of the bandwidth limit says nothing. A model of a few GB read per
token is bound by memory like the models lanes serve. Its weights are random (what it writes is
noise; speed does not depend on what the weights say), its vocabulary, tokenizer and chat
template are the testbed target's, copied from its GGUF, so the testbed prompts work.

    python testbed/random_model.py --params 1.5e9 --out /tmp/random-1.5b-f16.gguf
    (or: python testbed/build_models.py --random-params 1.5e9 --out DIR)

Numpy and the `gguf` package only; a few seconds per GB. Not shipped: generate it where it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TESTBED_TARGET = HERE / "models" / "target-f16.gguf"
# A Llama-1B-like body: width 2048, head size 128 (CUDA flash attention has kernels for it),
# SwiGLU width 5632; the layer count sets the size (~51 M parameters per layer). `--width 4096`
# is a Llama-8B-like body (32 heads of 128, SwiGLU 14336, ~243 M parameters per layer): at 32
# layers its ~16 GB F16 step is bound by memory, not by kernel launches.
N_EMBD, N_CTX = 2048, 4096
BODIES = {2048: (16, 5632), 4096: (32, 14336)}  # width -> heads, SwiGLU width


def layers_for(params: float, width: int = N_EMBD) -> int:
    """Layers of about `params` parameters in all: each has four attention, three SwiGLU matrices and two norms."""
    return max(1, round(params / (4 * width * width + 3 * width * BODIES[width][1] + 2 * width)))


def write_llama(path: Path, name: str, description: str, *, n_ctx: int, n_embd: int, n_layer: int, n_ff: int,
                n_head: int, rope_base: float, norm_eps: float, vocab: dict[str, Any],
                tensors: Iterable[tuple[str, np.ndarray]]) -> int:
    """Write a llama GGUF (F16 file type) of `tensors`, written as given; returns the parameter count.
    `vocab`: GGUFWriter `add_<key>` calls in order (tokenizer_model .. eot_token_id, chat_template)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("name", name), ("description", description), ("context_length", n_ctx),
                       ("embedding_length", n_embd), ("block_count", n_layer), ("feed_forward_length", n_ff),
                       ("head_count", n_head), ("head_count_kv", n_head), ("rope_dimension_count", n_embd // n_head),
                       ("rope_freq_base", rope_base), ("layer_norm_rms_eps", norm_eps),
                       ("vocab_size", len(vocab["token_list"])),
                       ("file_type", gguf.LlamaFileType.MOSTLY_F16), ("quantization_version", gguf.GGML_QUANT_VERSION),
                       *((k, v) for k, v in vocab.items() if k != "chat_template"),
                       ("add_bos_token", True), ("add_eos_token", False), ("add_space_prefix", False),
                       ("chat_template", vocab["chat_template"])):
        getattr(w, f"add_{key}")(value)
    count = 0
    for tensor_name, array in tensors:
        w.add_tensor(tensor_name, array)
        count += array.size
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return count


def write_random_gguf(path: Path, params: float, seed: int = 0, like: Path = TESTBED_TARGET, width: int = N_EMBD,
                      layers: int | None = None, residual_scale: float = 1.0) -> int:
    """Write the model; returns its parameter count.

    Each tensor is a window of one seeded pool at an offset drawn from (seed, tensor name), so a
    model with fewer `layers` and the same seed and width has the SAME embedding, output and
    first layers: the target's own layers as its drafter. `residual_scale` scales what each layer
    adds to the residual stream (attn_output, ffn_down): small, and every depth predicts nearly
    the token the embedding alone predicts, so such a drafter is accepted almost always; the
    bytes read per step, what the GPU is measured on, are the same at any scale.
    """
    import zlib

    import gguf

    n_embd, (n_head, n_ff) = width, BODIES[width]
    src = gguf.GGUFReader(str(like))
    vocab = {key: src.fields[f"tokenizer.{field}"].contents() for key, field in (
        ("tokenizer_model", "ggml.model"), ("tokenizer_pre", "ggml.pre"), ("token_list", "ggml.tokens"),
        ("token_scores", "ggml.scores"), ("token_types", "ggml.token_type"), ("bos_token_id", "ggml.bos_token_id"),
        ("eos_token_id", "ggml.eos_token_id"), ("unk_token_id", "ggml.unknown_token_id"),
        ("eot_token_id", "ggml.eot_token_id"), ("chat_template", "chat_template"))}
    n_vocab, n_layer = len(vocab["token_list"]), layers if layers else layers_for(params, width)
    # One pool of N(0, 0.02) values, each tensor a window of it at a random offset: drawing
    # billions of normals would take minutes, and the GPU reads these bytes the same either way.
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(n_embd * n_ff + (1 << 20), dtype=np.float32) * 0.02).astype(np.float16)
    scaled = pool if residual_scale == 1.0 else (pool.astype(np.float32) * residual_scale).astype(np.float16)

    def matrix(name: str, rows: int, cols: int, src: np.ndarray = pool) -> tuple[str, np.ndarray]:
        start = int(np.random.default_rng([seed, zlib.crc32(name.encode())]).integers(0, src.size - rows * cols + 1))
        return name, src[start:start + rows * cols].reshape(rows, cols)

    def norm(name: str) -> tuple[str, np.ndarray]:
        return name, np.ones(n_embd, dtype=np.float32)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        yield matrix("token_embd.weight", n_vocab, n_embd)
        for i in range(n_layer):
            yield norm(f"blk.{i}.attn_norm.weight")
            for n in ("attn_q", "attn_k", "attn_v"):
                yield matrix(f"blk.{i}.{n}.weight", n_embd, n_embd)
            yield matrix(f"blk.{i}.attn_output.weight", n_embd, n_embd, scaled)
            yield norm(f"blk.{i}.ffn_norm.weight")
            yield matrix(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
            yield matrix(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
            yield matrix(f"blk.{i}.ffn_down.weight", n_embd, n_ff, scaled)
        yield norm("output_norm.weight")
        yield matrix("output.weight", n_vocab, n_embd)

    return write_llama(path, f"lanebench-random-{n_layer}l",
                       f"random weights, {n_layer} layers of width {n_embd}: a bandwidth test, not a language model",
                       n_ctx=N_CTX, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, rope_base=10000.0,
                       norm_eps=1e-5, vocab=vocab, tensors=tensors())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1.5e9, help="about how many parameters (default 1.5e9)")
    ap.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=int, default=N_EMBD, choices=sorted(BODIES),
                    help="2048 (Llama-1B-like, default) or 4096 (Llama-8B-like)")
    ap.add_argument("--layers", type=int, default=None,
                    help="this many layers, whatever --params says (a drafter: the target's first layers)")
    ap.add_argument("--residual-scale", type=float, default=1.0,
                    help="scale of what each layer adds to the residual stream (small: a shallow drafter agrees)")
    args = ap.parse_args(argv)
    n = write_random_gguf(args.out, args.params, args.seed, width=args.width, layers=args.layers,
                          residual_scale=args.residual_scale)
    print(f"{args.out}: {args.out.stat().st_size} bytes, {n:,} params, "
          f"{args.layers or layers_for(args.params, args.width)} layers of width {args.width}")


if __name__ == "__main__":
    main()
