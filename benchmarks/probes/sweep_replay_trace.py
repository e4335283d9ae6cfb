"""Issue 13 diagnostic: one ``"schedule": "auto"`` engine on the sweep's
protocol (kv_sweep.py's warm-up, every cell and width in its order, new
prompts each repeat), beside native and the fixed pipelined engine auto's
pipelined arm matches; at the cells named by ``--trace`` it prints each
trial's ratios and every choice the chooser made there: arm and reason,
the key, each arm's rate (samples, own) and the arms' paired ratios
(median log ratio to the leader, pairs) as the choice saw them.

The sweep's greedy long cells had auto d2 at 0.85-0.88x the fixed
pipelined d2 K16 (c8, c4) while a probe on that cell alone
(``auto_vs_pipelined.py 8 0 8 2 long``) had auto level with it: what the
chooser carries from the cells before decides there.

    python benchmarks/probes/sweep_replay_trace.py --draft-loops 2 --trace long:0:8 long:0:4
"""
import argparse
import math
import statistics
import sys
from pathlib import Path

import _probe  # noqa: F401  (environment before vLLM)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts, run_lengths  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--settings", nargs="+", default=["short", "long"])
    ap.add_argument("--trace", nargs="+", default=["long:0:8"], help="setting:temperature:width cells to trace")
    args = ap.parse_args()

    from vllm import LLM

    from kv_sweep import SETTINGS
    from loopspec_decode import decode_trial
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.schedule_choice import _where

    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": args.draft_loops,
                                               "schedule": "auto"}, **ENGINE_ARGS)
    drafter = model_runner(auto).drafter
    options = drafter.options
    fixed = {"method": "loopspec", "draft_loops": args.draft_loops, "schedule": "pipelined",
             "num_speculative_tokens": options.max_speculative_tokens}
    if options.second_proposal_loop:
        fixed["second_proposal_loop"] = options.second_proposal_loop
    pipelined = LLM(CHECKPOINT, speculative_config=fixed, **ENGINE_ARGS)
    engines = {"native": native, "auto": auto, "pipelined": pipelined}

    chooser = drafter.chooser
    choose, log = chooser.choose, []

    def logged_choose(width, mix, context=0, in_flight=None):
        choice = choose(width, mix, context, in_flight)
        where = _where(width, mix, context)
        key = chooser._keys[where]
        rates = {arm: f"{r.rate:.0f}({r.samples}/{r.own})" for arm, r in key.arms.items()}
        leader = max(key.arms, key=lambda a: key.arms[a].rate)
        pairs = {arm: f"{math.exp(statistics.median(p)):.2f}({len(p)})"
                 for (arm, other), p in key.pairs.items() if other == leader and p}
        # A lag charge's state, where the chooser keeps one (a rule tried in
        # the forty-fifth and forty-sixth sessions): per arm, the mean of its
        # last charges at the key and how many.
        charges = {arm[:4]: f"{statistics.fmean(c):+.2f}({len(c)})"
                   for arm, c in getattr(key, "lag_charges", {}).items() if c}
        log.append(f"{choice.arm[:4]}/{choice.reason[:4]} hold {choice.hold} key {where[0]},{where[2]} "
                   f"rates {rates} pairs vs {leader[:4]} {pairs}" + (f" lag {charges}" if charges else ""))
        return choice

    chooser.choose = logged_choose
    started, arms = drafter.step_started, []

    def logged_started(scheduler_output):
        started(scheduler_output)
        arms.append(drafter.step_arm or "-")

    drafter.step_started = logged_started
    traced = {(s, float(t), int(c)) for s, t, c in (cell.split(":") for cell in args.trace)}
    prompt_sets = {s: load_prompts("long" if s == "long" else "mixed") for s in args.settings}
    for engine in engines.values():  # kv_sweep.py's warm-up: every batch shape once
        for c in args.concurrency:
            decode_trial(engine, prompt_sets["short"][:c], 16)
    names = list(engines)
    for rep in range(args.repeats):
        for temperature in args.temperatures:
            for setting in args.settings:
                prompts, new_tokens = prompt_sets[setting], SETTINGS[setting]["new_tokens"]
                for c in args.concurrency:
                    batch = [prompts[(rep * c + i) % len(prompts)] for i in range(c)]
                    shift = (rep + c) % len(names)
                    seconds = {}
                    for name in names[shift:] + names[:shift]:
                        log.clear()
                        first = len(arms)
                        trial = decode_trial(engines[name], batch, new_tokens, temperature=temperature)
                        seconds[name] = trial["seconds"]
                        if name == "auto" and (setting, temperature, c) in traced:
                            chosen, steps = list(log), arms[first:]
                    if (setting, temperature, c) in traced:
                        print(f"rep {rep} {setting} T{temperature} c{c}: auto/pipelined "
                              f"{seconds['pipelined'] / seconds['auto']:.2f}, auto/native "
                              f"{seconds['native'] / seconds['auto']:.2f}, pipelined/native "
                              f"{seconds['native'] / seconds['pipelined']:.2f}", flush=True)
                        print("    steps:", run_lengths(steps))
                        for line in chosen:
                            print("    ", line)
        print(f"repeat {rep + 1} done", flush=True)
    print("decisions:", chooser.decisions)


if __name__ == "__main__":
    main()
