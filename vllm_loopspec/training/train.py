"""Train a small Ouro on the Python standard library, on CPU.

    python -m vllm_loopspec.training.train --out checkpoints/ouro-stdlib

Objective (per batch, ``L_t`` = per-token LM loss of loop ``t``'s exit
``lm_head(h_t)``):

* LM: the uniform mean ``(1/R) Σ_t mean(L_t)``. Every loop gets the same
  weight, so every loop's exit is trained to be a usable predictor (what a
  loopspec drafter reads at loop ``d``), and no loop can starve the others.
* Exit gate: Ouro's expected loss under the learned exit distribution
  ``Σ_t p_t · L_t`` minus ``β·H(p)`` (entropy regulariser, β = 0.05), with the
  LM losses and the hidden states detached: this term trains only
  ``model.early_exit_gate`` and leaves the LM weighting uniform.

Plain PyTorch, AdamW with linear warm-up then cosine decay, fixed seed (the
batch of step ``s`` is drawn from a generator seeded by ``(seed, s)``, so a
resumed run sees the same batches), tqdm progress, the per-loop loss curve in
``<out>/train_log.json``, and a training state saved every ``--save-every``
steps under the cache dir (``--resume`` continues from it).
"""

from __future__ import annotations

import os

# Before torch loads libgomp: worker threads that spin at barriers are ruinous
# on a CPU shared with other jobs (a 48-token greedy run measured 120 s with
# spinning, 2 s passive, on this machine under load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vllm_loopspec.config import OuroConfig
from vllm_loopspec.reference import OuroReference
from vllm_loopspec.training.data import DEFAULT_CACHE, EOS_ID, ensure_cache_dir, held_out_windows, load_corpus
from vllm_loopspec.training.fast import fast_trace

SIZES: dict[str, dict] = {
    # hidden 256, 2 layers x 4 loops, GQA 4/2, head_dim 64: ~3.6M parameters (the shipped size)
    "h256l2": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # the same with 4 layers per loop: ~5.0M parameters, ~1.6x the step time
    "h256l4": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # for smoke tests of the trainer
    "micro": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32),
}


def tune_malloc() -> None:
    """Keep freed tensor memory in glibc's heap instead of unmapping it.

    Training allocates and frees the same multi-MB activations every step; by
    default glibc returns them to the kernel each time and the page faults cost
    several times the arithmetic (a 5x slower RMSNorm was measured here).
    Equivalent to MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_/MALLOC_TOP_PAD_.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 * 1024 * 1024)  # M_MMAP_THRESHOLD (glibc's maximum)
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD
        libc.mallopt(-2, 256 * 1024 * 1024)  # M_TOP_PAD
    except (OSError, AttributeError):
        pass


def build_config(size: str, vocab_size: int, loops: int, max_positions: int) -> OuroConfig:
    return OuroConfig(
        vocab_size=vocab_size,
        total_ut_steps=loops,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        early_exit_threshold=1.0,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        **SIZES[size],
    )


@torch.no_grad()
def init_weights(model: OuroReference, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n_blocks = 2 * model.config.num_hidden_layers * model.config.total_ut_steps
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 / math.sqrt(n_blocks))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def per_loop_losses(model: OuroReference, batch: torch.Tensor, bf16: bool = False):
    """(per-token losses [R, B, T], exit-state list) for next-token prediction."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = fast_trace(model, inputs)
        losses = []
        for h in hidden:
            logits = model.lm_head(h).float()
            losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape))
    return torch.stack(losses), hidden


def objective(model: OuroReference, batch: torch.Tensor, beta: float, bf16: bool = False):
    losses, hidden = per_loop_losses(model, batch, bf16)
    lm = losses.mean()
    p = model.exit_probabilities([h.detach().float() for h in hidden])  # [R, B, T]
    expected = (p * losses.detach()).sum(0).mean()
    entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(0).mean()
    total = lm + expected - beta * entropy
    stats = {
        "loss_per_loop": [float(x) for x in losses.detach().mean((1, 2))],
        "lm_loss": float(lm.detach()),
        "gate_expected_loss": float(expected.detach()),
        "gate_entropy": float(entropy.detach()),
        "exit_prob_mean": [float(x) for x in p.detach().mean((1, 2))],
    }
    return total, stats


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model: OuroReference, lr: float, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and "embed_tokens" not in name else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )


def sample_batch(stream: np.ndarray, batch: int, context: int, seed: int, step: int) -> torch.Tensor:
    gen = np.random.default_rng([seed, step])
    starts = gen.integers(0, stream.size - context - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s: s + context + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def held_out_loss(model: OuroReference, windows: torch.Tensor, batch: int = 16) -> list[float]:
    model.eval()
    tot = None
    for i in range(0, windows.shape[0], batch):
        losses, _ = per_loop_losses(model, windows[i: i + batch])
        s = losses.sum((1, 2))
        tot = s if tot is None else tot + s
    model.train()
    n = windows.shape[0] * (windows.shape[1] - 1)
    return [float(x) / n for x in tot]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="h256l2", choices=sorted(SIZES))
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-positions", type=int, default=2048, help="max_position_embeddings written to config.json")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=360)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.05, help="entropy weight of the exit-gate term")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (slower on CPUs without bf16 units)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=60)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--state", type=Path, default=None, help="training state file (default: <cache-dir>/state-<out name>.pt)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-after", type=int, default=None, help="stop (with a saved state) after this step; for timing")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    tune_malloc()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cache = ensure_cache_dir(args.cache_dir)
    state_path = args.state or cache / f"state-{args.out.name}.pt"

    corpus = load_corpus(args.vocab, cache)
    train_stream = corpus.train
    val = torch.from_numpy(held_out_windows(corpus.held_out, args.context + 1, args.eval_windows))

    cfg = build_config(args.size, args.vocab, args.loops, args.max_positions)
    model = OuroReference(cfg)
    init_weights(model, args.seed)
    model.train()
    opt = make_optimizer(model, args.lr, args.weight_decay)
    n_params = sum(p.numel() for p in model.parameters())

    step, elapsed, log, evals = 0, 0.0, [], []
    if args.resume and state_path.exists():
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        if st["args"]["steps"] != args.steps or st["args"]["size"] != args.size:
            raise SystemExit(f"state {state_path} was made with different --steps/--size")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        step, elapsed, log, evals = st["step"], st["elapsed_s"], st["log"], st["evals"]
        print(f"resumed from {state_path} at step {step} ({elapsed:.0f}s trained)")
    elif args.resume:
        print(f"no state at {state_path}; starting fresh")

    def save_state():
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "elapsed_s": elapsed, "log": log, "evals": evals, "args": vars(args) | {"out": str(args.out)},
                    "config": cfg.to_dict()}, tmp)
        tmp.replace(state_path)

    def write_log():
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {
            "objective": "uniform mean of per-loop LM loss + exit-gate expected loss (detached) - beta*entropy",
            "beta": args.beta, "num_params": n_params, "config": SIZES[args.size] | {"vocab_size": args.vocab, "total_ut_steps": args.loops},
            "context": args.context, "batch": args.batch, "steps": args.steps, "lr": args.lr, "seed": args.seed,
            "corpus": corpus.meta, "threads": args.threads, "elapsed_s": round(elapsed, 1),
            "train": log, "held_out": evals,
        }
        (args.out / "train_log.json").write_text(json.dumps(payload, indent=1) + "\n")

    print(f"params {n_params/1e6:.2f}M  train tokens {train_stream.size}  tokens/step {args.batch*args.context}")
    bar = tqdm(total=args.steps, initial=step, dynamic_ncols=True, mininterval=5)
    last = time.time()
    while step < args.steps:
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_batch(train_stream, args.batch, args.context, args.seed, step)
        loss, stats = objective(model, batch, args.beta, args.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        now = time.time()
        elapsed += now - last
        last = now
        if step % args.log_every == 0 or step == args.steps:
            log.append({"step": step, "lr": lr, "grad_norm": float(gnorm), "elapsed_s": round(elapsed, 1),
                        "tokens": step * args.batch * args.context} | stats)
            bar.set_postfix(loss=" ".join(f"{x:.2f}" for x in stats["loss_per_loop"]), s_per_step=f"{elapsed/step:.2f}" if step else "")
        if step % args.eval_every == 0 or step == args.steps:
            ev = held_out_loss(model, val)
            evals.append({"step": step, "elapsed_s": round(elapsed, 1), "loss_per_loop": ev})
            tqdm.write(f"step {step} held-out loss per loop: " + " ".join(f"{x:.3f}" for x in ev))
            last = time.time()  # eval time is not training time
        if step % args.save_every == 0 or step == args.steps:
            save_state()
            write_log()
            last = time.time()
        bar.update(1)
        if args.stop_after is not None and step >= args.stop_after:
            break
    bar.close()
    write_log()
    if step < args.steps:
        print(f"stopped at step {step}; state in {state_path}")
        return

    from vllm_loopspec.tools.tokenizer import save_tokenizer

    model.eval()
    model.save_pretrained(args.out, dtype=torch.bfloat16)
    save_tokenizer(corpus.tokenizer, args.out, args.max_positions)
    (args.out / "training_args.json").write_text(json.dumps(vars(args) | {"out": str(args.out), "cache_dir": str(args.cache_dir), "state": str(state_path)}, indent=2, default=str) + "\n")
    print(f"done: {step} steps, {elapsed:.0f}s training; checkpoint in {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
