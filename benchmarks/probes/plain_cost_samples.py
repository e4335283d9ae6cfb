"""Issue 13 check: the adaptive controller's plain-step samples and fit after a
workload mixing short and ~512-token prompts (results/adaptive_checks.json)."""
from pathlib import Path
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
import numpy as np

def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.policy import shape_medians
    mixed = [json.loads(l)["prompt"] for l in open(str(ROOT / "benchmarks/prompts/mixed.jsonl")) if l.strip()]
    long = [json.loads(l)["prompt"] for l in open(str(ROOT / "benchmarks/prompts/long.jsonl")) if l.strip()]
    llm = LLM(str(ROOT / "checkpoints/ouro-stdlib"), speculative_config={"method": "loopspec", "draft_loops": 1}, dtype="float32",
              max_model_len=1024, gpu_memory_utilization=0.5, enforce_eager=False, seed=0, max_num_seqs=16,
              max_num_batched_tokens=8192, num_gpu_blocks_override=512)
    ctl = model_runner(llm).drafter.controller
    for rep in range(3):
        for prompts, n in ((mixed, 128), (long, 192)):
            for c in (1, 4, 8, 16):
                llm.generate(prompts[:c], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    for name, dq in (("all plain", ctl._plain), ("decode plain", [])):
        a = np.array(dq, dtype=np.float64).reshape(-1, 2)
        if len(a):
            shapes, med, cnt = shape_medians(a)
            print(name, len(a), [(int(s[0]), round(m * 1e3, 1), int(k)) for s, m, k in zip(shapes, med, cnt)][:20])
    print("costs ms", [round(x * 1e3, 3) for x in ctl.costs.plain], [round(x * 1e3, 3) for x in ctl.costs.spec])
    print("gaps ms", {k: round(float(np.median(v)) * 1e3, 2) for k, v in ctl._gaps.items() if len(v)})

main()
