"""Issue 13 diagnostic: one adaptive engine and native through the sweep's
cell order (greedy then T=0.8; short then long; concurrency 1, 4, 8, 16;
3 repeats), printing per trial the paired throughput ratio and the policy's
decisions by reason and largest K (``poli8``: the policy chose K 8;
``widt0``: held plain under the width cap; ``meas0``: plain because measured
rounds lost; ``expl``: exploration), with the cap left after the trial.
Shows which decisions a cell's ratio comes from; prints only, writes nothing.

    python benchmarks/probes/policy_trace.py D [sampled|greedy]

Both settings use the ``mixed`` prompts (the sweep's long setting uses
longer ones), 128 and 192 new tokens."""
import collections
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner

    draft_loops = int(sys.argv[1])
    only = sys.argv[2] if len(sys.argv) > 2 else None
    prompts = load_prompts("mixed")
    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    adaptive = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": draft_loops}, **ENGINE_ARGS)
    controller = model_runner(adaptive).drafter.controller
    for rep in range(3):
        for temperature in (0.0, 0.8):
            for setting, new_tokens in (("short", 128), ("long", 192)):
                for width in (1, 4, 8, 16):
                    batch = [prompts[(rep * width + i) % len(prompts)] for i in range(width)]
                    params = SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True)
                    start = time.perf_counter()
                    native.generate(batch, params, use_tqdm=False)
                    native_s = time.perf_counter() - start
                    first_step = controller.step
                    start = time.perf_counter()
                    adaptive.generate(batch, params, use_tqdm=False)
                    adaptive_s = time.perf_counter() - start
                    steps = [r for r in controller.history if r.step > first_step]
                    counts = collections.Counter(f"{r.reason[:4]}{max(r.drafts, default=0)}" for r in steps)
                    if only is None or (only == "sampled") == (temperature > 0):
                        print(f"rep{rep} T{temperature} {setting} c{width}: {native_s / adaptive_s:.2f}x native, "
                              f"{len(steps)} steps, cap {controller.cap} (mix {controller.cap_mix})",
                              dict(sorted(counts.items())), flush=True)


if __name__ == "__main__":
    main()
