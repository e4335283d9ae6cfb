"""Host work per draft tick of a loopspec round, for one or more source trees.

    python benchmarks/round_profile.py --tree after=. [--tree before=/path/to/old/checkout]

A round's wall time splits into model compute (the layer stack, ``lm_head``
and the embedding: ``OuroModel.run_loops``, ``compute_logits``,
``embed_input_ids``) and host work (planning, attention metadata, index
bookkeeping, draft choice, forward-context switching). This script measures
both from outside the implementation, so the same command profiles any
version of the round: each ``--tree`` is run in its own process with that
tree first on ``PYTHONPATH`` (the trees alternate, ``--repeats`` times), on
the bundled checkpoint, greedy, every request's prefill done before the
timed decode. All of a round's host work is charged to its draft ticks
(an upper bound: the base and deep passes have a little too).

Output: ``benchmarks/results/round_profile.json`` (raw per-trial figures
and medians per tree and concurrency) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


# -- one trial, inside the profiled tree's process ------------------------------

def fixed_k_config(k: int, d: int) -> dict:
    """loopspec drafting K every round, in whichever tree runs (older trees
    have no adaptive policy and no ``adaptive`` key)."""
    spec = {"method": "loopspec", "num_speculative_tokens": k, "draft_loops": d}
    try:
        from vllm_loopspec.speculative.options import ALLOWED_KEYS
    except ImportError:
        return spec
    return spec | ({"adaptive": False} if "adaptive" in ALLOWED_KEYS else {})


def trial(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm_loopspec
    from vllm import LLM, SamplingParams

    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.models.ouro import OuroForCausalLM, OuroModel

    compute = {"seconds": 0.0, "logits_calls": 0}

    def timed(cls, name, counts_logits=False):
        original = getattr(cls, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                compute["seconds"] += time.perf_counter() - start
                if counts_logits:
                    compute["logits_calls"] += 1

        setattr(cls, name, wrapper)

    timed(OuroModel, "run_loops")
    timed(OuroForCausalLM, "compute_logits", counts_logits=True)
    timed(OuroForCausalLM, "embed_input_ids")

    prompts = [json.loads(line)["prompt"] for line in
               (ROOT / "benchmarks" / "prompts" / "code.jsonl").read_text().splitlines() if line.strip()]
    llm = LLM(str(args.checkpoint), dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5,
              enforce_eager=True, seed=0, max_num_seqs=16,
              speculative_config=fixed_k_config(args.k, args.draft_loops))
    runner = model_runner(llm)
    rounds: list[dict] = []
    original_forward = runner._model_forward

    def forward(*a, **kw):
        before_s, before_calls = compute["seconds"], compute["logits_calls"]
        start = time.perf_counter()
        out = original_forward(*a, **kw)
        wall = time.perf_counter() - start
        draft_ticks = compute["logits_calls"] - before_calls
        if draft_ticks:  # a round (plain steps compute no logits inside the forward)
            rounds.append({"wall": wall, "compute": compute["seconds"] - before_s, "draft_ticks": draft_ticks})
        return out

    runner._model_forward = forward
    out = {"tree": args.tree_label, "package": str(Path(vllm_loopspec.__file__).parent), "by_concurrency": {}}
    for c in args.concurrency:
        engine = llm.llm_engine
        for warm in (True, False):
            params = SamplingParams(max_tokens=16 if warm else args.new_tokens, temperature=0, ignore_eos=True)
            for i in range(c):
                engine.add_request(f"c{c}-{warm}-{i}", prompts[i % len(prompts)], params)
            engine.step()  # prefill (the batch fits one step)
            rounds.clear()
            while engine.has_unfinished_requests():
                engine.step()
        host = [(r["wall"] - r["compute"]) / r["draft_ticks"] for r in rounds]
        out["by_concurrency"][str(c)] = {
            "rounds": len(rounds),
            "host_ms_per_draft_tick": statistics.median(host) * 1e3,
            "round_wall_ms": statistics.median(r["wall"] for r in rounds) * 1e3,
            "round_compute_ms": statistics.median(r["compute"] for r in rounds) * 1e3,
            "draft_ticks_per_round": statistics.median(r["draft_ticks"] for r in rounds),
        }
    return out


# -- orchestration ----------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH of a source tree (repeatable)")
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "round_profile.json")
    ap.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree-label", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trial:
        print("RESULT " + json.dumps(trial(args)), flush=True)
        return

    trees = dict(t.split("=", 1) for t in (args.tree or [f"current={ROOT}"]))
    raw: dict[str, list[dict]] = {label: [] for label in trees}
    for rep in range(args.repeats):
        for label, path in trees.items():
            env = {**os.environ, "PYTHONPATH": str(Path(path).resolve()), "OMP_WAIT_POLICY": "PASSIVE"}
            cmd = [sys.executable, __file__, "--trial", "--tree-label", label, "--checkpoint", str(args.checkpoint),
                   "--k", str(args.k), "--draft-loops", str(args.draft_loops), "--new-tokens", str(args.new_tokens),
                   "--concurrency", *map(str, args.concurrency)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
            if proc.returncode != 0 or "RESULT " not in proc.stdout:
                raise SystemExit(f"trial {label} failed:\n{proc.stderr[-3000:]}")
            raw[label].append(json.loads(proc.stdout.split("RESULT ", 1)[1]))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)

    summary = {}
    for label, trials in raw.items():
        summary[label] = {}
        for c in map(str, args.concurrency):
            rows = [t["by_concurrency"][c] for t in trials]
            summary[label][c] = {key: statistics.median(r[key] for r in rows)
                                 for key in ("host_ms_per_draft_tick", "round_wall_ms", "round_compute_ms",
                                             "draft_ticks_per_round")}
            values = sorted(r["host_ms_per_draft_tick"] for r in rows)
            summary[label][c]["host_ms_per_draft_tick_range"] = [values[0], values[-1]]
    record = {"benchmark": "round_profile", "k": args.k, "draft_loops": args.draft_loops,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "trees": trees,
              "cores": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "summary": summary, "raw": raw}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("| tree | conc. | host ms per draft tick [min–max] | round wall ms | round compute ms | draft ticks |")
    print("|---|---|---|---|---|---|")
    for label, by_c in summary.items():
        for c, s in by_c.items():
            lo, hi = s["host_ms_per_draft_tick_range"]
            print(f"| {label} | {c} | {s['host_ms_per_draft_tick']:.3f} [{lo:.3f}–{hi:.3f}] | "
                  f"{s['round_wall_ms']:.2f} | {s['round_compute_ms']:.2f} | {s['draft_ticks_per_round']:.0f} |")


if __name__ == "__main__":
    main()
