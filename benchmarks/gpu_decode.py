"""Short decode benchmark for ``make gpu-check`` (about 2 minutes on a GPU).

    python benchmarks/gpu_decode.py [--out benchmarks/results/gpu_check.json] [--skip-large]

Arms, each an in-process engine decoding ``--new-tokens`` greedy tokens for
batches of 1 and 8 prompts (prefill excluded from the timed window, one
warm-up, ``--repeats`` timed trials, median reported):

* the bundled checkpoint in fp32: native (eager), native in vLLM's default
  mode (compiled; plus CUDA graphs on GPU), loopspec K=4 d=2 eager, and
  loopspec K=4 d=2 in the default mode (on CPU: plain steps and the round's
  ticks compiled; on CUDA the engine is forced eager until rounds are
  captured in CUDA graphs, so that arm is eager there too);
* Ouro-1.4B's shape in bf16 with ``load_format=dummy`` (random weights:
  acceptance is meaningless, the figures measure the cost of a round at the
  real shape, with each loopspec arm's acceptance beside them): native
  (eager, and in the default mode with CUDA graphs), loopspec K=4 (eager)
  and the pipelined schedule (d1 1, K 8, second proposals at loop 2; eager).

Runs on CPU too (slowly; use ``--skip-large``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

ROOT = Path(__file__).resolve().parents[1]


def decode(llm, prompts, new_tokens: int) -> float:
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    tag = f"{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    engine.step()  # prefill
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * (new_tokens - 1) / (time.perf_counter() - start)


def acceptance_counts(llm) -> tuple[int, int] | None:
    """(drafted, accepted) tokens of a loopspec engine so far; None for native.
    With dummy weights this is what makes a loopspec timing readable: the
    rate depends on how often random loops happen to agree."""
    from vllm_loopspec.engine_internals import model_runner

    stats = getattr(getattr(model_runner(llm), "drafter", None), "stats", None)
    return None if stats is None else (stats.drafted_tokens, stats.accepted_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.json")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--large-first", action="store_true",
                    help="run the Ouro-1.4B-shape arms first (a lent GPU's time may end before the rest)")
    ap.add_argument("--attention-backend", default=None,
                    help="e.g. TRITON_ATTN where FlashAttention is absent (benchmarks/gpu_lent: bf16 would pick it)")
    ap.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM

    prompts = [json.loads(line)["prompt"] for line in
               (ROOT / "benchmarks" / "prompts" / "code.jsonl").read_text().splitlines() if line.strip()]
    spec = {"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2, "adaptive": False}
    pipelined = {"method": "loopspec", "num_speculative_tokens": 8, "draft_loops": 1, "schedule": "pipelined",
                 "second_proposal_loop": 2}
    common = dict(max_model_len=1024, gpu_memory_utilization=0.5, seed=0, max_num_seqs=16,
                  attention_backend=args.attention_backend)
    small = str(ROOT / "checkpoints" / "ouro-stdlib")
    arms = [("ouro-stdlib fp32", "native eager", small, dict(dtype="float32", enforce_eager=True)),
            ("ouro-stdlib fp32", "native default mode", small, dict(dtype="float32", enforce_eager=False)),
            ("ouro-stdlib fp32", "loopspec K4", small, dict(dtype="float32", enforce_eager=True,
                                                             speculative_config=spec)),
            ("ouro-stdlib fp32", "loopspec K4 default mode", small, dict(dtype="float32", enforce_eager=False,
                                                                          speculative_config=spec))]
    if not args.skip_large:
        large = Path(tempfile.mkdtemp(prefix="ouro-1.4b-"))
        shutil.copy(ROOT / "configs" / "ouro-1.4b.config.json", large / "config.json")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ROOT / "checkpoints" / "ouro-stdlib" / name, large / name)
        big = dict(dtype="bfloat16", load_format="dummy", enforce_eager=True)
        arms += [("ouro-1.4b shape bf16 (dummy)", "native eager", str(large), big),
                 ("ouro-1.4b shape bf16 (dummy)", "native default mode", str(large), big | {"enforce_eager": False}),
                 ("ouro-1.4b shape bf16 (dummy)", "loopspec K4", str(large), big | {"speculative_config": spec}),
                 # issue 12: on a GPU a loop group is a kernel launch, not 73 µs of host code.
                 ("ouro-1.4b shape bf16 (dummy)", "pipelined d1 K8 s2", str(large),
                  big | {"speculative_config": pipelined})]
        if args.large_first:
            arms = arms[4:] + arms[:4]
    if args.arm is not None:  # one arm, in its own process (engines hold device memory until exit)
        from vllm_loopspec import register

        register()  # the entry point is absent where the package is on PYTHONPATH, not installed
        model, arm, path, kwargs = arms[args.arm]
        llm = LLM(path, **common, **kwargs)
        for batch in (1, 8):
            decode(llm, prompts[:batch], 8)  # warm-up
            before = acceptance_counts(llm)
            tps = [decode(llm, prompts[:batch], args.new_tokens) for _ in range(args.repeats)]
            row = {"model": model, "arm": arm, "batch": batch, "tokens_per_s": statistics.median(tps), "trials": tps}
            if before is not None:
                drafted, accepted = (after - b for after, b in zip(acceptance_counts(llm), before))
                row |= {"drafted_tokens": drafted, "accepted_tokens": accepted,
                        "acceptance": accepted / drafted if drafted else None}
            print("RESULT " + json.dumps(row), flush=True)
        return
    results = []
    for i, (model, arm, _, _) in enumerate(arms):
        cmd = [sys.executable, __file__, "--arm", str(i), "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats)] + (["--skip-large"] if args.skip_large else []) \
            + (["--large-first"] if args.large_first else []) \
            + (["--attention-backend", args.attention_backend] if args.attention_backend else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not rows:
            rows = [{"model": model, "arm": arm, "batch": None, "tokens_per_s": None,
                     "error": proc.stderr[-2000:]}]
        for r in rows:
            print(f"{r['model']} | {r['arm']} | batch {r['batch']} | {r['tokens_per_s']} tok/s"
                  + (f" | acceptance {r['acceptance']:.2f}" if r.get("acceptance") is not None else ""), flush=True)
        results += rows
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    record = {"benchmark": "gpu_decode", "device": device, "vllm": vllm.__version__, "torch": torch.__version__,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("\n| model | arm | batch | tok/s (median) | acceptance |\n|---|---|---|---|---|")
    for r in results:
        tps = "failed" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        rate = "–" if r.get("acceptance") is None else f"{r['acceptance']:.2f}"
        print(f"| {r['model']} | {r['arm']} | {r['batch']} | {tps} | {rate} |")


if __name__ == "__main__":
    main()
