"""Issue 13 check: the adaptive controller's plain-step samples and fit after a
workload mixing short and ~512-token prompts (results/adaptive_checks.json;
the figures there predate the context term: samples were (tokens, seconds)
then, (tokens, context, seconds) now)."""
from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts


def main():
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.policy import shape_medians

    mixed, long = load_prompts("mixed"), load_prompts("long")
    llm = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1}, **ENGINE_ARGS)
    controller = model_runner(llm).drafter.controller
    for _ in range(3):
        for prompts, n in ((mixed, 128), (long, 192)):
            for c in (1, 4, 8, 16):
                llm.generate(prompts[:c], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    plain = np.array(controller._plain, dtype=np.float64).reshape(-1, 3)
    shapes, medians, counts = shape_medians(plain)
    print("plain samples", len(plain), "(tokens, context, median ms, count):",
          [(int(s[0]), int(s[1]), round(m * 1e3, 1), int(k)) for s, m, k in zip(shapes, medians, counts)][:20])
    costs = controller.costs
    print("costs ms", [round(x * 1e3, 3) for x in costs.plain], [round(x * 1e3, 3) for x in costs.spec],
          "per 1000 context tokens", [round(x * 1e6, 3) for x in costs.context])
    print("gaps ms", {k: round(float(np.median(v)) * 1e3, 2) for k, v in controller._gaps.items() if len(v)})


main()
