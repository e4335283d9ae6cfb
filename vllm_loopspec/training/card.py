"""Write the model card, the loss-curve plot and ``sha256.json`` of a trained checkpoint.

    python -m vllm_loopspec.training.card checkpoints/ouro-stdlib --wall-s 2600

Reads ``train_log.json``, ``training_args.json``, ``config.json`` and
``eval.json`` (run :mod:`vllm_loopspec.training.evaluate` first) and, when
present, ``loopspec_calibration.json`` (:mod:`vllm_loopspec.tools.calibrate`;
the card gets a "Depth calibration" section), draws
``loss_curve.png`` when matplotlib is installed (``--keep-plot``: keep the
shipped one), writes ``README.md`` (with the
sha256 of every other shipped file) and finally ``sha256.json`` (every file in
the directory except itself, README included).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

CARD_NAME = "README.md"

SIZE_NOTES = {
    "h256l2": (
        "chosen from measured step times. The suggested shape (hidden 256, 4 layers per loop) took 12-45 s per "
        "16x256-token step here while other jobs shared the CPU (measured before the trainer set "
        "`OMP_WAIT_POLICY=PASSIVE`, which later cut step times about 3x under contention), i.e. well under half a "
        "million tokens in 45 minutes. Halving the layers per loop (2 layers x 4 loops = 8 layer applications, "
        "~0.6x the FLOPs per token) keeps the width, heads, GQA and vocab; in this early-training regime the loss "
        "is set by tokens seen far more than by parameters, and a shallow loop leaves room for later loops to add "
        "something, which is the loop structure this checkpoint is for. With the wait-policy fix the 4-layer "
        "shape would fit roughly 350 steps of this size in the same time (`--size h256l4`)."
    ),
}
SHA_NAME = "sha256.json"
CALIBRATION_NAME = "loopspec_calibration.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def plot(ckpt: Path, log: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train, held = log["train"], log["held_out"]
    R = len(train[0]["loss_per_loop"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for t in range(R):
        line, = ax.plot([r["step"] for r in train], [r["loss_per_loop"][t] for r in train],
                        lw=1, alpha=0.8, label=f"train loop {t + 1}")
        ax.plot([e["step"] for e in held], [e["loss_per_loop"][t] for e in held], "o--",
                color=line.get_color(), ms=3, lw=1, label=f"held-out loop {t + 1}")
    ax.set_xlabel("step")
    ax.set_ylabel("LM loss (nats/token)")
    ax.set_ylim(bottom=max(0.0, min(min(r["loss_per_loop"]) for r in train) - 0.3), top=min(8.6, ax.get_ylim()[1]))
    ax.set_title("ouro-stdlib: per-loop loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(ckpt / "loss_curve.png", metadata={"Software": None})
    plt.close(fig)
    return True


def fmt_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def calibration_lines(cal: dict) -> list[str]:
    """The card's "Depth calibration" section from ``loopspec_calibration.json``."""
    R = cal["loops"]
    ps = cal["prompt_set"]
    where = (f"{ps['windows']} held-out windows of {ps['context']} tokens" if ps["kind"] == "held-out"
             else f"{ps['prompts']} prompts from {', '.join(f'`{f}`' for f in ps['files'])}")
    lines = [
        "## Depth calibration",
        "",
        f"`{cal['command']}` -> `{CALIBRATION_NAME}` ({cal['date']}): teacher-forced, {cal['positions']:,} positions "
        f"({where}), temperature {cal['temperature']:g}. Per loop `r`, the total-variation distance between the "
        f"next-token distributions of loop `r` and loop `R = {R}` (a sampled draft's rejection probability) and the "
        "greedy agreement (argmax equal), with the power law `E[TV] ~ beta r^-alpha` fitted to them:",
        "",
        fmt_row(["loop r", "mean TV", "agreement", "fitted TV", "upper bound"]),
        fmt_row(["---"] * 5),
    ]
    for row in cal["per_loop"]:
        lines.append(fmt_row([row["r"], f"{row['mean_tv']:.4f}", f"{row['agreement']:.4f}",
                              f"{row.get('fitted_tv', float('nan')):.4f}", f"{row.get('bound_tv', float('nan')):.4f}"]))
    fit, cf, d, pr = cal.get("fit"), cal.get("closed_form"), cal["depths"], cal["predicted"]
    if fit:
        lines += [
            "",
            f"Least squares in log space: alpha = {fit['alpha']:.3f}, beta = {fit['beta']:.4f}, R^2 = {fit['r2_log']:.3f}"
            + (f"; the fitted curve falls below the measurement at some loop, so beta is raised to "
               f"{fit['beta_bound']:.4f} for an upper bound." if fit["beta_raised_for_bound"] else
               "; the fitted curve bounds every loop from above."),
            f"LoopSpec's closed form (arXiv 2609.17184, Theorem 2) with that bound gives d1* = {cf['d1']:.2f}, "
            f"d2* = {cf['d2']:.2f}; the best integer pair under the same bound is **d1* = {d['d1']}, d2* = {d['d2']}**"
            + (f" (the measured acceptances favour {tuple(d['measured_best']['greedy'])} greedy, "
               f"{tuple(d['measured_best']['sampled'])} sampled)." if "measured_best" in d else "."),
        ]
    lines += [
        f"Predicted speedup of a pipelined schedule in loop passes (a tick over all in-flight tokens costs one pass; "
        f"no step overheads): ceiling R/d1 = {pr['ceiling_R_over_d1']:.2f}x"
        + (f", {pr['bound']['speedup']:.2f}x from the bound" if "bound" in pr else "")
        + f", {pr['greedy_measured']['speedup']:.2f}x greedy and {pr['sampled_measured']['speedup']:.2f}x sampled "
          f"from the measured acceptances (first proposal only: {pr['first_proposal_only']['greedy_speedup']:.2f}x / "
          f"{pr['first_proposal_only']['sampled_speedup']:.2f}x).",
        """`--speculative-config '{"method":"loopspec","draft_loops":"auto"}'` """
        f"drafts with d = d1* = {d['d1']} "
        f"on this checkpoint; without `draft_loops` loopspec keeps R // 2 = {R // 2}. The model and its assumptions: "
        "`vllm_loopspec/tools/calibrate.py`.",
        "",
    ]
    return lines


def card_text(ckpt: Path, log: dict, args: dict, cfg: dict, ev: dict, wall_s: float | None, has_plot: bool,
              hashes: dict, note: str | None = None, cal: dict | None = None) -> str:
    R = cfg["total_ut_steps"]
    tf, gen = ev["teacher_forced"], ev["greedy_continuations"]
    corpus = log["corpus"]
    steps, batch, ctx = args["steps"], args["batch"], args["context"]
    tokens = steps * batch * ctx
    train_s = log["elapsed_s"]
    reproduce = (
        f"python -m vllm_loopspec.training.train --out {args['out']} --size {args['size']} --steps {steps} "
        f"--batch {batch} --context {ctx} --lr {args['lr']} --warmup {args['warmup']} --eval-every {args['eval_every']} "
        f"--seed {args['seed']} --resume"
    )
    lines = [
        "# ouro-stdlib: a small trained Ouro looped LM (Python standard library)",
        "",
        "A from-scratch [Ouro](https://arxiv.org/abs/2510.25741)-architecture looped decoder, trained on CPU on the",
        "Python standard library's own source so that its loops behave like a trained looped LM's: deeper loops",
        "predict better, and loop `d`'s argmax agrees with loop `R`'s often but not always. It exists to test and",
        "benchmark `vllm_loopspec` (serving and loopspec self-speculation) with real, non-random loop agreement.",
        "It is a tiny research artefact, not a useful code model.",
        "",
        "## Model",
        "",
        f"* `model_type: \"ouro\"`, `architectures: [\"OuroForCausalLM\"]`; {cfg['num_hidden_layers']} layers applied "
        f"`total_ut_steps = R = {R}` times (each loop has its own KV), hidden {cfg['hidden_size']}, intermediate "
        f"{cfg['intermediate_size']}, {cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, "
        f"head_dim {cfg['head_dim']}, vocab {cfg['vocab_size']}, RoPE theta {cfg['rope_theta']:g}, untied `lm_head`, "
        f"early-exit gate trained (`early_exit_threshold` 1.0 = always all loops).",
        f"* {log['num_params'] / 1e6:.2f}M parameters, stored as bfloat16 safetensors "
        f"({(ckpt / 'model.safetensors').stat().st_size / 1e6:.1f} MB).",
        f"* `eos_token_id = bos = pad = 0` (`<|endoftext|>`); `<|im_start|>`/`<|im_end|>` are ids 1/2 (ChatML "
        f"template in `tokenizer_config.json`, never seen in training).",
        f"* Trained with a context of {ctx} tokens. `max_position_embeddings` is {cfg['max_position_embeddings']} so "
        f"engines accept longer requests, but quality past {ctx} positions is untrained (RoPE extrapolation).",
        "",
        "## Data",
        "",
        f"* Corpus: every `.py` file of this machine's CPython {_pyver()} standard library "
        f"(`vllm_loopspec.tools.tokenizer.stdlib_files()`: no `test`/`tests`/`idle_test` dirs, no site-packages), "
        f"one stream per split, each file followed by `<|endoftext|>`.",
        f"* Split by file: {corpus['split']}. Train: {corpus['train_files']} files, {corpus['train_bytes'] / 1e6:.1f} MB, "
        f"{corpus['train_tokens']:,} tokens. Held out: {corpus['held_out_files']} files, "
        f"{corpus['held_out_bytes'] / 1e6:.1f} MB, {corpus['held_out_tokens']:,} tokens.",
        f"* Tokenizer: byte-level BPE (`vllm_loopspec.tools.tokenizer.train_bpe`), vocab {cfg['vocab_size']}, trained "
        f"on the training split only; ~{corpus['train_bytes'] / corpus['train_tokens']:.2f} bytes/token.",
        "",
        "## Training",
        "",
        f"* {steps} steps x {batch} sequences x {ctx} tokens = {tokens:,} tokens "
        f"({tokens / corpus['train_tokens']:.2f} epochs of the training split), random windows drawn by a "
        f"generator seeded with (seed={args['seed']}, step).",
        f"* AdamW (betas 0.9/0.95, weight decay {args['weight_decay']} on matrices), peak LR {args['lr']}, "
        f"{args['warmup']} warm-up steps then cosine to {args['min_lr_ratio']}x, grad-clip {args['clip']}, float32 "
        f"(bf16 autocast is available with `--bf16` but is slower on this CPU, which has no bf16 units).",
        f"* Hardware: a 2-core AMD EPYC VM, `torch.set_num_threads({args['threads']})`, shared with other jobs while "
        f"training. Training time {train_s / 60:.1f} min (steps only)"
        + (f"; wall time of the whole run including periodic held-out evals and state saves {wall_s / 60:.1f} min." if wall_s else ".")
        + (f" {note}" if note else ""),
        f"* Size: {SIZE_NOTES.get(args['size'], 'see `vllm_loopspec.training.train.SIZES`.')} This run averaged "
        f"{train_s / steps:.1f} s per {batch}x{ctx}-token step.",
        "",
        "### Objective",
        "",
        "With `L_t` the per-token next-token loss of loop `t`'s exit `lm_head(h_t)`:",
        "",
        "    loss = (1/R) * sum_t mean(L_t)                              # LM: uniform over loops",
        f"         + mean( sum_t p_t * stopgrad(L_t) ) - {log['beta']} * mean(H(p))   # exit gate only",
        "",
        "where `p_t` is Ouro's exit distribution from the gate (`OuroReference.exit_probabilities`), computed on",
        "detached hidden states, so the second line trains only `model.early_exit_gate`.",
        "",
        "**Why uniform per-loop weighting for the LM.** Every loop's exit must be a usable predictor: loopspec drafts",
        "with loop `d`'s logits and verifies with loop `R`'s, and adaptive exit reads any loop. Weighting the LM loss by",
        "the learned exit distribution (Ouro's stage-1 objective) lets the gate concentrate mass on whichever loops",
        "are best at the moment (early in this run that was loop 1: see `exit_prob_mean` in `train_log.json`), which",
        "starves the other loops of gradient unless the entropy term is tuned against it; a budget of a few hundred",
        "steps leaves no room to tune that. A uniform mean gives every loop the same",
        "gradient weight from step one and is the simplest objective with that property. The gate still learns",
        "Ouro's expected-loss-under-exit-distribution objective with the entropy regulariser (beta = 0.05), but",
        "against detached losses, so it only learns where to exit and cannot reweight the LM.",
        "",
        "## Held-out results",
        "",
        f"`python -m vllm_loopspec.training.evaluate {args['out']}` -> `eval.json`. Teacher-forced numbers: "
        f"{tf['tokens']:,} held-out tokens ({ev['held_out']['context']}-token windows). Along generation: "
        f"{gen['prompts']} held-out prompts of {gen['prompt_tokens']} tokens, {gen['new_tokens']} greedy full-depth "
        f"tokens each; at each generated position, does loop `d`'s argmax equal the token loop `R` chose?",
        "",
        fmt_row(["loop", "loss", "ppl", "next-token acc", "argmax = loop R (teacher-forced)",
                 "argmax = loop R (greedy continuations)", "mean exit prob"]),
        fmt_row(["---"] * 7),
    ]
    for t in range(R):
        d = str(t + 1)
        lines.append(fmt_row([
            t + 1, f"{tf['loss_per_loop'][t]:.3f}", f"{tf['ppl_per_loop'][t]:.1f}",
            f"{tf['next_token_accuracy_per_loop'][t]:.3f}",
            f"{tf['argmax_agreement_with_loop_R'][d]:.3f}" if t < R - 1 else "1.000",
            f"{gen['argmax_agreement_with_loop_R'][d]:.3f}" if t < R - 1 else "1.000",
            f"{tf['mean_exit_probability_per_loop'][t]:.3f}",
        ]))
    lines += [
        "",
        "Greedy loopspec replayed along those continuations (mean tokens emitted per round = accepted drafts + 1,",
        "rounds tiling each continuation, no EOS or `max_tokens` cuts):",
        "",
        fmt_row(["draft loops d", "K=1", "K=2", "K=4", "K=8"]),
        fmt_row(["---"] * 5),
    ]
    for d, row in gen["simulated_greedy_loopspec_tokens_per_round"].items():
        lines.append(fmt_row([d] + [f"{row[k]:.2f}" for k in ("1", "2", "4", "8")]))
    lines += [""]
    if has_plot:
        lines += ["![per-loop loss](loss_curve.png)", ""]
    lines += [
        "Greedy decoding of a model this small falls into repetition within a few dozen tokens (examples below),",
        "and repetition is easy for shallow loops to predict: agreement along continuations is higher than",
        "teacher-forced and rises with position (`agreement_by_position_quarter` in `eval.json`). Benchmarks that",
        "want acceptance rates closer to teacher-forced text should use short generations or sampling.",
        "",
        "The full per-loop training curve (every 10 steps: per-loop loss, gate loss and entropy, mean exit",
        "probabilities, LR, grad norm) and the periodic held-out per-loop losses are in `train_log.json`.",
        "",
    ]
    for ex in (gen.get("examples") or [])[:2]:
        lines += [
            "Held-out prompt (last 48 tokens):",
            "",
            "```python",
            ex["prompt_tail"],
            "```",
            "",
            f"Greedy full-depth continuation ({gen['new_tokens']} tokens):",
            "",
            "```python",
            ex["continuation"],
            "```",
            "",
        ]
    if cal is not None:
        lines += calibration_lines(cal)
    lines += [
        "## Reproduce",
        "",
        "From the repository root, with the project installed (`pip install -e .`; CPU torch):",
        "",
        "```bash",
        reproduce,
        f"python -m vllm_loopspec.training.evaluate {args['out']}",
    ] + ([cal["command"]] if cal is not None else []) + [
        "pip install matplotlib  # optional, for loss_curve.png",
        f"python -m vllm_loopspec.training.card {args['out']}" + (f" --wall-s {wall_s:.0f}" if wall_s else "")
        + (" --note '...'" if note else ""),
        "```",
        "",
        "The trainer caches the tokenizer, the token ids (`.npy`) and a training state (every 20 steps; `--resume`",
        f"continues from it) under `{Path(args['cache_dir']).name}/` in the repository's git-ignored `.cache/`.",
        "The batches depend only on (seed, step) and the tokenizer training is deterministic, so a rerun sees the",
        "same data; a run stopped and resumed gives byte-identical weights to an uninterrupted one (checked with",
        "`--size micro`). Across machines or torch builds the weights agree up to floating-point reduction order;",
        "the exact bytes below are those of this run.",
        "",
        "## Files (sha256)",
        "",
        "`sha256.json` lists the same hashes (and this card's), and `tests/test_checkpoint_trained.py` checks them.",
        "",
        fmt_row(["file", "sha256"]),
        fmt_row(["---", "---"]),
    ]
    for name, h in sorted(hashes.items()):
        lines.append(fmt_row([f"`{name}`", f"`{h}`"]))
    return "\n".join(lines) + "\n"


def _pyver() -> str:
    import sys

    return ".".join(map(str, sys.version_info[:3]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--wall-s", type=float, default=None, help="wall time of the whole training run, seconds")
    ap.add_argument("--note", default=None, help="extra sentence for the training section (e.g. aborted attempts)")
    ap.add_argument("--keep-plot", action="store_true", help="keep the existing loss_curve.png instead of redrawing it")
    args = ap.parse_args(argv)
    ckpt = args.ckpt
    log = json.loads((ckpt / "train_log.json").read_text())
    targs = json.loads((ckpt / "training_args.json").read_text())
    cfg = json.loads((ckpt / "config.json").read_text())
    ev = json.loads((ckpt / "eval.json").read_text())
    cal_path = ckpt / CALIBRATION_NAME
    cal = json.loads(cal_path.read_text()) if cal_path.exists() else None
    has_plot = (ckpt / "loss_curve.png").exists() if args.keep_plot else plot(ckpt, log)
    skip = {CARD_NAME, SHA_NAME}
    hashes = {p.name: sha256(p) for p in sorted(ckpt.iterdir()) if p.is_file() and p.name not in skip}
    (ckpt / CARD_NAME).write_text(card_text(ckpt, log, targs, cfg, ev, args.wall_s, has_plot, hashes, args.note, cal))
    hashes[CARD_NAME] = sha256(ckpt / CARD_NAME)
    (ckpt / SHA_NAME).write_text(json.dumps(dict(sorted(hashes.items())), indent=2) + "\n")
    print(f"wrote {ckpt / CARD_NAME}, {ckpt / SHA_NAME}" + (", loss_curve.png" if has_plot else ""))


if __name__ == "__main__":
    main()
