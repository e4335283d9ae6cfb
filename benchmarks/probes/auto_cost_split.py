"""Issue 13 diagnostic: where an ``"auto"`` engine's time goes in the
sweep's cells, trial by trial. Native and one auto engine per ``--draft-loops``
in this process, the sweep's warm-up, then ``--repeats`` passes over the
cells (kv_sweep.py's order), each auto trial right after a native trial of
the same prompts. Per auto trial: its tok/s over that native trial's, and
its seconds split by what each step was (``plain/held``: a held plain step;
else the chooser's arm and reason; a step's seconds run from its start to
the next one's, the last step of a trial to the trial's end), and its
choices other than a plain verdict's with the chooser's state at each
(why a measurement or a try ran). Writes the medians per cell, and every
trial, to OUT.

    python benchmarks/probes/auto_cost_split.py OUT [--draft-loops 1 2] [--repeats 5] [--temperatures 0.8]
        [--native-after] [--per-step-depths 1 2]
"""
import argparse, json, statistics, sys, time
from collections import defaultdict
from pathlib import Path

import _probe  # noqa: F401  (environment before vLLM)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _probe import CHECKPOINT, ENGINE_ARGS, add_sweep_protocol_args, load_prompts  # noqa: E402


def instrument(llm) -> tuple[list, list]:
    """Each step's (kind, start) from now on, appended to the first list;
    each choice other than a plain verdict's (a measurement, a try, a
    speculative arm as faster), with the chooser's key (width bucket, mix,
    context bucket) and per arm its rate, samples, own samples, whether
    borrowed and median step ms, to the second."""
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.schedule_choice import PLAIN, _where
    drafter = model_runner(llm).drafter
    chooser = drafter.chooser
    steps, choices, reason = [], [], {"last": None}
    choose, started = chooser.choose, drafter.step_started

    def logged_choose(width, mix, context=0, in_flight=None):
        out = choose(width, mix, context, in_flight)
        reason["last"] = f"{out.arm}/{out.reason}"
        if out.arm != PLAIN or out.reason != "faster":
            where = _where(width, mix, context)
            choices.append([list(where), out.arm, out.reason,
                            {arm: [round(r.rate), r.samples, r.own, r.borrowed, round(r.step_seconds * 1e3, 1)]
                             for arm, r in chooser._keys[where].arms.items()}])
        return out

    def logged_step_started(scheduler_output):
        held = drafter._next_held
        started(scheduler_output)
        if held:
            kind = "plain/held"
        elif drafter.step_arm is None:
            kind = "unchosen"  # prefill, a step of arrivals
        else:
            kind = reason["last"] or drafter.step_arm
        reason["last"] = None
        steps.append((kind, time.perf_counter()))

    chooser.choose = logged_choose
    drafter.step_started = logged_step_started
    return steps, choices


def main():
    from vllm import LLM
    from loopspec_decode import decode_trial
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    add_sweep_protocol_args(ap)
    ap.add_argument("--native-after", action="store_true",
                    help="the native trial right after each auto trial, not before (does the order matter?)")
    ap.add_argument("--per-step-depths", type=int, nargs="*", default=[],
                    help="also an auto engine whose draft depth is chosen per step among these")
    args = ap.parse_args()
    engine_args = ENGINE_ARGS | {"max_num_seqs": max(args.concurrency)}
    native = LLM(CHECKPOINT, **engine_args)
    autos = {f"d{d}": LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": d, "schedule": "auto"},
                          **engine_args) for d in args.draft_loops}
    if args.per_step_depths:
        autos["d" + ",".join(map(str, args.per_step_depths))] = LLM(
            CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": args.per_step_depths,
                                            "schedule": "auto"}, **engine_args)
    prompts = {"short": load_prompts("mixed"), "long": load_prompts("long")}
    new_tokens = {"short": 128, "long": 192}
    for llm in [native, *autos.values()]:  # kv_sweep.py's warm-up
        for c in args.concurrency:
            decode_trial(llm, prompts["short"][:c], 16)
    logs = {name: instrument(llm) for name, llm in autos.items()}
    trials = defaultdict(list)
    for rep in range(args.repeats):
        for t in args.temperatures:
            for s in args.settings:
                for c in args.concurrency:
                    batch = [prompts[s][(rep * c + i) % len(prompts[s])] for i in range(c)]
                    cell = f"{s}{'' if t == 0 else f' T{t}'} c{c}"
                    for name, llm in autos.items():
                        if not args.native_after:
                            base = decode_trial(native, batch, new_tokens[s], temperature=t)["tokens_per_s"]
                        steps, choices = logs[name]
                        steps.clear()
                        choices.clear()
                        start = time.perf_counter()
                        rate = decode_trial(llm, batch, new_tokens[s], temperature=t)["tokens_per_s"]
                        end = time.perf_counter()
                        if args.native_after:
                            base = decode_trial(native, batch, new_tokens[s], temperature=t)["tokens_per_s"]
                        split = defaultdict(float)
                        for (kind, at), (_, nxt) in zip(steps, steps[1:] + [(None, end)]):
                            split[kind] += nxt - at
                        trials[(cell, name)].append({"vs_native_beside": rate / base, "seconds": end - start,
                                                     "split": dict(split),
                                                     "steps": {k: sum(1 for s2, _ in steps if s2 == k) for k in split},
                                                     "choices": list(choices)})
        print(f"repeat {rep + 1} done", flush=True)
    table = {}
    for (cell, name), runs in trials.items():
        kinds = sorted({k for r in runs for k in r["split"]})
        row = {"vs_native_beside": round(statistics.median(r["vs_native_beside"] for r in runs), 4),
               "by_trial": [round(r["vs_native_beside"], 3) for r in runs],
               "share_of_time": {k: round(statistics.median(r["split"].get(k, 0) / r["seconds"] for r in runs), 4)
                                 for k in kinds}}
        table[f"{cell} {name}"] = row
        print(f"{cell:16s} {name} {row['vs_native_beside']:.3f} {row['by_trial']} "
              + " ".join(f"{k}={v:.3f}" for k, v in row["share_of_time"].items()), flush=True)
    Path(args.out).write_text(json.dumps({
        "probe": "auto_cost_split", "command": " ".join(["python", *sys.argv]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "cells": table,
        "trials": {f"{cell} {name}": runs for (cell, name), runs in trials.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
