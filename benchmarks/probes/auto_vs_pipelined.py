"""Issue 13 check: is an ``"auto"`` engine whose steps are all pipelined as
fast as the fixed pipelined engine it would match? Bar 2 of the sweep
(auto within 5% of the best fixed (d, K)) missed at short greedy c4, where
auto d1 ran 0.94x pipelined d1 K16 s2 while taking the same steps in three
of five repeats. Alternating trials on the same prompts: the fixed
pipelined engine, auto forced to pipelined steps (the chooser still runs
and learns; its choice is overridden), and auto choosing.

    python benchmarks/probes/auto_vs_pipelined.py [width] [temperature] [reps] [draft_loops] [short|long]

With ``long`` (the sweep's long setting: long prompts, 192 tokens) a native
engine runs too, and each chosen trial's arms are printed in order.
"""
import statistics
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, cell_from_argv, run_lengths


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.schedule_choice import PIPELINED, ScheduleChoice

    width, temperature, reps, d, prompts, tokens = cell_from_argv(sys.argv, 4, 0.0, 8)
    setting = "long" if tokens == 192 else "short"
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": d, "schedule": "auto"},
               **ENGINE_ARGS)
    # The pipelined arm auto runs: K = max_speculative_tokens (16), d2 = 2d below R.
    options = model_runner(auto).drafter.options
    fixed = {"method": "loopspec", "draft_loops": d, "schedule": "pipelined",
             "num_speculative_tokens": options.max_speculative_tokens}
    if options.second_proposal_loop:
        fixed["second_proposal_loop"] = options.second_proposal_loop
    pipelined = LLM(CHECKPOINT, speculative_config=fixed, **ENGINE_ARGS)
    chooser = model_runner(auto).drafter.chooser
    choose = chooser.choose
    forced = {"on": False}

    def forced_choose(w, m, c=0, in_flight=None):
        chosen = choose(w, m, c, in_flight)
        return ScheduleChoice(PIPELINED, "measure") if forced["on"] else chosen

    chooser.choose = forced_choose
    params = SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True)
    seconds = {"pipelined": [], "auto forced": [], "auto chosen": []}
    native = None
    if setting == "long":
        native = LLM(CHECKPOINT, **ENGINE_ARGS)
        seconds["native"] = []
    drafter = model_runner(auto).drafter
    started, arms = drafter.step_started, []

    def logged_started(scheduler_output):
        started(scheduler_output)
        arms.append(drafter.step_arm)

    drafter.step_started = logged_started
    for rep in range(reps):
        batch = [prompts[(rep * width + i) % len(prompts)] for i in range(width)]
        for name, times in seconds.items():
            forced["on"] = name == "auto forced"
            engine = {"pipelined": pipelined, "native": native}.get(name, auto)
            first = len(arms)
            start = time.perf_counter()
            engine.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            if name == "auto chosen" and native is not None:
                print(f"rep {rep} chosen arms:", run_lengths(arms[first:]), flush=True)
    print(f"width {width}, T={temperature}, d{d}, fixed {fixed}; trial seconds, median after the first:")
    for name, times in seconds.items():
        print(f"  {name:12s} {statistics.median(times[1:]):.3f}  {[round(t, 3) for t in times]}")
    for name in ("auto forced", "auto chosen", "native")[:3 if native else 2]:
        ratios = [p / a for a, p in zip(seconds[name][1:], seconds["pipelined"][1:])]
        print(f"  {name} speed / pipelined, paired by trial: median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
