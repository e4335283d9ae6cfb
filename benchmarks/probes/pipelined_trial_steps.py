"""Issue 13 diagnostic: where a fixed pipelined engine's trial loses to
native's, step by step. A native engine and a pipelined loopspec engine
(K 16, draft loops D) decode the same batch in turn (the sweep's trial:
new prompts each repeat, seeded when sampled, no early stop); per repeat,
each pipelined step's milliseconds (start to next start) and tokens
committed per request, and native's steps grouped as the pipelined steps
committed them (its prefill step, then as many steps as each pipelined
step committed tokens): so a pipelined step is set against the native
steps that produced the same tokens. Then, over the repeats, the median
ratio of native's time to the pipelined engine's for the middle steps, the
first (prefill) and the last (cut short by max_tokens).

    python benchmarks/probes/pipelined_trial_steps.py [width] [temperature] [reps] [draft_loops] [short|long]
"""
import statistics
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, cell_from_argv


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_loopspec.engine_internals import model_runner

    width, temperature, reps, d, prompts, new_tokens = cell_from_argv(sys.argv, 8, 0.8, 5)
    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    pipelined = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": d, "schedule": "pipelined",
                                                    "num_speculative_tokens": 16}, **ENGINE_ARGS)
    drafter = model_runner(pipelined).drafter
    steps = []  # [start, tokens committed per request] of each pipelined step
    started, propose = drafter.step_started, drafter.propose

    def logged_started(scheduler_output):
        steps.append([time.perf_counter(), None])
        return started(scheduler_output)

    def logged_propose(sampled, *args, **kwargs):
        steps[-1][1] = sum(map(len, sampled)) / max(len(sampled), 1)
        return propose(sampled, *args, **kwargs)

    drafter.step_started, drafter.propose = logged_started, logged_propose
    native_runner = model_runner(native)
    native_starts = []
    execute = native_runner.execute_model

    def timed_execute(scheduler_output, *args, **kwargs):
        native_starts.append(time.perf_counter())
        return execute(scheduler_output, *args, **kwargs)

    native_runner.execute_model = timed_execute
    ratios = {"first": [], "middle": [], "last": [], "trial": []}
    for rep in range(reps + 1):  # repeat 0 warms both engines up, untimed
        batch = [prompts[(rep * width + i) % len(prompts)] for i in range(width)]
        params = [SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True,
                                 seed=1000 + i if temperature > 0 else None) for i in range(width)]
        native_starts.clear()
        native.generate(batch, params, use_tqdm=False)
        native_end = time.perf_counter()
        steps.clear()
        pipelined.generate(batch, params, use_tqdm=False)
        end = time.perf_counter()
        if not rep:
            continue
        seconds = [b[0] - a[0] for a, b in zip(steps, steps[1:])] + [end - steps[-1][0]]
        committed = [c for _, c in steps]
        native_seconds = [b - a for a, b in zip(native_starts, native_starts[1:])] + [native_end - native_starts[-1]]
        groups, at = [native_seconds[0]], 1
        for c in committed[1:]:
            groups.append(sum(native_seconds[at:at + int(round(c))]))
            at += int(round(c))
        trial = sum(groups) / sum(seconds)
        ratios["trial"].append(trial)
        ratios["first"].append(groups[0] / seconds[0])
        ratios["last"].append(groups[-1] / seconds[-1])
        ratios["middle"].append(sum(groups[1:-1]) / sum(seconds[1:-1]))
        print(f"rep {rep}: native {sum(groups) * 1e3:.0f} ms, pipelined {sum(seconds) * 1e3:.0f} ms, "
              f"native over pipelined {trial:.3f}")
        print("    pipelined steps (ms / tokens per request):",
              " ".join(f"{s * 1e3:.0f}/{c:.0f}" for s, c in zip(seconds, committed)))
        print("    native, the same tokens (ms):", " ".join(f"{g * 1e3:.0f}" for g in groups))
    print(f"width {width}, T={temperature}, d={d}, {reps} repeats; native over pipelined, median:",
          {part: round(statistics.median(values), 3) for part, values in ratios.items()})


if __name__ == "__main__":
    main()
