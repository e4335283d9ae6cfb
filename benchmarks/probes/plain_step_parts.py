"""Issue 13 check: where a plain step's time goes in a loopspec engine
against native. Three engines in this process, interleaved: native;
loopspec held under the width cap (every step the real fast path,
``holds_plain``); and ``"schedule": "auto"`` with every step forced to its
plain arm (the chooser still decides, and its answer is replaced by a plain
verdict held for ``HOLD_STEPS`` steps, as a settled plain winner runs). Each
runner and drafter method is timed; ms per engine step, summed over the
timed repeats.

    python benchmarks/probes/plain_step_parts.py [width] [temperature]

Writes ``benchmarks/results/plain_step_parts.json`` (``plain_step_parts_c16.json``
and so on at another width)."""
import collections
import json
import os
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts

RUNNER_METHODS = ("execute_model", "sample_tokens", "_model_forward", "_prepare_inputs", "_update_states",
                  "_bookkeeping_sync", "take_draft_token_ids", "propose_draft_token_ids")
DRAFTER_METHODS = ("propose", "step_started", "step_finished", "_next_limits", "_count_acceptance",
                   "_time_schedule_choice", "runs_plain_instead")
CHOOSER_METHODS = ("choose", "observe")
NEW_TOKENS, REPEATS = 128, 6  # the first repeat warms every shape and is not timed


def timed(obj, name: str, seconds: collections.Counter) -> None:
    method = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.schedule_choice import HOLD_STEPS, PLAIN, ScheduleChoice

    width = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    temperature = float(sys.argv[2]) if len(sys.argv) > 2 else 0.8
    engines = {"native": LLM(CHECKPOINT, **ENGINE_ARGS),
               "held plain": LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1,
                                                                 "schedule": "round"}, **ENGINE_ARGS),
               "auto plain": LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1,
                                                                 "schedule": "auto"}, **ENGINE_ARGS)}
    held = model_runner(engines["held plain"]).drafter.controller

    def hold_plain(width: int, mix: int) -> bool:
        held.step += 1
        held._record(width, [0] * width, "width_cap")
        return True

    held.armed, held.holds_plain = False, hold_plain
    chooser = model_runner(engines["auto plain"]).drafter.chooser
    choose = chooser.choose
    # As a settled plain verdict runs: held for HOLD_STEPS steps at a time.
    chooser.choose = lambda w, m, c=0, f=None: (choose(w, m, c, f), ScheduleChoice(PLAIN, "faster", hold=HOLD_STEPS))[1]
    seconds = {name: collections.Counter() for name in engines}
    for name, llm in engines.items():
        runner = model_runner(llm)
        for method in RUNNER_METHODS:
            timed(runner, method, seconds[name])
        if name != "native":
            for method in DRAFTER_METHODS:
                timed(runner.drafter, method, seconds[name])
        if name == "auto plain":
            for method in CHOOSER_METHODS:
                timed(runner.drafter.chooser, method, seconds[name])
        timed(llm.llm_engine, "step", seconds[name])
    prompts = load_prompts("mixed")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=temperature, ignore_eos=True)
    for rep in range(REPEATS):
        batch = [prompts[(rep * width + i) % len(prompts)] for i in range(width)]
        for name, llm in engines.items():
            if rep == 1:
                seconds[name].clear()
            llm.generate(batch, params, use_tqdm=False)
    steps = (REPEATS - 1) * (NEW_TOKENS + 1)
    ms = {name: {m: round(s[m] / steps * 1e3, 4) for m in sorted(s)} for name, s in seconds.items()}
    for method in sorted(set().union(*ms.values())):
        print(f"{method:26s}", "  ".join(f"{n}: {ms[n].get(method, 0.0):6.3f}" for n in engines))
    out = ROOT / "benchmarks" / "results" / ("plain_step_parts.json" if width == 8 else f"plain_step_parts_c{width}.json")
    out.write_text(json.dumps({
        "benchmark": "plain_step_parts", "command": " ".join(["python", *sys.argv]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "width": width, "temperature": temperature,
        "new_tokens": NEW_TOKENS, "repeats_timed": REPEATS - 1,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset: OpenMP default)"),
        "ms_per_step": ms}, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
