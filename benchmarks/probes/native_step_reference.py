"""Issue 13 check: a compiled native engine's step time at 4 requests, the
reference for the other probes, and a loopspec engine's plain steps with and
without K=2 rounds (results/adaptive_checks.json)."""
from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts, median_ms, time_steps


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner

    mixed = load_prompts("mixed")
    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    samples = []
    time_steps(model_runner(native), samples)
    greedy = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for _ in range(2):
        native.generate(mixed[:4], greedy, use_tqdm=False)
    samples.clear()
    for _ in range(3):
        native.generate(mixed[:4], greedy, use_tqdm=False)
    print("native c4 step ms median", *median_ms(samples, spec=False))
    spec = {"method": "loopspec", "num_speculative_tokens": 2, "draft_loops": 1, "adaptive": False}
    loopspec = LLM(CHECKPOINT, speculative_config=spec, **ENGINE_ARGS)
    samples = []
    time_steps(model_runner(loopspec), samples)
    for mode, params in (("plain-only", SamplingParams(max_tokens=128, temperature=0.8, min_p=0.02, seed=1,
                                                       ignore_eos=True)),
                         ("interleaved", greedy)):
        for _ in range(2):
            loopspec.generate(mixed[:4], params, use_tqdm=False)
        samples.clear()
        for _ in range(3):
            loopspec.generate(mixed[:4], params, use_tqdm=False)
        print(mode, "plain(4 tok) ms median", *median_ms(samples, spec=False, tokens=4),
              "spec ms median", *median_ms(samples, spec=True))


main()
