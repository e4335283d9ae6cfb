"""Async against sync loopspec rounds, and native decoding (issue 15).

    PYTHONPATH=. .venv/bin/python benchmarks/async_decode.py          # JSON to results/async_decode.json

Three offline engines on the bundled checkpoint, built once and used in
turn (vLLM's default compiled mode, engine core in its own process, so that
async scheduling really overlaps the scheduling of step t+1 with step t):

* ``native``: no speculation (vLLM's CPU platform keeps async off for it);
* ``loopspec sync``: the default loopspec (adaptive policy, d = R // 2);
* ``loopspec async``: the same with ``async_scheduling=True`` (patch 14).

For each concurrency and temperature (0: greedy; > 0: a seed per request,
the same for every arm) every arm decodes the same prompts
(``benchmarks/prompts/mixed.jsonl``, cycled) for ``--new-tokens`` tokens,
EOS ignored, in ``--repeats`` interleaved trials after a warm-up. Reported:
median output tok/s and spread, and whether greedy outputs equal native's.
On CPU, async cannot pay: the "device" is the same two cores the scheduler
runs on, and the copies it overlaps are no-ops (docs/async-scheduling.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from host import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ARMS = {
    "native": dict(speculative_config=None),
    "loopspec sync": dict(speculative_config={"method": "loopspec"}),
    "loopspec async": dict(speculative_config={"method": "loopspec"}, async_scheduling=True),
}


def load_prompts(n: int) -> list[str]:
    lines = (ROOT / "benchmarks" / "prompts" / "mixed.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    return [prompts[i % len(prompts)] for i in range(n)]


def trial(llm, prompts, temperature: float, new_tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True,
                             seed=1000 + i if temperature > 0 else None) for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(len(t) for t in tokens) / wall, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "async_decode.json")
    args = ap.parse_args()

    import numpy as np
    import torch
    import vllm
    from vllm import LLM

    common = dict(dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5, seed=0,
                  max_num_seqs=max(args.concurrency), max_num_batched_tokens=8192, num_gpu_blocks_override=512)
    engines = {}
    for name, extra in ARMS.items():
        t0 = time.perf_counter()
        engines[name] = LLM(str(args.checkpoint), **common, **extra)
        config = engines[name].llm_engine.vllm_config
        print(f"built {name} in {time.perf_counter() - t0:.0f} s (async scheduling: "
              f"{config.scheduler_config.async_scheduling})", flush=True)
    started = time.time()
    results: dict = {}
    for temperature in args.temperatures:
        for c in args.concurrency:
            prompts = load_prompts(c)
            for llm in engines.values():  # warm-up: this shape's first steps compile or select kernels
                trial(llm, prompts, temperature, 16)
            runs: dict = {name: [] for name in engines}
            tokens: dict = {}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    rate, toks = trial(llm, prompts, temperature, args.new_tokens)
                    runs[name].append(rate)
                    tokens[name] = toks
            cell = {}
            for name, rates in runs.items():
                median = float(np.median(rates))
                cell[name] = {"median_tokens_per_s": median, "runs": rates,
                              "vs_native": median / float(np.median(runs["native"]))}
                if temperature == 0:
                    cell[name]["greedy_equals_native"] = tokens[name] == tokens["native"]
            cell["loopspec async"]["vs_sync"] = (cell["loopspec async"]["median_tokens_per_s"]
                                                 / cell["loopspec sync"]["median_tokens_per_s"])
            results.setdefault(f"T{temperature:g}", {})[str(c)] = cell
            print(f"T={temperature:g} c={c}: " + ", ".join(f"{n} {cell[n]['median_tokens_per_s']:.0f}"
                                                        for n in engines), flush=True)
    record = {
        "benchmark": "async_decode", "checkpoint": str(args.checkpoint.relative_to(ROOT)),
        "arms": {n: {k: v for k, v in a.items()} for n, a in ARMS.items()},
        "concurrency": args.concurrency, "temperatures": args.temperatures, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "engine": "vLLM LLM, default compiled mode, engine core in its own process",
        "command": "python benchmarks/async_decode.py " + " ".join(sys.argv[1:]),
        "vllm": vllm.__version__, "torch": torch.__version__, "cpu": cpu_name(),
        "cores": os.cpu_count(), "machine_load": list(os.getloadavg()),
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "wall_seconds": time.time() - started, "results": results,
        "note": "CPU: async scheduling overlaps the scheduler with the forward on the same two cores and its "
                "device copies are no-ops, so it cannot pay here; the GPU figure needs make gpu-check.",
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
