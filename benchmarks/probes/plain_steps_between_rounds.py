"""Issue 13 check: plain steps with and without K=2 rounds between them, policy
pinned, in-process, compiled (results/adaptive_checks.json)."""
from pathlib import Path
import json, os, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
import numpy as np

def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner
    mixed = [json.loads(l)["prompt"] for l in open(str(ROOT / "benchmarks/prompts/mixed.jsonl")) if l.strip()]
    ls = LLM(str(ROOT / "checkpoints/ouro-stdlib"), speculative_config={"method": "loopspec", "draft_loops": 1},
             dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5, enforce_eager=False, seed=0,
             max_num_seqs=16, max_num_batched_tokens=8192, num_gpu_blocks_override=512)
    r = model_runner(ls); ctl = r.drafter.controller
    samples = []; b = {}
    ex, st = r.execute_model, r.sample_tokens
    def e(so, *a, **k):
        b["t"] = time.perf_counter(); b["spec"] = bool(so.scheduled_spec_decode_tokens); b["n"] = so.total_num_scheduled_tokens
        return ex(so, *a, **k)
    def s(*a, **k):
        out = st(*a, **k); samples.append((b["spec"], b["n"], time.perf_counter() - b["t"])); return out
    r.execute_model, r.sample_tokens = e, s
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for mode in ("all plain", "alternate", "all plain", "alternate"):
        step = {"i": 0}
        def plan(requests, other_tokens=0, mode=mode):
            step["i"] += 1
            k = 0 if mode == "all plain" or step["i"] % 2 else 2
            return [min(k, lim) for _, _, lim in requests], {}
        ctl.plan = plan
        ls.generate(mixed[:4], sp, use_tqdm=False)
        samples.clear()
        for _ in range(2): ls.generate(mixed[:4], sp, use_tqdm=False)
        plain = [x[2] * 1e3 for x in samples if not x[0] and x[1] == 4]
        spec = [x[2] * 1e3 for x in samples if x[0]]
        print(mode, "plain(4) ms median", round(float(np.median(plain)), 2), "n", len(plain),
              "spec ms median", round(float(np.median(spec)), 2) if spec else None, "n", len(spec), flush=True)

main()
