"""Cost of one loop pass against the number of rows it processes, on this CPU.

    python benchmarks/cost_curve.py      # both shapes, ~8 min here

Verification runs the deep loops over ``c·(K+1)`` rows at once; the RFC's
bet is that this costs about as much as ``c`` rows while the pass is
weight-bound. This script measures where that stops being true here, inside
vLLM's own engine and model code: ``r`` requests decode together (one row
each), and the model's ``run_loops`` is timed per call, divided by the loops
it ran. Two shapes:

* ``bundled``: the trained checkpoint (hidden 256, 2 layers): weights fit in
  cache, so the cost is per-op overhead;
* ``large``: Ouro-1.4B's layer shape (hidden 2048, intermediate 5632, 16
  heads) with 2 layers, random weights (``load_format=dummy``), vocab cut to
  4096: ~400 MB of fp32 weights per loop, far larger than any CPU cache.

The report (``benchmarks/report.py``) feeds ``L(r)`` into the cost-model
ceiling for the large shape: verification of ``c·(K+1)`` rows costs
``L(c·(K+1))`` per deep loop instead of ``L(c)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm_loopspec.engine_internals import model_runner  # noqa: E402
from host import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROMPT_TOKENS = 8


def large_shape_dir(layers: int) -> Path:
    """Ouro-1.4B's layer shape with ``layers`` layers and a 4096 vocabulary."""
    config = json.loads((ROOT / "configs" / "ouro-1.4b.config.json").read_text())
    config |= {"num_hidden_layers": layers, "max_window_layers": layers, "vocab_size": 4096,
               "max_position_embeddings": 2048, "torch_dtype": "float32"}
    out = Path(tempfile.mkdtemp(prefix="ouro-large-"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def layer_weight_count(config) -> int:
    """Weights one loop reads, from the config (vLLM's CPU linear layers
    repack their weights, so ``parameters()`` does not see them)."""
    h, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o; k, v
    mlp = 3 * h * config.intermediate_size  # gate, up, down
    return config.num_hidden_layers * (attention + mlp + 2 * h)


def loop_timer(llm) -> list[float]:
    """Time every ``run_loops`` call of this engine's model, per loop run."""
    runner = model_runner(llm)
    model = runner.model.model
    samples: list[float] = []
    original = model.run_loops

    def timed(hidden_states, positions, start, end):
        t0 = time.perf_counter()
        out = original(hidden_states, positions, start, end)
        samples.append((time.perf_counter() - t0) / (end - start))
        return out

    model.run_loops = timed
    return samples


def measure(llm, samples: list[float], rows: int, steps: int, vocab: int) -> tuple[list[float], list[float]]:
    """Decode ``rows`` requests together; per-loop and per-step ms of the timed steps."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        ids = [(7 * i + 13 * j + 1) % vocab for j in range(PROMPT_TOKENS)]
        engine.add_request(f"r{rows}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": ids}, params)
    started: set[str] = set()
    while len(started) < rows:  # prefill (and the first token) outside the timing
        started |= {o.request_id for o in engine.step()}
    engine.step()  # first step with every row in decode: warm shapes
    samples.clear()
    step_times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    return [s * 1e3 for s in samples], [t * 1e3 for t in step_times]


def summarize(rows: int, loop_ms: list[float], step_ms: list[float]) -> dict:
    quart = statistics.quantiles(loop_ms, n=4) if len(loop_ms) >= 2 else [loop_ms[0]] * 3
    return {"rows": rows, "loop_ms": statistics.median(loop_ms), "q1": quart[0], "q3": quart[2],
            "step_ms": statistics.median(step_ms), "samples": len(loop_ms)}


def curve(checkpoint: Path, rows_list: list[int], steps: int, passes: int, dummy: bool) -> dict:
    from vllm import LLM

    max_rows = max(rows_list)
    llm = LLM(str(checkpoint), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              gpu_memory_utilization=0.5, max_num_seqs=max_rows, max_num_batched_tokens=max(2048, max_rows * 16),
              num_gpu_blocks_override=max_rows + 8, load_format="dummy" if dummy else "auto",
              skip_tokenizer_init=dummy)
    config = llm.llm_engine.vllm_config.model_config.hf_config
    layer_params = layer_weight_count(config)
    samples = loop_timer(llm)
    loops_ms: dict[int, list[float]] = {r: [] for r in rows_list}
    steps_ms: dict[int, list[float]] = {r: [] for r in rows_list}
    for p in range(passes):  # alternate the order so slow drift does not tilt the curve
        for rows in rows_list if p % 2 == 0 else rows_list[::-1]:
            loop_ms, step_ms = measure(llm, samples, rows, steps, config.vocab_size)
            loops_ms[rows] += loop_ms
            steps_ms[rows] += step_ms
    points = [summarize(r, loops_ms[r], steps_ms[r]) for r in rows_list]
    for p in points:
        print(f"{checkpoint.name}: {p['rows']} rows -> {p['loop_ms']:.2f} ms per loop", flush=True)
    base = points[0]["loop_ms"]
    return {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "layers": config.num_hidden_layers, "loops": config.total_ut_steps,
            "layer_params": layer_params, "weight_bytes_per_loop": layer_params * 4,
            "points": points,
            # the largest row count verified for at most 25% more than one row
            "nearly_free_rows": max(p["rows"] for p in points if p["loop_ms"] <= 1.25 * base)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128])
    ap.add_argument("--steps", type=int, default=6, help="timed decode steps per row count and pass")
    ap.add_argument("--passes", type=int, default=3, help="passes over the row counts (alternating order)")
    ap.add_argument("--large-layers", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["bundled", "large"], choices=["bundled", "large"])
    ap.add_argument("--out", type=Path, default=RESULTS / "cost_curve.json")
    args = ap.parse_args()

    import torch
    import vllm

    shapes = {}
    for shape in args.shapes:
        if shape == "bundled":
            shapes[shape] = curve(ROOT / "checkpoints" / "ouro-stdlib", args.rows, args.steps, args.passes, dummy=False)
        else:
            shapes[shape] = curve(large_shape_dir(args.large_layers), args.rows, args.steps, args.passes, dummy=True)
    record = {"benchmark": "cost_curve", "shapes": shapes, "dtype": "float32",
              "command": " ".join(["python", *sys.argv]),
              "vllm": vllm.__version__, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "cpu": cpu_name(), "cores": os.cpu_count(),
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
