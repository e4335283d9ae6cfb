"""loopspec beyond one device: tensor- and data-parallel serving on this machine.

    PYTHONPATH=. .venv/bin/python benchmarks/parallel_decode.py            # every arm, JSON to results/
    PYTHONPATH=. .venv/bin/python benchmarks/parallel_decode.py --arms tp1-native tp2-loopspec

Each arm is one ``vllm serve`` process (float32, eager, max-model-len 1024,
seed 0, VLLM_CPU_KVCACHE_SPACE=1, OMP_WAIT_POLICY=PASSIVE), started after the
previous one has exited. Arms differ in the parallel layout and in
``--speculative-config`` (loopspec K=4, d=2 unless ``--spec``):

* ``tp1-*``  one engine, one worker (threads on both cores);
* ``tp2-*``  ``--tensor-parallel-size 2`` (mp executor, one worker per core:
  ``VLLM_CPU_OMP_THREADS_BIND=0|1``);
* ``dp2-*``  ``--data-parallel-size 2`` (two engines, one core each).

There is no PP arm: loopspec refuses PP, and vLLM refuses native PP for
Ouro too (the model does not implement ``SupportsPP``: its loops re-apply
every layer, so a token would cross the pipeline ``R`` times).

Per arm: the same ``--num-prompts`` prompts (``benchmarks/prompts``, round
robin over code, text, repetitive) are sent at ``--concurrency`` as greedy
``/v1/completions`` of exactly ``--output-len`` tokens; after a warm-up
request, the arm reports output tokens per second over the wall time of the
batch, the token ids of every completion (so arms can be compared token for
token), and loopspec's counters per data-parallel replica from ``/metrics``.

Two cores bound every figure: TP=2 and DP=2 give each worker one core, so
they measure the parallel code paths (collectives, replica routing) rather
than the scaling a multi-device host would see.

Tests import :func:`run_arm` (``tests/test_parallel.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_loopspec.server_process import VllmServer  # noqa: E402

LOOPSPEC = {"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2}

# arm name -> (extra `vllm serve` arguments, extra environment)
LAYOUTS = {
    "tp1": ([], {}),
    "tp2": (["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"],
            {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    "dp2": (["--data-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    # TP=2 through Ray actors on a local Ray cluster (needs `ray` and the
    # CPU resource mapping of vllm_loopspec.patches; see README).
    "tp2ray": (["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"],
               {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
}
ARMS = ["tp1-native", "tp1-loopspec", "tp2-native", "tp2-loopspec", "dp2-native", "dp2-loopspec"]


def server_args(arm: str, spec: dict | None = None) -> tuple[list[str], dict[str, str]]:
    layout, method = arm.split("-", 1)
    args, env = LAYOUTS[layout]
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "16",
            "--gpu-memory-utilization", "0.5", "--seed", "0", *args]
    if method == "loopspec":
        args += ["--speculative-config", json.dumps(spec or LOOPSPEC)]
    elif method != "native":
        raise ValueError(f"unknown method in arm {arm!r}")
    return args, {"OMP_WAIT_POLICY": "PASSIVE", "VLLM_CPU_KVCACHE_SPACE": "1", **env}


def load_prompts(n: int) -> list[str]:
    sets = [[json.loads(line)["prompt"] for line in (ROOT / "benchmarks" / "prompts" / f"{name}.jsonl").open()]
            for name in ("code", "text", "repetitive")]
    return [sets[i % 3][i // 3 % len(sets[i % 3])] for i in range(n)]


def _metric_samples(text: str, name: str) -> dict[str, float]:
    """``{label string: value}`` of one metric on /metrics."""
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def replica_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """loopspec's scalar counters per data-parallel replica:
    ``{engine: {counter: value}}``."""
    out: dict[str, dict[str, float]] = {}
    for name in ("rounds", "speculating_rows", "drafted_tokens", "accepted_tokens"):
        for labels, value in _metric_samples(metrics_text, f"loopspec:replica_{name}_total").items():
            engine = re.search(r'engine="([^"]*)"', labels).group(1)
            out.setdefault(engine, {})[name] = value
    return out


def run_arm(checkpoint: str | Path, arm: str, prompts: list, output_len: int, concurrency: int,
            spec: dict | None = None, log_path: Path | None = None, extra_env: dict | None = None,
            temperature: float = 0.0, seed: int | None = None) -> dict:
    """Serve ``checkpoint`` in ``arm``'s layout, complete every prompt (text
    or token ids) and return token ids, throughput and per-replica counters."""
    args, env = server_args(arm, spec)
    with VllmServer(checkpoint, *args, log_path=log_path, env={**env, **(extra_env or {})}) as srv:
        model = srv.model_name()

        def complete(i_prompt):
            i, prompt = i_prompt
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature,
                    "ignore_eos": True, "return_token_ids": True}
            if seed is not None:
                body["seed"] = seed + i
            return srv.post("/v1/completions", body)["choices"][0]["token_ids"]

        complete((0, prompts[0]))  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outputs = list(pool.map(complete, enumerate(prompts)))
        wall = time.perf_counter() - start
        time.sleep(1.0)  # worker snapshots reach /metrics through a 0.2 s flush thread
        metrics = srv.metrics()
    tokens = sum(len(o) for o in outputs)
    return {
        "arm": arm, "args": args, "env": env, "num_prompts": len(prompts), "output_len": output_len,
        "concurrency": concurrency, "wall_s": round(wall, 4), "output_tok_s": round(tokens / wall, 2),
        "replicas": replica_counters(metrics), "outputs": outputs, "load_avg": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "ouro-stdlib"))
    parser.add_argument("--arms", nargs="+", default=ARMS)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="runs per arm (interleaved); the median is reported")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "parallel.json"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOOPSPEC_DEBUG", "0")
    prompts = load_prompts(args.num_prompts)
    logs = Path(tempfile.mkdtemp(prefix="parallel-decode-"))
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for rep in range(args.repeats):
        for arm in args.arms:
            print(f"[{rep}] {arm} ...", flush=True)
            result = run_arm(args.checkpoint, arm, prompts, args.output_len, args.concurrency,
                             log_path=logs / f"{arm}-{rep}.log")
            print(f"    {result['output_tok_s']} tok/s  replicas={result['replicas']}", flush=True)
            runs[arm].append(result)
    reference = runs[args.arms[0]][0]["outputs"]
    arms = {}
    for arm, results in runs.items():
        rates = sorted(r["output_tok_s"] for r in results)
        first = results[0]
        arms[arm] = {
            "args": first["args"], "env": first["env"],
            "output_tok_s": rates[len(rates) // 2], "output_tok_s_runs": [r["output_tok_s"] for r in results],
            "replicas": first["replicas"], "load_avg": first.get("load_avg"),
            "same_tokens_as_" + args.arms[0]: all(r["outputs"] == reference for r in results),
        }
    out = {
        "benchmark": "parallel_decode",
        "command": "python benchmarks/parallel_decode.py " + " ".join(sys.argv[1:]),
        "timestamp": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "checkpoint": Path(args.checkpoint).name, "num_prompts": args.num_prompts,
        "output_len": args.output_len, "concurrency": args.concurrency, "repeats": args.repeats,
        "loopspec": LOOPSPEC, "baseline": args.arms[0], "arms": arms,
        "caveat": "2 cores: TP=2 and DP=2 give each worker one core; the figures measure the "
                  "parallel code paths, not multi-device scaling.",
        "logs": str(logs),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({a: (v["output_tok_s"], v["same_tokens_as_" + args.arms[0]]) for a, v in arms.items()}))


if __name__ == "__main__":
    main()
