"""Issue 13 diagnostic: how the chooser's rating of a speculative arm at a
batch's full width compares with what a trial of that arm delivers, and
how much of the gap is the trial's tail (rows that finish early leave the
laggards to decode at a narrow width).

One ``"auto"`` engine (``--draft-loops``) is forced to one arm for whole
trials (kv_sweep.py's protocol: prefill first, then the timed decode), next
to a native engine; ``policy+pipelined`` runs the policy's rounds at the
full width and pipelined steps once rows have finished (as an auto engine
whose pipeline wins at narrow widths would). For every step the chooser
observes, the probe records the width, the seconds, the committed tokens,
the lag the step added and the chooser's lag charge
(:meth:`.ScheduleChooser._lag_charge`). It prints, per arm: the trial's
tokens per second per request, the rate the chooser was fed at the full
width (median of steps, and pooled), their ratio, the share of the arm's
observed time at the full width (the rest: its tail), and the same rate
uncharged. A plain trial of one row per repeat gives a width-1 step's cost.

    python benchmarks/probes/drain_tail.py --width 16 --temperature 0 --prompts mixed --repeats 4
"""
import argparse
import statistics
import sys
from pathlib import Path

import _probe  # noqa: F401  (environment before vLLM)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts  # noqa: E402

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
    from vllm_loopspec.speculative.schedule_choice import ScheduleChoice

    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": args.draft_loops,
                                               "schedule": "auto"}, **ENGINE_ARGS)
    drafter = model_runner(auto).drafter
    chooser = drafter.chooser
    choose, observe, lag_charge = chooser.choose, chooser.observe, chooser._lag_charge
    state = {"arm": None, "trial": None}
    steps = []  # (trial, arm, width, seconds, committed per request, lag, charge, context bucket)
    charged = []

    def forced_choose(width, mix, context=0, in_flight=None):
        choose(width, mix, context, in_flight)  # keeps the chooser's bookkeeping as in a sweep
        arm, _, tail = state["arm"].partition("+")  # "policy+pipelined": the tail (rows left) pipelined
        return ScheduleChoice(tail if tail and width < args.width else arm, "measure")

    def recording_lag_charge(*a, **k):
        charged.append(lag_charge(*a, **k))
        return charged[-1]

    def recording_observe(width, mix, arm, committed, seconds, context=0, after=None, lag=0.0, **kwargs):
        charged.clear()
        out = observe(width, mix, arm, committed, seconds, context, after=after, lag=lag, **kwargs)
        steps.append((state["trial"], arm, width, seconds, committed / max(width, 1), lag,
                      charged[-1] if charged else 0.0, (max(int(context), 0) // 64).bit_length()))
        return out

    chooser.choose, chooser.observe, chooser._lag_charge = forced_choose, recording_observe, recording_lag_charge
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
        rated = statistics.median(s[4] / (1 + s[6]) / s[3] for s in full)
        pooled = sum(s[4] / (1 + s[6]) for s in full) / sum(s[3] for s in full)
        trial = statistics.median(trials[arm])
        print(f"{arm:10s} trial {trial:6.1f}  rated at width {args.width}: median {rated:6.1f} pooled {pooled:6.1f}"
              f"  trial/pooled {trial / pooled:.2f}  time at full width {sum(s[3] for s in full) / total:.2f}")
        for bucket in sorted({s[7] for s in full}):
            at = [s for s in full if s[7] == bucket]
            print(f"    context bucket {bucket}: {len(at):3d} steps, pooled"
                  f" {sum(s[4] / (1 + s[6]) for s in at) / sum(s[3] for s in at):6.1f}")
        plain_rate = sum(s[4] for s in full) / sum(s[3] for s in full)
        print(f"    uncharged: pooled {plain_rate:6.1f}  trial/pooled {trial / plain_rate:.2f};"
              f" lag added per step (tokens): mean {statistics.fmean(s[5] for s in full):.2f},"
              f" charge (share of a step's seconds): median {statistics.median(s[6] for s in full):.2f}")


if __name__ == "__main__":
    main()
