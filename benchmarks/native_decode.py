"""Native (no speculation) decode throughput of an Ouro checkpoint in vLLM.

    python benchmarks/native_decode.py [--checkpoint DIR] [--repeats 5]

Concurrency c: c requests of equal prompt length generate exactly
``--new-tokens`` tokens each (EOS ignored) in one ``LLM.generate`` call; the
figure is generated tokens / wall time of that call. Prompts are short so the
prefill share is small; the full K-sweep benchmark (prefill outside the timed
window) is ``benchmarks/ksweep.py``. Raw repeats go to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from host import cpu_name  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "def read_config(path):\n",
    "class LRUCache:\n    def __init__(self, capacity",
    "import os\nimport sys\n\n",
    '"""Parse command line arguments."""\n',
    "for key, value in sorted(items",
    "    raise ValueError(",
    "def __repr__(self):\n        return",
    "# Helper functions for the",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "native_decode.json")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm_loopspec.demo import default_checkpoint

    ckpt = args.checkpoint or default_checkpoint()
    llm = LLM(str(ckpt), dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5,
              enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)  # warm up
    results = {}
    for c in args.concurrency:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            runs.append({"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed})
        tps = [r["tokens_per_s"] for r in runs]
        results[str(c)] = {
            "runs": runs,
            "median_tokens_per_s": statistics.median(tps),
            "min_tokens_per_s": min(tps),
            "max_tokens_per_s": max(tps),
        }
        print(f"concurrency {c}: median {statistics.median(tps):.1f} tok/s "
              f"(min {min(tps):.1f}, max {max(tps):.1f})", flush=True)
    import torch
    import vllm

    record = {
        "checkpoint": str(ckpt.relative_to(ROOT) if ckpt.is_relative_to(ROOT) else ckpt),
        "new_tokens": args.new_tokens,
        "dtype": "float32",
        "enforce_eager": True,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
