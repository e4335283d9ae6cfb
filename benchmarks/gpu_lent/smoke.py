"""Smallest proof: native and loopspec K4 d2 greedy on the tiny checkpoint, fp32, eager."""
import os, sys, time
from pathlib import Path
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from vllm_loopspec import register
register()
from vllm_loopspec.tools.make_checkpoint import make_checkpoint
from vllm import LLM, SamplingParams
from prompts import SHORT, MEDIUM

ck = make_checkpoint(Path("/tmp/tiny-ckpt"), preset="tiny", seed=0)
prompts = [SHORT[0], SHORT[2], MEDIUM[0], SHORT[5]]
params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (24, 7, 31, 16)]
kw = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=16,
          gpu_memory_utilization=0.3, enforce_eager=True, seed=0)
t = time.time()
native = LLM(str(ck), **kw)
print("native up", round(time.time() - t, 1), "s", flush=True)
try:
    be = native.llm_engine.model_executor.driver_worker.worker.model_runner.attn_groups[0][0].backend.get_name()
    print("attention backend", be)
except Exception as e:
    print("backend?", repr(e))
a = [list(o.outputs[0].token_ids) for o in native.generate(prompts, params, use_tqdm=False)]
print("native", [len(x) for x in a], a[0][:8], flush=True)
t = time.time()
spec = LLM(str(ck), speculative_config={"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2, "adaptive": False}, **kw)
print("loopspec up", round(time.time() - t, 1), "s", flush=True)
b = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, params, use_tqdm=False)]
print("loopspec", [len(x) for x in b], b[0][:8])
print("EQUAL" if a == b else "DIFFERENT")
sys.exit(0 if a == b else 1)
