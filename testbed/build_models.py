"""Train the lanebench testbed models and write them as llama.cpp GGUF files.

The rehearsal lane runs ``llama-server`` with real speculative decoding on a 2-core CPU box
with nothing downloaded, so this trains, from ``corpus.py``'s synthetic text, a ``llama``
target and two drafters of its vocabulary that agree with it to a different degree per text
class: ``models/target-f16.gguf``, ``models/drafter-good-f16.gguf`` (distilled on the target's
logits) and ``models/drafter-weak-f16.gguf`` (tiny, briefly trained on the text alone). It also
rewrites ``prompts/*.jsonl``, held out from exactly the training text.

torch is not a lanebench dependency: README.md's "Rebuild" gives its venv. The build is
deterministic (seeded data and init, deterministic algorithms, fixed threads and step
counts): two smoke builds (``--scale 0.02``, a few minutes) give byte-identical files.

Vocabulary (README.md's "Tokenizer"): SentencePiece-style with one BYTE token per byte.
llama.cpp's SPM tokenizer always rewrites " " as U+2581 before lookup, so the vocab holds
"\u2581" and a space is that one token: one byte of ASCII text is always one token.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import corpus  # testbed/ is on sys.path when this file is run as a script
import numpy as np
import torch
import random_model
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------- vocabulary

UNK, BOS, EOS = 0, 1, 2
BYTE0 = 3  # ids 3..258 are <0x00>..<0xFF>
SPACE = BYTE0 + 256  # "\u2581": what llama.cpp's SPM tokenizer turns every " " into
SPECIALS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                             "<think>", "</think>")
N_VOCAB = 288  # padded with <|reserved_N|> control tokens for later formats
SPECIAL_IDS: dict[str, int] = {s: SPACE + 1 + i for i, s in enumerate(SPECIALS)}
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vocab_tokens() -> tuple[list[str], list[int]]:
    """Token texts and llama.cpp token types (1 normal, 2 unknown, 3 control, 6 byte)."""
    toks = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", *SPECIALS]
    toks += [f"<|reserved_{i}|>" for i in range(N_VOCAB - len(toks))]
    return toks, [2, 3, 3] + [6] * 256 + [1] + [3] * (N_VOCAB - SPACE - 1)


_BYTE_IDS = np.arange(BYTE0, BYTE0 + 256, dtype=np.int64)
_BYTE_IDS[ord(" ")] = SPACE
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS))


def encode(text: str) -> list[int]:
    """Token ids as llama.cpp's tokenizer (parse_special=True, no BOS) yields them."""
    out: list[int] = []
    pos = 0
    for m in _SPECIAL_RE.finditer(text):
        out += _BYTE_IDS[np.frombuffer(text[pos:m.start()].encode(), np.uint8)].tolist()
        out.append(SPECIAL_IDS[m.group()])
        pos = m.end()
    out += _BYTE_IDS[np.frombuffer(text[pos:].encode(), np.uint8)].tolist()
    return out


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Config:
    """Hyper-parameters of one llama model (all row sizes are multiples of 32)."""

    name: str
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    n_ctx: int = 1024
    n_vocab: int = N_VOCAB
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def rope_tables(cfg: Config, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for llama.cpp's NORM rope: pair (2i, 2i+1) turns by pos * base^(-2i/d)."""
    d = cfg.head_dim
    inv = cfg.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs, matching GGML_ROPE_TYPE_NORM, so Q/K need no permutation."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        e, f = cfg.n_embd, cfg.n_ff
        self.cfg = cfg
        self.attn_norm = nn.RMSNorm(e, eps=cfg.norm_eps)
        self.attn_q = nn.Linear(e, e, bias=False)
        self.attn_k = nn.Linear(e, e, bias=False)
        self.attn_v = nn.Linear(e, e, bias=False)
        self.attn_output = nn.Linear(e, e, bias=False)
        self.ffn_norm = nn.RMSNorm(e, eps=cfg.norm_eps)
        self.ffn_gate = nn.Linear(e, f, bias=False)
        self.ffn_up = nn.Linear(e, f, bias=False)
        self.ffn_down = nn.Linear(f, e, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, E = x.shape
        H, D = self.cfg.n_head, self.cfg.head_dim
        h = self.attn_norm(x)
        q = apply_rope(self.attn_q(h).view(B, T, H, D), cos, sin).transpose(1, 2)
        k = apply_rope(self.attn_k(h).view(B, T, H, D), cos, sin).transpose(1, 2)
        v = self.attn_v(h).view(B, T, H, D).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_output(a.transpose(1, 2).reshape(B, T, E))
        h = self.ffn_norm(x)
        return x + self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))


class Llama(nn.Module):
    """The llama graph exactly as llama.cpp evaluates it (untied output, SwiGLU, RMSNorm)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embd = nn.Embedding(cfg.n_vocab, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.output_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.n_vocab, bias=False)
        cos, sin = rope_tables(cfg, cfg.n_ctx)
        self.register_buffer("cos", cos[:, None, :], persistent=False)  # [T, 1, D/2]
        self.register_buffer("sin", sin[:, None, :], persistent=False)
        self.apply(self._init)
        for b in self.blocks:  # GPT-2 style scaled init of residual projections
            for lin in (b.attn_output, b.ffn_down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.token_embd(idx)
        for b in self.blocks:
            x = b(x, self.cos[:T], self.sin[:T])
        return self.output(self.output_norm(x))

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


TARGET = Config("target", n_embd=192, n_layer=4, n_head=3, n_ff=512)
DRAFTER_GOOD = Config("drafter-good", n_embd=128, n_layer=2, n_head=4, n_ff=384)
DRAFTER_WEAK = Config("drafter-weak", n_embd=64, n_layer=1, n_head=2, n_ff=192)

# --------------------------------------------------------------------------- data


class Data:
    """All classes as one token stream of ``<s> doc </s>`` with document start offsets."""

    def __init__(self, bytes_per_class: int, seed: int, prompts_dir: Path | None = None
                 ) -> None:
        docs = corpus.training_docs(bytes_per_class)
        if prompts_dir is not None:  # held out from exactly this training text
            corpus.write_prompts(corpus.held_out_prompts(docs), prompts_dir)
        rng = np.random.default_rng(seed)
        flat = [d for cls in corpus.CLASSES for d in docs[cls]]
        order = rng.permutation(len(flat))  # interleave classes
        ids: list[int] = []
        starts: list[int] = []
        for i in order:
            starts.append(len(ids))
            ids += [BOS, *encode(flat[i]), EOS]
        self.tokens = torch.tensor(ids, dtype=torch.long)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.rng = rng

    def batch(self, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Half the rows start at a document's BOS, as prompts do, the rest anywhere."""
        hi = len(self.tokens) - T - 1
        n_doc = B // 2
        s = np.concatenate([
            np.minimum(self.rng.choice(self.starts, n_doc), hi),
            self.rng.integers(0, hi, B - n_doc),
        ])
        idx = torch.from_numpy(s)[:, None] + torch.arange(T + 1)[None, :]
        w = self.tokens[idx]
        return w[:, :-1], w[:, 1:]


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Recipe:
    """How one model is trained (``train``'s teacher, not the recipe, makes it a distillation)."""

    steps: int
    batch: int
    lr: float
    warmup: int = 100


def lr_at(step: int, r: Recipe) -> float:
    """Linear warmup then cosine decay to 10%."""
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    p = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train(cfg: Config, r: Recipe, data: Data, seed: int,
          teacher: Llama | None = None) -> Llama:
    """Train ``cfg``; with a teacher the loss is KL(teacher || student) over the vocab."""
    torch.manual_seed(seed)
    model = Llama(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": other, "weight_decay": 0.0}],
                            lr=r.lr, betas=(0.9, 0.95))
    T = cfg.n_ctx
    t0 = time.time()
    log_every = max(1, r.steps // 20)
    print(f"[{cfg.name}] {model.n_params():,} params, {r.steps} steps x {r.batch}x{T} tokens"
          f"{' (distilled)' if teacher is not None else ''}", flush=True)
    for step in range(r.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        x, y = data.batch(r.batch, T)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).float()
            if teacher is not None:
                with torch.no_grad():
                    tlog = teacher(x).float()
        if teacher is not None:
            loss = F.kl_div(F.log_softmax(logits, -1).view(-1, cfg.n_vocab),
                            F.log_softmax(tlog, -1).view(-1, cfg.n_vocab),
                            log_target=True, reduction="batchmean")
        else:
            loss = F.cross_entropy(logits.view(-1, cfg.n_vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == r.steps - 1:
            print(f"[{cfg.name}] step {step:5d} loss {loss.item():.4f} "
                  f"lr {lr_at(step, r):.2e} {time.time() - t0:6.0f}s", flush=True)
    model.eval()
    return model


@torch.no_grad()
def eval_loss(model: Llama, data: Data, batches: int = 8) -> float:
    """Mean next-token cross-entropy on fresh batches (nats per byte)."""
    tot = 0.0
    for _ in range(batches):
        x, y = data.batch(8, model.cfg.n_ctx)
        tot += F.cross_entropy(model(x).view(-1, model.cfg.n_vocab), y.reshape(-1)).item()
    return tot / batches


# --------------------------------------------------------------------------- GGUF


def write_gguf(model: Llama, path: Path, description: str) -> None:
    """Write ``model`` as a llama GGUF: F16 matrices, F32 norms, byte-level SPM vocab."""
    cfg = model.cfg
    toks, types = vocab_tokens()
    vocab = {"tokenizer_model": "llama", "tokenizer_pre": "default", "token_list": toks,
             "token_scores": [0.0] * len(toks), "token_types": types, "bos_token_id": BOS, "eos_token_id": EOS,
             "unk_token_id": UNK, "eot_token_id": SPECIAL_IDS["<|im_end|>"], "chat_template": CHAT_TEMPLATE}

    def put(name: str, t: torch.Tensor) -> tuple[str, np.ndarray]:
        a = t.detach().float().numpy()
        return name, a.astype(np.float32 if a.ndim == 1 else np.float16)

    blocks = [put(f"blk.{i}.{n}.weight", getattr(b, n).weight) for i, b in enumerate(model.blocks)
              for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                        "ffn_down")]
    random_model.write_llama(
        path, f"lanebench-testbed-{cfg.name}", description, n_ctx=cfg.n_ctx, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_ff=cfg.n_ff, n_head=cfg.n_head, rope_base=cfg.rope_base, norm_eps=cfg.norm_eps, vocab=vocab,
        tensors=[put("token_embd.weight", model.token_embd.weight), *blocks,
                 put("output_norm.weight", model.output_norm.weight), put("output.weight", model.output.weight)])


def load_gguf(path: Path) -> Llama:
    """Read a GGUF written by ``write_gguf`` back into a float32 torch model."""
    import gguf

    rd = gguf.GGUFReader(str(path))
    num = lambda key: rd.fields[key].contents()  # noqa: E731
    cfg = Config(
        name=path.stem.removesuffix("-f16"), n_embd=int(num("llama.embedding_length")),
        n_layer=int(num("llama.block_count")), n_head=int(num("llama.attention.head_count")),
        n_ff=int(num("llama.feed_forward_length")), n_ctx=int(num("llama.context_length")),
        rope_base=float(num("llama.rope.freq_base")),
        norm_eps=float(num("llama.attention.layer_norm_rms_epsilon")))
    model = Llama(cfg)
    sd = {}
    for t in rd.tensors:  # GGUF's blk.N.* are the torch model's blocks.N.*
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        sd[re.sub(r"^blk\.", "blocks.", t.name)] = torch.from_numpy(np.asarray(t.data, dtype=np.float32).reshape(shape).copy())
    model.load_state_dict(sd)
    return model.eval()


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description="Train the testbed models and write GGUF.")
    ap.add_argument("--out", type=Path, default=HERE / "models")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply all step counts (0.02 for a smoke build)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bytes-per-class", type=int, default=corpus.BYTES_PER_CLASS)
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--reuse-target", type=Path,
                    help="load the target from this GGUF instead of training it (for tuning "
                         "the drafters; the shipped build trains everything)")
    ap.add_argument("--random-params", type=float, metavar="N",
                    help="instead of training: write a random-weight F16 llama model of about N "
                         "parameters (1e9-3e9) to OUT/random-f16.gguf, for GPU decode curves "
                         "(testbed/random_model.py)")
    args = ap.parse_args()
    if args.random_params:
        args.out.mkdir(parents=True, exist_ok=True)
        random_model.main(["--params", str(args.random_params), "--out", str(args.out / "random-f16.gguf")])
        return
    if "OMP_WAIT_POLICY" not in os.environ:
        # Re-exec so OpenMP starts with waiting threads that sleep instead of spinning:
        # with anything else on the 2 cores, spinning made training 5-10x slower.
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    data = Data(args.bytes_per_class, args.seed,
                HERE / "prompts" if args.out == HERE / "models" else args.out / "prompts")
    print(f"data: {len(data.tokens):,} tokens, {len(data.starts):,} docs", flush=True)

    def steps(n: int) -> int:
        return max(10, int(n * args.scale))

    if args.reuse_target:
        target = load_gguf(args.reuse_target)
        data.rng = np.random.default_rng(args.seed + 100)  # not the target's batches
    else:
        target = train(TARGET, Recipe(steps(1200), 8, 2e-3), data, args.seed + 1)
    good = train(DRAFTER_GOOD, Recipe(steps(300), 8, 3e-3), data, args.seed + 2, teacher=target)
    weak = train(DRAFTER_WEAK, Recipe(steps(120), 4, 3e-3, warmup=20), data, args.seed + 3)

    for model, fname, desc in (
        (target, "target-f16.gguf", "lanebench testbed target (synthetic text)"),
        (good, "drafter-good-f16.gguf", "drafter distilled on the target's logits"),
        (weak, "drafter-weak-f16.gguf", "tiny, briefly trained drafter"),
    ):
        write_gguf(model, args.out / fname, desc)
        print(f"{fname}: {(args.out / fname).stat().st_size:,} bytes, "
              f"{model.n_params():,} params, eval loss {eval_loss(model, data):.3f} "
              f"nats/token, config {asdict(model.cfg)}", flush=True)
    print(f"done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
