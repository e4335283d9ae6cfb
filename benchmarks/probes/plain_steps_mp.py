"""Issue 13 check: plain steps of a loopspec engine whose requests all decode
plainly (min_p) against native, multiprocess engines, c16 (results/adaptive_checks.json)."""
from pathlib import Path
import json, os, sys, time
ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

def main():
    from vllm import LLM, SamplingParams
    prompts = [json.loads(l)["prompt"] for l in open(str(ROOT / "benchmarks/prompts/mixed.jsonl")) if l.strip()][:16]
    stats_off = sys.argv[1] == "nostats"
    common = dict(dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5, enforce_eager=True, seed=0,
                  disable_log_stats=stats_off, max_num_seqs=16, max_num_batched_tokens=8192, num_gpu_blocks_override=256)
    engines = {"native": LLM(str(ROOT / "checkpoints/ouro-stdlib"), **common),
               "loopspec-plain": LLM(str(ROOT / "checkpoints/ouro-stdlib"), speculative_config={"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2, "adaptive": False}, **common)}
    sp = SamplingParams(temperature=0.8, min_p=0.02, max_tokens=128, ignore_eos=True)
    for llm in engines.values(): llm.generate(prompts, sp, use_tqdm=False)
    res = {k: [] for k in engines}
    for _ in range(4):
        for name, llm in engines.items():
            t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); res[name].append(round(time.perf_counter() - t, 3))
    for k, v in res.items(): print(sys.argv[1], k, v, "median", sorted(v)[len(v)//2])

if __name__ == "__main__":
    main()
