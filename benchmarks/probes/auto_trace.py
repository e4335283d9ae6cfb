"""Issue 13 diagnostic: one ``"schedule": "auto"`` engine and native on the
sweep's workload of one cell, 6 repeats (new prompts each), printing per
repeat the throughput ratio (whole generate calls, prefill included), each
step's arm, largest K and milliseconds to the next step's start
(``pip16:42``; ``-``: not a chosen step; a trailing ``x``: a chosen
step that is no sample of its arm, the first of its shape or the
policy's warm-up), and the chooser's choices
(arm/reason); at the end its decisions and rates per key. Prints only.

    python benchmarks/probes/auto_trace.py D WIDTH TEMPERATURE short|long
"""
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts

def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner
    d, width, temp, setting = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    prompts = load_prompts("long" if setting == "long" else "mixed")
    toks = 192 if setting == "long" else 128
    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": d, "schedule": "auto"}, **ENGINE_ARGS)
    drafter = model_runner(auto).drafter
    ch = drafter.chooser
    log = []
    choose = ch.choose

    def logged_choose(w, m, ctx=0, in_flight=None):
        out = choose(w, m, ctx, in_flight)
        log.append(["choose", w, ctx, out.arm, out.reason, out.hold])
        return out

    ch.choose = logged_choose
    started = drafter.step_started

    def logged_step_started(so):
        held = drafter._next_held  # a held plain step: credited, never a sample
        started(so)
        # Whether the step will be a sample of its arm ("x": excluded as the
        # first of its shape or the policy's warm-up).
        kept = drafter.step_arm is None or drafter._choice_step is not None or held
        log.append(["step", drafter.step_arm, drafter.step_drafts, so.total_num_scheduled_tokens, time.perf_counter(),
                    "" if kept else "x"])

    drafter.step_started = logged_step_started
    params = SamplingParams(max_tokens=toks, temperature=temp, ignore_eos=True)
    for rep in range(6):
        batch = [prompts[(rep * width + i) % len(prompts)] for i in range(width)]
        start = time.perf_counter()
        native.generate(batch, params, use_tqdm=False)
        tn = time.perf_counter() - start
        log.clear()
        start = time.perf_counter()
        auto.generate(batch, params, use_tqdm=False)
        ta = time.perf_counter() - start
        steps = [e for e in log if e[0] == "step"]
        seq = []
        for i, e in enumerate(steps):
            dt = (steps[i + 1][4] - e[4]) * 1e3 if i + 1 < len(steps) else 0
            seq.append(f"{(e[1] or '-')[:3]}{e[2]}:{dt:.0f}{e[5]}")
        chooses = [f"{e[3][:3]}/{e[4][:2]}" for e in log if e[0] == "choose"]
        print(f"rep {rep} ratio {tn/ta:.2f} steps {len(steps)}")
        print("   ", " ".join(seq))
        print("   ", " ".join(chooses))
    print(ch.decisions)
    for k, key in ch._keys.items():
        print(k, {a: (round(r.rate), r.samples, round(r.step_seconds * 1e3, 1)) for a, r in key.arms.items()})

if __name__ == "__main__":
    main()
