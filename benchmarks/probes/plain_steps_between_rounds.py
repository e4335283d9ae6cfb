"""Issue 13 check: plain steps with and without K=2 rounds between them, policy
pinned, in-process, compiled (results/adaptive_checks.json)."""
from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts, median_ms, time_steps


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner

    mixed = load_prompts("mixed")
    llm = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1}, **ENGINE_ARGS)
    runner = model_runner(llm)
    samples = []
    time_steps(runner, samples)
    greedy = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for mode in ("all plain", "alternate", "all plain", "alternate"):
        step = {"i": 0}

        def plan(requests, other_tokens=0, context=0, mode=mode):
            step["i"] += 1
            k = 0 if mode == "all plain" or step["i"] % 2 else 2
            return [min(k, limit) for _, _, limit in requests], {}

        runner.drafter.controller.plan = plan
        llm.generate(mixed[:4], greedy, use_tqdm=False)
        samples.clear()
        for _ in range(2):
            llm.generate(mixed[:4], greedy, use_tqdm=False)
        print(mode, "plain(4) ms median", *median_ms(samples, spec=False, tokens=4),
              "spec ms median", *median_ms(samples, spec=True), flush=True)


main()
