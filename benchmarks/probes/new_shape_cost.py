"""Issue 13 diagnostic: what a step of a batch shape the engine has not run
before costs, against later steps of that shape. The adaptive policy varies
K per step, so its engine meets new shapes (scheduled token counts) long
after warm-up; a fixed-K engine meets few. Runs one engine (``adaptive`` at
d, or ``fixed`` K) over the sweep's greedy short cells (widths 1, 4, 8, 16),
REPEATS times with new prompts, timing every step, and prints per repeat
the steps of new shapes, their total milliseconds and what the same shapes
cost the next time they ran. Prints only.

    python benchmarks/probes/new_shape_cost.py adaptive|fixed D [K] [REPEATS]
"""
import statistics
import sys

from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts, time_steps


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner

    kind, d = sys.argv[1], int(sys.argv[2])
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    spec = {"method": "loopspec", "draft_loops": d}
    if kind == "fixed":
        spec |= {"num_speculative_tokens": k, "adaptive": False}
    llm = LLM(CHECKPOINT, speculative_config=spec, **ENGINE_ARGS)
    prompts = load_prompts("mixed")
    for c in (1, 4, 8, 16):  # the sweep's warm-up: 16 tokens at each width
        llm.generate(prompts[:c], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    samples = []
    time_steps(model_runner(llm), samples)
    seen, first_cost = set(), {}
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    later = {}
    for rep in range(repeats):
        start = len(samples)
        for c in (1, 4, 8, 16):
            llm.generate([prompts[(rep * c + i) % len(prompts)] for i in range(c)], params, use_tqdm=False)
        new = 0
        new_ms = 0.0
        for is_spec, n, s in samples[start:]:
            shape = (is_spec, n)
            if shape not in seen:
                seen.add(shape)
                first_cost[shape] = s
                new += 1
                new_ms += s * 1e3
            else:
                later.setdefault(shape, []).append(s)
        total = sum(s for _, _, s in samples[start:]) * 1e3
        print(f"repeat {rep}: {len(samples) - start} steps, {total:.0f} ms; new shapes {new} steps, {new_ms:.0f} ms",
              flush=True)
    excess = [(first_cost[sh] - statistics.median(v)) * 1e3 for sh, v in later.items() if sh in first_cost]
    print(f"shapes seen again: {len(excess)}; first run's excess over their median: "
          f"median {statistics.median(excess):.1f} ms, total {sum(excess):.0f} ms")


if __name__ == "__main__":
    main()
