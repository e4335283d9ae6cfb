"""Issue 13 diagnostic: how far kv_sweep.py's warm-up (16 greedy tokens at
each concurrency, short prompts) takes an ``"auto"`` d1 engine's round
policy toward its cost model (``WARMUP_PLAIN_SAMPLES`` plain and
``WARMUP_SPEC_SAMPLES`` round samples), and what the first 128-token c1
trial adds. Prints the policy's sample counts, whether its costs are the
startup seed or a fit (or none), and the chooser's decisions after each.

    python benchmarks/probes/policy_warmup_samples.py
"""
import _probe  # noqa: F401  (environment before vLLM)
from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner

    llm = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1, "schedule": "auto"},
              **ENGINE_ARGS)
    drafter = model_runner(llm).drafter
    policy = drafter.controller
    prompts = load_prompts("mixed")

    def state(tag: str) -> None:
        print(f"{tag}: plain samples {len(policy._plain)}, round samples {len(policy._spec)}, "
              f"costs {'seeded' if policy.seeded else 'fitted' if policy.costs is not None else 'none'}, chooser {dict(drafter.chooser.decisions)}", flush=True)

    state("start")
    for c in (1, 4, 8, 16):
        llm.generate(prompts[:c], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
        state(f"after the warm-up trial at c{c}")
    llm.generate(prompts[:1], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)
    state("after a 128-token c1 trial")


if __name__ == "__main__":
    main()
