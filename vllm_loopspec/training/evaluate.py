"""Held-out evaluation of an Ouro checkpoint, per loop; writes ``<ckpt>/eval.json``.

    python -m vllm_loopspec.training.evaluate checkpoints/ouro-stdlib

Everything is measured on the held-out split (every 20th stdlib file, see
:mod:`vllm_loopspec.training.data`), tokenised with the checkpoint's own
tokenizer, with the shipped (bf16) weights run in float32:

* teacher-forced: loss, perplexity and next-token accuracy of every loop's
  exit ``1..R``, and the agreement of loop ``d``'s argmax with loop ``R``'s
  argmax for every ``d < R``;
* along greedy continuations: full-depth (loop ``R``) greedy continuations of
  held-out prompts, and at every generated position the agreement of loop
  ``d``'s argmax with the token loop ``R`` chose. This is the acceptance rate a
  greedy loopspec drafter with ``draft_loops = d`` sees (the drafted prefix is
  always the target's own, so draft ``i`` is accepted exactly when loop ``d``
  agrees at every position up to ``i``); the simulated mean tokens per round
  for ``K`` draft tokens is reported too.
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

from vllm_loopspec.reference import OuroReference
from vllm_loopspec.training.data import encode_files, held_out_windows, split_files
from vllm_loopspec.training.fast import CachedGreedy, fast_trace


def held_out_stream(ckpt: Path) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    _, held = split_files()
    return encode_files(tok, held)


def spread_windows(stream: np.ndarray, length: int, count: int) -> np.ndarray:
    """``count`` windows of ``length`` ids spread evenly over ``stream``."""
    starts = np.linspace(0, stream.size - length - 1, count).astype(np.int64)
    return np.stack([stream[s: s + length] for s in starts]).astype(np.int64)


@torch.no_grad()
def teacher_forced(model: OuroReference, windows: torch.Tensor, batch: int = 16) -> dict:
    R = model.config.total_ut_steps
    loss_sum = torch.zeros(R, dtype=torch.float64)
    correct = torch.zeros(R, dtype=torch.float64)
    agree = torch.zeros(R, dtype=torch.float64)
    exit_p = torch.zeros(R, dtype=torch.float64)
    n = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch]
        inputs, targets = w[:, :-1], w[:, 1:]
        hidden = fast_trace(model, inputs)
        preds = []
        for t, h in enumerate(hidden):
            logits = model.lm_head(h).float()
            loss_sum[t] += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").double()
            pred = logits.argmax(-1)
            correct[t] += (pred == targets).sum().double()
            preds.append(pred)
        for t in range(R):
            agree[t] += (preds[t] == preds[-1]).sum().double()
        exit_p += model.exit_probabilities(hidden).sum((1, 2)).double()
        n += targets.numel()
    loss = (loss_sum / n).tolist()
    return {
        "tokens": n,
        "loss_per_loop": [round(x, 4) for x in loss],
        "ppl_per_loop": [round(math.exp(x), 2) for x in loss],
        "next_token_accuracy_per_loop": [round(x, 4) for x in (correct / n).tolist()],
        "argmax_agreement_with_loop_R": {str(d + 1): round(float(agree[d] / n), 4) for d in range(R - 1)},
        "mean_exit_probability_per_loop": [round(x, 4) for x in (exit_p / n).tolist()],
    }


def mean_tokens_per_round(agree: np.ndarray, k: int) -> float:
    """Greedy loopspec with ``k`` drafts along the target trajectory: from each
    round start, accepted = leading run of agreements (at most ``k``), emitted =
    accepted + 1 (correction or bonus). Rounds tile each continuation."""
    rounds = emitted = 0
    for row in agree:
        j = 0
        while j < row.size:
            acc = 0
            while acc < k and j + acc < row.size and row[j + acc]:
                acc += 1
            rounds += 1
            emitted += acc + 1
            j += acc + 1
    return emitted / rounds


@torch.no_grad()
def along_generation(model: OuroReference, prompts: torch.Tensor, new_tokens: int, tok=None) -> dict:
    R = model.config.total_ut_steps
    gen, logits = CachedGreedy(model).generate(prompts, new_tokens)  # [B, N], [R, B, N, V]
    preds = logits.argmax(-1)  # [R, B, N]
    assert torch.equal(preds[-1], gen)
    out = {"prompts": int(prompts.shape[0]), "prompt_tokens": int(prompts.shape[1]), "new_tokens": new_tokens}
    agreement, by_quarter, per_round = {}, {}, {}
    q = max(1, new_tokens // 4)
    for d in range(R - 1):
        a = (preds[d] == gen).numpy()
        agreement[str(d + 1)] = round(float(a.mean()), 4)
        by_quarter[str(d + 1)] = [round(float(a[:, s: s + q].mean()), 4) for s in range(0, new_tokens, q)]
        per_round[str(d + 1)] = {str(k): round(mean_tokens_per_round(a, k), 3) for k in (1, 2, 4, 8)}
    out["argmax_agreement_with_loop_R"] = agreement
    out["agreement_by_position_quarter"] = by_quarter
    out["simulated_greedy_loopspec_tokens_per_round"] = per_round
    distinct = [len(set(r)) for r in gen.tolist()]
    out["distinct_tokens_per_continuation"] = {"min": min(distinct), "mean": round(sum(distinct) / len(distinct), 1)}
    if tok is not None:
        out["examples"] = [
            {"prompt_tail": tok.decode(prompts[i, -48:].tolist()), "continuation": tok.decode(gen[i].tolist())}
            for i in range(min(3, prompts.shape[0]))
        ]
    return out, gen


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--windows", type=int, default=256, help="held-out windows for the teacher-forced numbers")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default: <ckpt>/eval.json")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    from vllm_loopspec.training.train import tune_malloc

    tune_malloc()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    model = OuroReference.from_pretrained(args.ckpt, dtype=torch.float32)
    tok = Tokenizer.from_file(str(args.ckpt / "tokenizer.json"))
    stream = held_out_stream(args.ckpt)

    windows = torch.from_numpy(held_out_windows(stream, args.context + 1, args.windows))
    tf = teacher_forced(model, windows)
    print("teacher-forced:", json.dumps(tf))

    # prompts: evenly spread over the held-out stream, offset from the teacher-forced windows' grid
    prompts = torch.from_numpy(spread_windows(stream, args.prompt_tokens, args.prompts))
    gen_stats, gen = along_generation(model, prompts, args.new_tokens, tok)

    # the cached decoder must reproduce the oracle's own greedy decoding
    oracle = model.greedy_generate(prompts[0].tolist(), 16)
    gen_stats["cached_decoder_matches_oracle_greedy_generate"] = oracle == gen[0, :16].tolist()
    print("along greedy continuations:", json.dumps({k: v for k, v in gen_stats.items() if k != "examples"}))

    R = model.config.total_ut_steps
    result = {
        "checkpoint": str(args.ckpt),
        "loops": R,
        "held_out": {
            "split": "stdlib files i % 20 == 10 (vllm_loopspec.training.data.split_files)",
            "stream_tokens": int(stream.size),
            "context": args.context,
        },
        "weights_dtype": "bfloat16 on disk, evaluated in float32",
        "teacher_forced": tf,
        "greedy_continuations": gen_stats,
        "eval_seconds": round(time.time() - t0, 1),
        "command": "python -m vllm_loopspec.training.evaluate " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
    }
    out = args.out or args.ckpt / "eval.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} in {result['eval_seconds']}s")


if __name__ == "__main__":
    main()
