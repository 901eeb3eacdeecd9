"""The testbed's GGUF models as Hugging Face Llama folders, for engines that load that format
(vLLM's CPU build in hosts.vllm.yaml): the same weights, so a vLLM lane and a llama.cpp lane of
one model differ only in the engine.

    python testbed/to_hf.py [--out testbed/models/hf] [--check]

Runs in the vLLM environment (scripts/setup-vllm-cpu.sh). Each folder holds `model.safetensors`
(float32: the F16 matrices widened exactly, so the engine's own dtype choice is what a KL gate
measures), config, generation config and tokenizer files.

- RoPE: the testbed (llama.cpp's NORM rope) turns adjacent pairs (2i, 2i+1), HF's Llama (i, i + d/2):
  attn_q and attn_k rows are reordered per head (the inverse of llama.cpp's HF-to-GGUF permutation).
- Tokenizer: byte-level SentencePiece in HF terms is a BPE with no merges whose only pieces are
  "\u2581" and the control tokens, byte fallback for the rest, a normalizer turning " " into
  "\u2581" and "<s>" in front (add_bos_token). tokenizer.json is written here as sorted-key JSON,
  not by the tokenizers library, so its bytes do not move with that library's release; the
  library must then encode every testbed prompt exactly as build_models.encode does.
- Every file's sha256 is pinned in testbed/models/hf.sha256: a conversion writing other bytes fails.
- Fidelity: HF logits against the testbed's own torch model on held-out prompts, both float64:
  max |diff| under 2.5e-4 (the two sides' float32 RoPE tables) and identical greedy picks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import build_models as bm  # noqa: E402  (testbed/ on sys.path, as build_models expects)

MODELS = {"target": "target-f16.gguf", "drafter-good": "drafter-good-f16.gguf", "drafter-weak": "drafter-weak-f16.gguf"}
PINS = HERE / "models" / "hf.sha256"
# Both sides keep RoPE tables in float32 (the testbed as llama.cpp does, HF its inv_freq), rounded
# differently: the gap grows with position, ~5e-7 on the first tokens, ~1e-4 near 400 (logits ~20).
LOGIT_TOLERANCE = 2.5e-4
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def hf_state_dict(model: "bm.Llama") -> dict:
    """The testbed model's weights under HF LlamaForCausalLM names, q/k rows in HF's rope order."""
    import numpy as np

    cfg = model.cfg
    H, D, E = cfg.n_head, cfg.head_dim, cfg.n_embd

    def arr(t) -> "np.ndarray":
        return np.ascontiguousarray(t.detach().float().numpy())

    def rope_rows(w: "np.ndarray") -> "np.ndarray":
        # per head: rows (0, 2, 4, ..., 1, 3, 5, ...) -> pair (2i, 2i+1) becomes (i, i + D/2)
        return np.ascontiguousarray(w.reshape(H, D // 2, 2, E).transpose(0, 2, 1, 3).reshape(H * D, E))

    sd = {"model.embed_tokens.weight": arr(model.token_embd.weight),
          "model.norm.weight": arr(model.output_norm.weight),
          "lm_head.weight": arr(model.output.weight)}
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i, block in enumerate(model.blocks):
        for ours, theirs in names.items():
            w = arr(getattr(block, ours).weight)
            sd[f"model.layers.{i}.{theirs}.weight"] = rope_rows(w) if ours in ("attn_q", "attn_k") else w
    return sd


def config(model: "bm.Llama") -> dict:
    cfg = model.cfg
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.n_ff, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "rope_theta": cfg.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "vocab_size": cfg.n_vocab, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": bm.BOS, "eos_token_id": bm.EOS, "torch_dtype": "float32", "dtype": "float32",
    }


def tokenizer_json() -> dict:
    toks, types = bm.vocab_tokens()
    control = [i for i, t in enumerate(types) if t in (2, 3)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": toks[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i in control],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [bm.BOS], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(toks)}, "merges": []},
    }


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": (HERE / "chat" / "testbed.jinja").read_text(),
    }


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write(name: str, out: Path) -> None:
    from safetensors.numpy import save_file

    model = bm.load_gguf(HERE / "models" / MODELS[name])
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(hf_state_dict(model).items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_bytes(_json(config(model)))
    eos = [bm.EOS, bm.SPECIAL_IDS["<|im_end|>"]]  # llama.cpp stops on both (eos and eot)
    (out / "generation_config.json").write_bytes(_json({"bos_token_id": bm.BOS, "eos_token_id": eos}))
    (out / "tokenizer.json").write_bytes(_json(tokenizer_json()))
    (out / "tokenizer_config.json").write_bytes(_json(tokenizer_config()))


def digests(root: Path) -> dict[str, str]:
    return {f"{name}/{f}": hashlib.sha256((root / name / f).read_bytes()).hexdigest()
            for name in MODELS for f in FILES if (root / name / f).is_file()}


def pinned() -> dict[str, str]:
    return {rel: digest for digest, rel in (line.split() for line in PINS.read_text().splitlines() if line.strip())}


def check_fidelity(name: str, out: Path) -> str:
    """Tokenizer and logits against the testbed's own model; returns one line, raises on a miss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    prompts = [json.loads(line)["prompt"] for cls in ("prose", "code", "math", "tool")
               for line in (HERE / "prompts" / f"{cls}.jsonl").read_text().splitlines()[:4]]
    prompts.append("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>")
    for p in prompts:
        want = [bm.BOS] + bm.encode(p)
        got = tok(p)["input_ids"]
        if got != want:
            raise SystemExit(f"to_hf: {name}: tokenizer.json encodes {p[:40]!r} as {got[:12]}..., "
                             f"the GGUF vocabulary as {want[:12]}...")
        if tok.decode(want[1:]) != p:
            raise SystemExit(f"to_hf: {name}: tokenizer.json does not decode {p[:40]!r} back")
    # float64 on both sides: what is left is the conversion, not two float32 summation orders.
    ours = bm.load_gguf(HERE / "models" / MODELS[name]).double()
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64).eval()
    worst, flips = 0.0, 0
    with torch.no_grad():
        for p in prompts[:-1]:
            ids = torch.tensor([[bm.BOS] + bm.encode(p)])
            a, b = ours(ids), hf(ids).logits
            worst = max(worst, (a - b).abs().max().item())
            flips += int((a.argmax(-1) != b.argmax(-1)).sum().item())
    if worst > LOGIT_TOLERANCE or flips:
        raise SystemExit(f"to_hf: {name}: HF logits differ from the testbed model's by up to {worst:.2e} "
                         f"(tolerance {LOGIT_TOLERANCE:g}), {flips} greedy picks differ")
    return f"{name}: logits within {worst:.1e} of the GGUF model, greedy picks identical"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "models" / "hf")
    ap.add_argument("--check", action="store_true", help="verify an existing folder against the pins only")
    ap.add_argument("--pin", action="store_true", help="(maintainers) rewrite testbed/models/hf.sha256")
    args = ap.parse_args()
    if args.check:
        bad = {rel for rel, d in pinned().items() if digests(args.out).get(rel) != d}
        if bad:
            raise SystemExit(f"to_hf: {args.out}: {len(bad)} files differ from testbed/models/hf.sha256: {sorted(bad)[:3]}")
        return
    for name in MODELS:
        write(name, args.out / name)
        print(check_fidelity(name, args.out / name))
    found = digests(args.out)
    if args.pin:
        PINS.write_text("".join(f"{d}  {rel}\n" for rel, d in sorted(found.items())))
        return
    bad = sorted(rel for rel, d in pinned().items() if found.get(rel) != d)
    if bad:
        raise SystemExit(f"to_hf: the conversion wrote other bytes than testbed/models/hf.sha256 pins for "
                         f"{', '.join(bad)}: a library changed its output; compare, then --pin")


if __name__ == "__main__":
    main()
