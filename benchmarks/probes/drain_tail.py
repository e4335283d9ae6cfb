"""Issue 13 diagnostic: how the chooser's rating of a speculative arm at a
batch's full width compares with what a trial of that arm alone delivers,
and how much of the gap is the trial's tail (rows that finish early leave
the laggards to decode at a narrow width).

One ``"auto"`` engine (``--draft-loops``) is forced to one arm for whole
trials (kv_sweep.py's protocol: prefill first, then the timed decode), next
to a native engine. For every step the chooser observes, the probe records
the width, the seconds, the committed tokens as rated and, for speculative
steps, what :meth:`.DrainPaces.rate_factor` saw (the rows' paces and
tokens left). It prints, per arm: the trial's tokens per second per
request, the rate the chooser was fed at the full width (median of steps,
and pooled), their ratio, the share of the trial's observed time at the
full width, and what the drain factor would have made of the same steps
under a step cost with a fixed share ``alpha`` (``alpha`` 0: cost in
proportion to the width, as :func:`.batch_drain.drain_factor` assumes; 1:
every step costs the same whatever its width). Plain steps (width 1 and
the full width) give the fixed share this engine measures. For
``policy+pipelined`` (rounds at the full width, pipelined steps once rows
finish), "time at full width" counts the rounds' steps only.

    python benchmarks/probes/drain_tail.py --width 16 --temperature 0 --prompts mixed --repeats 4
"""
import argparse
import statistics
import sys
from pathlib import Path

import _probe  # noqa: F401  (environment before vLLM)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts  # noqa: E402

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)


def factor(paces, remaining, alpha):
    """The drain factor with a fixed share ``alpha`` of a full-width step's cost."""
    left = [(r, p) for r, p in zip(remaining, paces) if r > 0 and p > 0]
    if len(paces) < 2 or not left:
        return 1.0
    finish = [r / p for r, p in left]
    mean_r = sum(r for r, _ in left) / len(left)
    steps = alpha * max(finish) + (1 - alpha) * sum(finish) / len(finish)
    return mean_r / steps / (sum(paces) / len(paces))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", default="mixed")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--arms", nargs="+", default=["plain", "pipelined", "policy"])
    args = ap.parse_args()

    from vllm import LLM

    from loopspec_decode import decode_trial
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.batch_drain import PRIOR_STEPS
    from vllm_loopspec.speculative.schedule_choice import ScheduleChoice

    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": args.draft_loops,
                                               "schedule": "auto"}, **ENGINE_ARGS)
    drafter = model_runner(auto).drafter
    chooser, drain = drafter.chooser, drafter.drain
    choose, observe, rate_factor = chooser.choose, chooser.observe, drain.rate_factor
    state = {"arm": None, "trial": None}
    steps = []  # (trial, arm, width, seconds, rated per request, drain record or None)
    drains = []

    def forced_choose(width, mix, context=0, in_flight=None):
        choose(width, mix, context, in_flight)  # keeps the chooser's bookkeeping as in a sweep
        arm, _, tail = state["arm"].partition("+")  # "policy+pipelined": the tail (rows left) pipelined
        return ScheduleChoice(tail if tail and width < args.width else arm, "measure")

    def recording_rate_factor(arm, req_ids, committed, remaining):
        out = rate_factor(arm, req_ids, committed, remaining)
        if len(req_ids) > 1:  # one row: no paces counted (the factor is 1)
            # The paces rate_factor just used, as DrainPaces computes them.
            totals, mean = drain._totals, sum(committed) / len(committed)
            paces = [(totals[r][arm][0] + PRIOR_STEPS * mean) / (totals[r][arm][1] + PRIOR_STEPS) for r in req_ids]
            drains.append((paces, list(remaining), out, list(committed)))
        return out

    def recording_observe(width, mix, arm, committed, seconds, context=0, after=None, **kwargs):
        record = drains[-1] if drains and arm != "plain" else None
        drains.clear()
        steps.append((state["trial"], arm, width, seconds, committed / max(width, 1), record,
                      (max(int(context), 0) // 64).bit_length()))
        return observe(width, mix, arm, committed, seconds, context, after=after, **kwargs)

    chooser.choose, chooser.observe, drain.rate_factor = forced_choose, recording_observe, recording_rate_factor
    prompts = load_prompts(args.prompts)
    trials = {name: [] for name in ["native", *args.arms]}
    for rep in range(args.repeats + 1):  # the first: warm-up
        batch = [prompts[(rep * args.width + i) % len(prompts)] for i in range(args.width)]
        trial = decode_trial(native, batch, args.tokens, temperature=args.temperature)
        if rep:
            trials["native"].append(trial["tokens_per_s"] / args.width)
        for arm in args.arms:
            state.update(arm=arm, trial=(rep, arm))
            trial = decode_trial(auto, batch, args.tokens, temperature=args.temperature)
            if rep:
                trials[arm].append(trial["tokens_per_s"] / args.width)
        state.update(arm="plain", trial=(rep, "plain alone"))  # a width-1 plain step's cost
        decode_trial(auto, batch[:1], args.tokens // 4, temperature=args.temperature)

    print(f"d{args.draft_loops}, width {args.width}, T={args.temperature}, {args.prompts}, {args.tokens} tokens,"
          f" {args.repeats} repeats after a warm-up")
    print("trial tokens/s per request (median):", {k: round(statistics.median(v), 1) for k, v in trials.items()})
    plain = [s for s in steps if s[1] == "plain" and s[0] is not None and s[0][0] > 0]
    plain_ms = {w: statistics.median(s[3] for s in plain if s[2] == w) for w in {s[2] for s in plain}}
    print("plain step ms by width:", {w: round(s * 1e3, 2) for w, s in sorted(plain_ms.items())})
    if 1 in plain_ms and args.width in plain_ms:
        print(f"  fixed share (width-1 step over width-{args.width} step): {plain_ms[1] / plain_ms[args.width]:.2f}")
    for arm in args.arms:
        mine = [s for s in steps if s[1] == arm.partition("+")[0] and s[0] is not None and s[0][0] > 0 and s[0][1] == arm]
        full = [s for s in mine if s[2] == args.width]
        if not full:
            continue
        total = sum(s[3] for s in mine)
        rated = statistics.median(s[4] / s[3] for s in full)
        pooled = sum(s[4] for s in full) / sum(s[3] for s in full)
        trial = statistics.median(trials[arm])
        print(f"{arm:10s} trial {trial:6.1f}  rated at width {args.width}: median {rated:6.1f} pooled {pooled:6.1f}"
              f"  trial/pooled {trial / pooled:.2f}  time at full width {sum(s[3] for s in full) / total:.2f}")
        for bucket in sorted({s[6] for s in full}):
            at = [s for s in full if s[6] == bucket]
            fed = [s[5][2] for s in at if s[5] is not None]
            print(f"    context bucket {bucket}: {len(at):3d} steps, pooled {sum(s[4] for s in at) / sum(s[3] for s in at):6.1f}"
                  + (f", drain factor median {statistics.median(fed):.2f}" if fed else ""))
        records = [s for s in full if s[5] is not None]
        if records:
            print(f"    drain factor as fed: median {statistics.median(s[5][2] for s in records):.2f}"
                  f" min {min(s[5][2] for s in records):.2f}")
            one_row = plain_ms.get(1)
            for scale in (0.75, 1.0):
                for with_drain in (False, True):
                    tokens = secs = 0.0
                    for s in records:
                        paces, left, fed, rows = s[5]
                        before = [r + c for r, c in zip(left, rows)]
                        spread = lambda rr: max(rr) - sum(rr) / len(rr)
                        grew = spread(left) - spread(before)
                        per_request = s[4] / fed * (fed if with_drain else 1.0)
                        committed = per_request * len(rows)
                        extra = grew * max(scale * one_row - s[3] / max(committed, 1e-9), 0.0)
                        tokens += per_request
                        secs += s[3] + extra
                    print(f"    spread charge (one row {scale:.2f}x plain's){' and drain' if with_drain else ''}:"
                          f" pooled {tokens / secs:6.1f}  trial/pooled {trial / (tokens / secs):.2f}")
            for alpha in ALPHAS:
                # Rated tokens over the drain factor as fed, times the factor under alpha.
                alt = sum(s[4] / s[5][2] * factor(s[5][0], s[5][1], alpha) for s in records)
                secs = sum(s[3] for s in records)
                print(f"    alpha {alpha:.2f}: pooled {alt / secs:6.1f}  trial/pooled {trial / (alt / secs):.2f}")


if __name__ == "__main__":
    main()
