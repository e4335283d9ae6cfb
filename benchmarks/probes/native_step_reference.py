"""Issue 13 check: a compiled native engine's step time at 4 requests, the
reference for the other probes (results/adaptive_checks.json)."""
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
    mixed = [json.loads(l)["prompt"] for l in open(str(ROOT / "benchmarks/prompts/mixed.jsonl")) if l.strip()]
    common = dict(dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5, enforce_eager=False, seed=0,
                  max_num_seqs=16, max_num_batched_tokens=8192, num_gpu_blocks_override=512)
    nat = LLM(str(ROOT / "checkpoints/ouro-stdlib"), **common)
    r = model_runner(nat); times = []
    ex, st = r.execute_model, r.sample_tokens
    box = {}
    def e(*a, **k):
        box["t"] = time.perf_counter(); return ex(*a, **k)
    def s(*a, **k):
        out = st(*a, **k); times.append((a[0] if False else None, time.perf_counter() - box["t"])); return out
    r.execute_model, r.sample_tokens = e, s
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for _ in range(2): nat.generate(mixed[:4], sp, use_tqdm=False)
    times.clear()
    for _ in range(3): nat.generate(mixed[:4], sp, use_tqdm=False)
    t = np.array([x[1] for x in times]) * 1e3
    print("native c4 step ms median", round(float(np.median(t)), 2), "n", len(t))
    for mode in ("plain-only", "interleaved"):
        spec = {"method": "loopspec", "num_speculative_tokens": 2, "draft_loops": 1, "adaptive": False}
        ls = LLM(str(ROOT / "checkpoints/ouro-stdlib"), speculative_config=spec, **common) if mode == "plain-only" else ls
        r2 = model_runner(ls); samples = []
        ex2, st2 = r2.execute_model, r2.sample_tokens
        b2 = {}
        def e2(so, *a, **k):
            b2["t"] = time.perf_counter(); b2["spec"] = bool(so.scheduled_spec_decode_tokens); b2["n"] = so.total_num_scheduled_tokens; return ex2(so, *a, **k)
        def s2(*a, **k):
            out = st2(*a, **k); samples.append((b2["spec"], b2["n"], time.perf_counter() - b2["t"])); return out
        r2.execute_model, r2.sample_tokens = e2, s2
        p = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True, min_p=0.0) if mode == "interleaved" else \
            SamplingParams(max_tokens=128, temperature=0.8, min_p=0.02, seed=1, ignore_eos=True)
        for _ in range(2): ls.generate(mixed[:4], p, use_tqdm=False)
        samples.clear()
        for _ in range(3): ls.generate(mixed[:4], p, use_tqdm=False)
        plain = [x[2] * 1e3 for x in samples if not x[0] and x[1] == 4]
        spec_ = [x[2] * 1e3 for x in samples if x[0]]
        print(mode, "plain(4 tok) ms median", round(float(np.median(plain)), 2) if plain else None, "n", len(plain),
              "spec ms median", round(float(np.median(spec_)), 2) if spec_ else None, "n", len(spec_))
        r2.execute_model, r2.sample_tokens = ex2, st2

main()
