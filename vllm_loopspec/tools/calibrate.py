"""Depth calibration: how close is loop ``r`` to loop ``R``, and which draft depths follow.

    python -m vllm_loopspec.tools.calibrate CKPT [--prompts held-out | FILE.jsonl ...] [--out FILE]

Runs the serial oracle (:class:`vllm_loopspec.reference.OuroReference`, its
``loop_logits``) over a prompt set, teacher-forced, and at every position
compares the next-token distribution after loop ``r`` with the one after the
last loop ``R``, for ``r = 1..R-1``:

* ``mean TV``: E[TV(p_r, p_R)] at temperature 1 (``--temperature``), the
  rejection probability of a sampled draft from loop ``r``
  (``Pr[accept] = sum_x min(p_r, p_R) = 1 - TV``);
* ``agreement``: Pr[argmax p_r == argmax p_R], the acceptance of a greedy draft.

The prompt set is the checkpoint's held-out text by default (the split and the
non-overlapping windows of :mod:`vllm_loopspec.training.evaluate`), or the
prompts of ``benchmarks/prompts/*.jsonl`` files (every token of each prompt).

**Fit.** ``E[TV] ~ beta * r^(-alpha)``, least squares of ``log TV`` on
``log r`` over the measured ``r`` (R^2 in log space). A least-squares line
passes between the points, so it is not an upper bound; ``beta_bound`` is the
smallest beta with the same alpha for which ``beta_bound * r^(-alpha) >= TV_r``
at every measured ``r`` (the table says where the fitted line holds). LoopSpec
fits its envelope differently (alpha, beta minimising the largest ratio of
envelope to measurement); both give an upper envelope, the depths below use
``beta_bound``.

**Depths: LoopSpec's closed form** (Cho, Cui, Kim, Han, Han, "LoopSpec:
Pipelined Self-Speculative Decoding for Looped Transformers", arXiv 2609.17184,
Theorem 2 and its proof in appendix G.2; code: github.com/kaist-flexml-lab/loopspec).
The pipelined schedule (issue 12): every live branch advances one loop per
batched tick; a branch at depth ``d1`` drafts the next token and starts a
child branch at depth 0; at ``d2`` (``d1 < d2 < R``) it drafts a second,
residual proposal ``p_d2 (-) p_d1`` only when the deeper loop withdraws
confidence from the first draft (greedy: ``argmax p_d2 != draft``); at ``R``
it verifies first draft, then second draft, then resamples. The ticks between
two committed tokens, ``C``, are ``d1`` when the first draft is accepted,
``d2`` when the second is, ``R`` after a restart. With
``eps_r = TV(p_r, p_R)``, ``Pr[accept1] = 1 - eps_d1``,
``Pr[accept2] <= eps_d1`` and (their Theorem 1, with the gate)
``Pr[restart] <= 2 eps_d2``, so with the envelope ``phi(r) = beta r^-alpha``

    E[C] <= f(d1, d2) = d1 + phi(d1) * d2 + 2 * phi(d2) * R

and setting both partial derivatives to zero gives

    d1* = (alpha beta)^((alpha+1)/(alpha^2+alpha+1)) * (2 alpha R)^(1/(alpha^2+alpha+1))
    d2* = (alpha beta)^(alpha/(alpha^2+alpha+1))     * (2 alpha R)^((alpha+1)/(alpha^2+alpha+1))

(the unique stationary point, a minimum), inside ``1 <= d1* < d2* < R`` when
``R > max{(ab)^(1/a), (ab)^(-a-1), (ab)^(1/a) (2a)^((a^2+a+1)/a^2)} / (2a)``
(``a = alpha, b = beta``). Depths are integers and ``R`` is small (4 for
Ouro), so the tool reports this continuous optimum and then takes the integer
pair ``1 <= d1 < d2 < R`` that minimises ``f``; that pair is ``d1*, d2*`` in
the output and the file. The predicted speedup is ``R / E[C]`` (native decoding
spends ``R`` loop passes per token), from the bound ``f`` and, beside it, from
the measured acceptance: greedy ``Pr[accept1] = agree(d1)``,
``Pr[restart] = Pr[argmax_d1 != argmax_R and argmax_d2 != argmax_R]``;
sampled, the exact cascade probabilities per position (first draft rejected
with mass ``[p_d1 - p_R]_+``, the gate open where ``p_d2 < p_d1``, the second
draft rejected with ``TV(p_R (-) p_d1, p_d2 (-) p_d1)``).

**Assumptions of the model**, plainly:
* one tick (one loop over every live branch of a request, at whatever depths)
  costs one loop pass, however many rows it carries: true while a pass is
  bound by reading the weights (small batches on GPU), not on a CPU where a
  pass costs about linearly in rows, nor at high concurrency;
* costs outside the loops (sampling, the engine step, scheduling) are zero;
* acceptance at consecutive positions is independent and a restart costs a
  full ``R`` ticks (no partial reuse);
* the mean TV over teacher-forced positions of the prompt set stands for the
  positions the server will decode (generated text is usually easier:
  ``eval.json``'s agreement along greedy continuations is higher);
* ``d1*`` is optimal for the *pipelined* schedule. Today's round schedule
  (draft ``K`` tokens with loops ``1..d``, verify with ``d+1..R``) has
  another optimum: ``"draft_loops": "auto"`` reads ``d1*`` all the same, and
  the default (``draft_loops`` unset) stays ``R // 2``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see training/evaluate.py

import argparse
import datetime as _dt
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

CALIBRATION_FILE = "loopspec_calibration.json"
SCHEMA = "loopspec-calibration/1"
PAPER = ("LoopSpec (Cho et al., arXiv 2609.17184), Theorem 2 / appendix G.2; "
         "https://arxiv.org/abs/2609.17184, https://github.com/kaist-flexml-lab/loopspec")
HELD_OUT = "held-out"


# -- fit and closed form (pure functions) ---------------------------------------
def fit_power_law(r, tv) -> dict:
    """Least squares of log(tv) on log(r): tv ~ beta * r^-alpha.

    Returns alpha, beta, r2 (log space), beta_bound (smallest beta making the
    curve an upper bound at every point, same alpha), raised (whether it had
    to be raised), holds (per point: tv <= beta * r^-alpha with the fitted
    beta). Points with tv <= 0 cannot enter a log fit and are left out (their
    bound holds trivially); at least two positive points are needed."""
    r = np.asarray(r, dtype=np.float64)
    tv = np.asarray(tv, dtype=np.float64)
    if r.shape != tv.shape or r.ndim != 1:
        raise ValueError("r and tv must be 1-d and of equal length")
    keep = tv > 0
    if keep.sum() < 2:
        raise ValueError(f"a power-law fit needs two depths with TV > 0, got {tv.tolist()}")
    x, y = np.log(r[keep]), np.log(tv[keep])
    slope, intercept = np.polyfit(x, y, 1)
    alpha, beta = float(-slope), float(math.exp(intercept))
    resid = y - (intercept + slope * x)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    fitted = beta * r ** -alpha
    holds = [bool(t <= f * (1 + 1e-12)) for t, f in zip(tv, fitted)]
    beta_bound = max(beta, float(np.max(tv * r ** alpha)))
    return {"alpha": alpha, "beta": beta, "r2": r2, "beta_bound": beta_bound,
            "raised": beta_bound > beta * (1 + 1e-12), "holds": holds}


def envelope_cost(d1: float, d2: float | None, alpha: float, beta: float, R: int) -> float:
    """LoopSpec's bound on expected ticks per committed token (Eq. 11):
    ``d1 + phi(d1) d2 + 2 phi(d2) R``; with no second proposal a first-draft
    rejection restarts: ``d1 + phi(d1) (R - d1)``."""
    phi = lambda d: min(1.0, beta * d ** -alpha)  # noqa: E731  (a TV is at most 1)
    if d2 is None:
        return d1 + phi(d1) * (R - d1)
    return d1 + phi(d1) * d2 + 2 * phi(d2) * R


def closed_form_depths(alpha: float, beta: float, R: int) -> dict:
    """LoopSpec's continuous optimum of :func:`envelope_cost` (Eq. 8) and
    whether their condition on ``R`` (which puts it inside 1 <= d1 < d2 < R) holds."""
    if alpha <= 0 or beta <= 0:
        return {"d1": None, "d2": None, "valid": False,
                "why": f"needs alpha > 0 and beta > 0 (TV falling with depth), got alpha={alpha:.3g}"}
    ab, s = alpha * beta, alpha * alpha + alpha + 1
    d1 = ab ** ((alpha + 1) / s) * (2 * alpha * R) ** (1 / s)
    d2 = ab ** (alpha / s) * (2 * alpha * R) ** ((alpha + 1) / s)
    need = max(ab ** (1 / alpha), ab ** (-alpha - 1),
               ab ** (1 / alpha) * (2 * alpha) ** (s / alpha ** 2)) / (2 * alpha)
    return {"d1": d1, "d2": d2, "valid": bool(R > need), "R_needed": need}


def integer_depths(alpha: float, beta: float, R: int) -> tuple[int, int | None]:
    """The integer pair 1 <= d1 < d2 < R minimising :func:`envelope_cost`
    (R = 2 leaves no room for d2: (1, None))."""
    if R < 2:
        raise ValueError(f"R must be >= 2, got {R}")
    if R == 2:
        return 1, None
    pairs = [(d1, d2) for d1 in range(1, R - 1) for d2 in range(d1 + 1, R)]
    return min(pairs, key=lambda p: (envelope_cost(p[0], p[1], alpha, beta, R), p))


def expected_ticks(acc1: float, acc2: float, d1: int, d2: int | None, R: int) -> float:
    """E[C] from acceptance probabilities: first draft ``acc1`` -> d1 ticks,
    second ``acc2`` -> d2, otherwise restart -> R."""
    if d2 is None:
        return acc1 * d1 + (1 - acc1) * R
    return acc1 * d1 + acc2 * d2 + (1 - acc1 - acc2) * R


# -- measurement -----------------------------------------------------------------
def _pairs(R: int) -> list[tuple[int, int]]:
    return [(d1, d2) for d1 in range(1, R - 1) for d2 in range(d1 + 1, R)]


class Accumulator:
    """Sums over positions of everything the report needs."""

    def __init__(self, R: int) -> None:
        self.R = R
        self.n = 0
        self.tv = np.zeros(R - 1)
        self.agree = np.zeros(R - 1)
        self.pairs = _pairs(R)
        # per pair: greedy accept2, greedy restart, sampled accept2, sampled restart
        self.g_acc2 = np.zeros(len(self.pairs))
        self.g_restart = np.zeros(len(self.pairs))
        self.s_acc2 = np.zeros(len(self.pairs))
        self.s_restart = np.zeros(len(self.pairs))

    @torch.no_grad()
    def add(self, loop_logits: list[torch.Tensor], temperature: float) -> None:
        """``loop_logits``: R tensors [N, V] (positions flattened)."""
        R = self.R
        probs = [torch.softmax(lg.double() / temperature, -1) for lg in loop_logits]
        top = [lg.argmax(-1) for lg in loop_logits]
        p = probs[-1]
        self.n += p.shape[0]
        for r in range(R - 1):
            self.tv[r] += float(0.5 * (probs[r] - p).abs().sum(-1).sum())
            self.agree[r] += float((top[r] == top[-1]).sum())
        for i, (d1, d2) in enumerate(self.pairs):
            a1, a2, aR = top[d1 - 1], top[d2 - 1], top[-1]
            self.g_acc2[i] += float(((a1 != aR) & (a2 == aR)).sum())
            self.g_restart[i] += float(((a1 != aR) & (a2 != aR)).sum())
            q1, q2t = probs[d1 - 1], probs[d2 - 1]
            rej1 = (q1 - p).clamp_min(0)                 # mass of drawing x and rejecting it
            eps1 = rej1.sum(-1)
            gate = q2t < q1                              # second proposal issued after drawing x
            rej_closed = (rej1 * ~gate).sum(-1)
            rej_open = (rej1 * gate).sum(-1)
            rho1 = (p - q1).clamp_min(0) / eps1.clamp_min(1e-300)[:, None]
            res2 = (q2t - q1).clamp_min(0)
            q2 = res2 / res2.sum(-1).clamp_min(1e-300)[:, None]
            rej2 = 0.5 * (rho1 - q2).abs().sum(-1)
            restart = rej_closed + rej_open * rej2
            self.s_restart[i] += float(restart.sum())
            self.s_acc2[i] += float((eps1 - restart).sum())


def held_out_positions(ckpt: Path, context: int, windows: int) -> tuple[list[torch.Tensor], dict]:
    from vllm_loopspec.training.data import held_out_windows
    from vllm_loopspec.training.evaluate import held_out_stream

    stream = held_out_stream(ckpt)
    w = torch.from_numpy(held_out_windows(stream, context, windows))
    desc = {"kind": HELD_OUT,
            "split": "stdlib files i % 20 == 10 (vllm_loopspec.training.data.split_files)",
            "windows": int(w.shape[0]), "context": context, "stream_tokens": int(stream.size),
            "selection": "the first non-overlapping windows of the held-out stream "
                         "(vllm_loopspec.training.data.held_out_windows)"}
    return list(w), desc


def jsonl_positions(ckpt: Path, files: list[Path], context: int) -> tuple[list[torch.Tensor], dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    seqs = []
    for f in files:
        for line in f.read_text().splitlines():
            if line.strip():
                ids = tok.encode(json.loads(line)["prompt"]).ids[:context]
                if ids:
                    seqs.append(torch.tensor(ids, dtype=torch.long))
    if not seqs:
        raise SystemExit(f"no prompts in {', '.join(map(str, files))}")
    return seqs, {"kind": "jsonl", "files": [str(f) for f in files], "prompts": len(seqs),
                  "context": context, "selection": "every token of each prompt (first `context` tokens)"}


@torch.no_grad()
def measure(model, seqs: list[torch.Tensor], temperature: float = 1.0, batch: int = 8) -> Accumulator:
    """Teacher-forced loop logits of every position of every sequence."""
    R = model.config.total_ut_steps
    acc = Accumulator(R)
    i = 0
    while i < len(seqs):
        # batch only sequences of one length (held-out windows all are)
        j = i + 1
        while j < len(seqs) and j - i < batch and seqs[j].numel() == seqs[i].numel():
            j += 1
        ids = torch.stack(seqs[i:j])
        logits = model.loop_logits(ids)                  # R x [B, T, V]
        acc.add([lg.flatten(0, 1) for lg in logits], temperature)
        i = j
    return acc


# -- report ----------------------------------------------------------------------
def report(acc: Accumulator, R: int) -> dict:
    n = acc.n
    rs = list(range(1, R))
    tv = acc.tv / n
    agree = acc.agree / n
    out: dict = {"positions": n}
    fit = None
    try:
        fit = fit_power_law(rs, tv)
    except ValueError as e:
        out["fit_error"] = str(e)
    per_loop = []
    for k, r in enumerate(rs):
        row = {"r": r, "mean_tv": round(float(tv[k]), 5), "agreement": round(float(agree[k]), 5)}
        if fit:
            row["fitted_tv"] = round(fit["beta"] * r ** -fit["alpha"], 5)
            row["bound_tv"] = round(fit["beta_bound"] * r ** -fit["alpha"], 5)
            row["fit_holds"] = fit["holds"][k]
        per_loop.append(row)
    out["per_loop"] = per_loop
    pairs = acc.pairs
    idx = {p: i for i, p in enumerate(pairs)}

    def measured(d1, d2):
        if d2 is None:
            return (expected_ticks(float(agree[d1 - 1]), 0, d1, None, R),
                    expected_ticks(1 - float(tv[d1 - 1]), 0, d1, None, R))
        i = idx[(d1, d2)]
        return (expected_ticks(float(agree[d1 - 1]), acc.g_acc2[i] / n, d1, d2, R),
                expected_ticks(1 - float(tv[d1 - 1]), acc.s_acc2[i] / n, d1, d2, R))

    if fit and fit["alpha"] > 0:
        a, b = fit["alpha"], fit["beta_bound"]
        out["fit"] = {"alpha": round(a, 4), "beta": round(fit["beta"], 4), "r2_log": round(fit["r2"], 4),
                      "beta_bound": round(b, 4), "beta_raised_for_bound": fit["raised"],
                      "method": "least squares of log TV on log r over r = 1..R-1; beta_bound = smallest "
                                "beta with this alpha that bounds every measured TV from above"}
        cf = closed_form_depths(a, b, R)
        out["closed_form"] = {"d1": round(cf["d1"], 3), "d2": round(cf["d2"], 3), "R_condition_holds": cf["valid"],
                              "R_needed": round(cf["R_needed"], 3), "beta_used": "beta_bound", "source": PAPER}
        d1, d2 = integer_depths(a, b, R)
        basis = "integer pair minimising LoopSpec's bound d1 + phi(d1) d2 + 2 phi(d2) R with phi = beta_bound r^-alpha"
    else:
        # no usable fit: choose from the measured sampled cost directly
        cands = [(p, measured(*p)[1]) for p in pairs] or [((1, None), measured(1, None)[1])]
        (d1, d2), _ = min(cands, key=lambda c: c[1])
        a = b = None
        basis = "no power-law fit (TV not falling with depth): integer pair minimising the measured sampled E[C]"
        out["closed_form"] = None
    g_cost, s_cost = measured(d1, d2)
    g1, s1 = measured(d1, None)
    out["depths"] = {"d1": d1, "d2": d2, "basis": basis}
    if pairs:
        out["depths"]["measured_best"] = {
            "greedy": list(min(pairs, key=lambda q: measured(*q)[0])),
            "sampled": list(min(pairs, key=lambda q: measured(*q)[1]))}
    pred = {"ceiling_R_over_d1": round(R / d1, 3),
            "greedy_measured": {"ticks_per_token": round(g_cost, 3), "speedup": round(R / g_cost, 3)},
            "sampled_measured": {"ticks_per_token": round(s_cost, 3), "speedup": round(R / s_cost, 3)},
            "first_proposal_only": {"greedy_speedup": round(R / g1, 3), "sampled_speedup": round(R / s1, 3)}}
    if a is not None:
        bound = envelope_cost(d1, d2, a, b, R)
        pred["bound"] = {"ticks_per_token": round(bound, 3), "speedup": round(R / bound, 3),
                         "note": "from the fitted envelope; a lower estimate, as the envelope bounds TV from above"}
    out["predicted"] = pred
    cand_rows = []
    for p in pairs:
        g, s = measured(*p)
        row = {"d1": p[0], "d2": p[1], "greedy_ticks": round(g, 3), "sampled_ticks": round(s, 3)}
        if a is not None:
            row["bound_ticks"] = round(envelope_cost(p[0], p[1], a, b, R), 3)
        i = idx[p]
        row["greedy_second_share"] = round(acc.g_acc2[i] / n, 4)
        row["sampled_second_share"] = round(acc.s_acc2[i] / n, 4)
        cand_rows.append(row)
    out["candidates"] = cand_rows
    return out


def format_table(res: dict, R: int) -> str:
    lines = [f"{'r':>3} {'mean TV':>9} {'agreement':>10} {'fitted TV':>10} {'bound TV':>9} {'fit holds':>9}"]
    for row in res["per_loop"]:
        lines.append(f"{row['r']:>3} {row['mean_tv']:>9.4f} {row['agreement']:>10.4f} "
                     f"{row.get('fitted_tv', float('nan')):>10.4f} {row.get('bound_tv', float('nan')):>9.4f} "
                     f"{str(row.get('fit_holds', '-')):>9}")
    lines.append(f"  R = {R}: TV(p_R, p_R) = 0, agreement 1")
    fit = res.get("fit")
    if fit:
        lines.append(f"alpha = {fit['alpha']:.3f}, beta = {fit['beta']:.4f} (R^2 = {fit['r2_log']:.3f} in log space); "
                     f"upper-bound beta = {fit['beta_bound']:.4f}"
                     + (" (raised)" if fit["beta_raised_for_bound"] else " (the fit already bounds every point)"))
        cf = res["closed_form"]
        lines.append(f"closed form (LoopSpec Eq. 8, beta_bound): d1* = {cf['d1']:.2f}, d2* = {cf['d2']:.2f}"
                     + ("" if cf["R_condition_holds"] else f"  [outside 1 <= d1 < d2 < R: their condition needs R > {cf['R_needed']:.2f}]"))
    else:
        lines.append(f"no power-law fit: {res.get('fit_error', 'alpha <= 0')}")
    d = res["depths"]
    lines.append(f"d1* = {d['d1']}, d2* = {d['d2']}  ({d['basis']})")
    if "measured_best" in d:
        mb = d["measured_best"]
        lines.append(f"lowest measured ticks per token: greedy (d1, d2) = {tuple(mb['greedy'])}, "
                     f"sampled {tuple(mb['sampled'])}")
    p = res["predicted"]
    lines.append(f"predicted speedup (loop passes, pipelined): ceiling R/d1 = {p['ceiling_R_over_d1']:.2f}x; "
                 + (f"bound {p['bound']['speedup']:.2f}x; " if "bound" in p else "")
                 + f"measured acceptance: greedy {p['greedy_measured']['speedup']:.2f}x, "
                   f"sampled {p['sampled_measured']['speedup']:.2f}x "
                   f"(first proposal only: {p['first_proposal_only']['greedy_speedup']:.2f}x / "
                   f"{p['first_proposal_only']['sampled_speedup']:.2f}x)")
    if res["candidates"]:
        lines.append("candidates (ticks per committed token): d1 d2 | bound | greedy | sampled")
        for c in res["candidates"]:
            lines.append(f"  {c['d1']} {c['d2']} | {c.get('bound_ticks', float('nan')):.3f} | "
                         f"{c['greedy_ticks']:.3f} | {c['sampled_ticks']:.3f}")
    return "\n".join(lines)


def calibrate(ckpt: Path, prompts: list[str], context: int, windows: int, temperature: float,
              threads: int, argv: list[str]) -> dict:
    from vllm_loopspec.reference import OuroReference

    torch.set_num_threads(threads)
    t0 = time.time()
    model = OuroReference.from_pretrained(ckpt, dtype=torch.float32)
    R = model.config.total_ut_steps
    if prompts == [HELD_OUT]:
        seqs, desc = held_out_positions(ckpt, context, windows)
    else:
        seqs, desc = jsonl_positions(ckpt, [Path(p) for p in prompts], context)
    acc = measure(model, seqs, temperature)
    res = report(acc, R)
    return {"schema": SCHEMA, "checkpoint": str(ckpt), "loops": R, "temperature": temperature,
            "prompt_set": desc, **res, "draft_loops": res["depths"]["d1"],
            "seconds": round(time.time() - t0, 1),
            "command": "python -m vllm_loopspec.tools.calibrate " + shlex.join(argv),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--prompts", nargs="+", default=[HELD_OUT],
                    help=f"'{HELD_OUT}' (default: the checkpoint's held-out split) or .jsonl files "
                         "with a 'prompt' field per line (e.g. benchmarks/prompts/*.jsonl)")
    ap.add_argument("--context", type=int, default=256, help="tokens per window / per prompt at most")
    ap.add_argument("--windows", type=int, default=256, help="held-out windows (eval.json uses 256)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help=f"default: CKPT/{CALIBRATION_FILE}")
    args = ap.parse_args(argv)
    if HELD_OUT in args.prompts and len(args.prompts) > 1:
        ap.error(f"--prompts takes '{HELD_OUT}' or .jsonl files, not both")
    result = calibrate(args.ckpt, args.prompts, args.context, args.windows, args.temperature,
                       args.threads, argv)
    print(format_table(result, result["loops"]))
    out = args.out or args.ckpt / CALIBRATION_FILE
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['positions']} positions in {result['seconds']} s; wrote {out}")
    return result


if __name__ == "__main__":
    main()
