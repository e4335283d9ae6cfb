"""Issue 13 check: is a loopspec engine whose policy always answers "plain"
as fast as native? Separates the cost of decisions (rounds explored or
chosen) from the cost of running a speculative engine at all."""
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner

    widths = [int(a) for a in sys.argv[1:]] or [8]
    prompts = load_prompts("mixed")
    engines = {"native": LLM(CHECKPOINT, **ENGINE_ARGS)}
    for name in ("forced plain", "adaptive"):
        engines[name] = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1}, **ENGINE_ARGS)
    runner = model_runner(engines["forced plain"])
    runner.drafter.controller.plan = lambda requests, other_tokens=0, context=0: ([0] * len(requests), {})
    for temperature in (0.8, 0.0):
        params = SamplingParams(max_tokens=128, temperature=temperature, ignore_eos=True, seed=None)
        for c in widths:
            rates = {name: [] for name in engines}
            for rep in range(4):
                batch = [prompts[(rep * c + i) % len(prompts)] for i in range(c)]
                for name, llm in engines.items():
                    t = time.perf_counter()
                    out = llm.generate(batch, params, use_tqdm=False)
                    n = sum(len(o.outputs[0].token_ids) for o in out)
                    if rep:  # the first repeat warms every shape
                        rates[name].append(n / (time.perf_counter() - t))
            print(f"T{temperature} c{c}", {k: sorted(round(x) for x in v) for k, v in rates.items()}, flush=True)


if __name__ == "__main__":
    main()
