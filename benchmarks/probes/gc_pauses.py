"""Issue 13 diagnostic: how much of a timed trial is Python's cyclic
garbage collector, with several engines in one process as in the sweeps.
Builds ENGINES engines (native plus auto ones), decodes the sweep's short
greedy cell at widths 1 and 8 on each in turn, and prints per trial its
seconds and the collections inside it (count and milliseconds by
generation). vLLM freezes the heap after building an engine
(``gc.get_freeze_count()``), so collections stay small. Prints only.

    python benchmarks/probes/gc_pauses.py [ENGINES]
"""
import gc
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts


def main():
    from vllm import LLM, SamplingParams

    n = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 3
    engines = [LLM(CHECKPOINT, **ENGINE_ARGS)]
    for i in range(n - 1):
        engines.append(LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1 + i % 3,
                                                           "schedule": "auto"}, **ENGINE_ARGS))
    prompts = load_prompts("mixed")
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for llm in engines:
        llm.generate(prompts[:8], SamplingParams(max_tokens=16), use_tqdm=False)
    pauses = []
    start = {}

    def callback(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - start["t"]))

    gc.callbacks.append(callback)
    print("objects tracked:", len(gc.get_objects()), "frozen:", gc.get_freeze_count(), flush=True)
    for rep in range(3):
        for c in (1, 8):
            for i, llm in enumerate(engines):
                pauses.clear()
                t0 = time.perf_counter()
                llm.generate(prompts[rep * c:rep * c + c], params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                by_gen = {g: (sum(1 for p in pauses if p[0] == g), sum(p[1] for p in pauses if p[0] == g) * 1e3)
                          for g in (0, 1, 2)}
                print(f"rep {rep} c{c} engine {i}: {seconds:.3f} s, gc " +
                      " ".join(f"g{g}:{k}/{ms:.1f}ms" for g, (k, ms) in by_gen.items()), flush=True)


if __name__ == "__main__":
    main()
