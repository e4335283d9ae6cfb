"""A workload that changes under the engine (issue 13): one greedy request
decodes alone, a burst of 16 sampled requests arrives, decodes beside it and
leaves, and the greedy request finishes alone.

    python benchmarks/adaptive_burst.py [--compiled] [--repeats 9]

The same timeline (arrival after ``--burst-after-tokens`` tokens of lone decoding) runs
on a native engine and on a loopspec engine with the adaptive policy, in
this process, alternating (with a second native engine, ``native twin``,
unless ``--no-twin``: its ratio to the first is the noise floor). Recorded per engine step: time, batch width,
tokens committed, and for loopspec the policy's decision (the largest K_i of
the step and why). Reported: throughput before, during and after the burst
for both engines (the burst window: from the arrival to the last burst
request's end), and a plot of the policy's K per step over time with the
batch width (``--plot``; by default ``benchmarks/results/plots/<out stem>.png``, so
``adaptive_burst.png`` for the default ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loopspec_decode  # noqa: E402,F401  (sets the in-process environment)
import report  # noqa: E402
from loopspec_decode import RESULTS, ROOT, load_prompts  # noqa: E402
from vllm_loopspec.engine_internals import model_runner  # noqa: E402
from host import cpu_name  # noqa: E402


TWIN = report.BURST_TWIN  # a second native engine: the noise floor of the ratios
# Every engine of the burst (the probes that rerun its shape use these too).
ENGINE_ARGS = dict(dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5, enforce_eager=False,
                   seed=0, max_num_seqs=32, max_num_batched_tokens=8192, num_gpu_blocks_override=512)


def run_timeline(llm, args, greedy_prompt: str, burst_prompts: list[str], tag: str) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    drafter = getattr(model_runner(llm), "drafter", None)
    controller = getattr(drafter, "controller", None)
    engine.add_request(f"{tag}-greedy", greedy_prompt,
                       SamplingParams(max_tokens=args.greedy_tokens, temperature=0, ignore_eos=True))
    produced: dict[str, int] = {}
    steps = []
    burst_at = None
    t0 = None
    while engine.has_unfinished_requests():
        # The burst comes after the greedy request has decoded a set number
        # of tokens (not seconds: how long that takes depends on the engine
        # and the machine, and a fast one would finish before the burst).
        if t0 is not None and burst_at is None and produced.get(f"{tag}-greedy", 0) >= args.burst_after_tokens:
            burst_at = time.perf_counter() - t0
            for i, p in enumerate(burst_prompts):
                engine.add_request(f"{tag}-burst-{i}", p, SamplingParams(
                    max_tokens=args.burst_tokens, temperature=0.8, seed=100 + i, ignore_eos=True))
        outs = engine.step()
        now = time.perf_counter()
        committed = 0
        for out in outs:
            n = len(out.outputs[0].token_ids)
            committed += n - produced.get(out.request_id, 0)
            produced[out.request_id] = n
        if t0 is None:
            if produced.get(f"{tag}-greedy"):
                t0 = now  # the greedy request's prefill is done: the clock starts
            continue
        if drafter is None:
            k, reason = 0, "native"
        elif drafter.chooser is not None:
            # "auto": the step's own drafts and the arm chosen for it.
            k, reason = drafter.step_drafts, drafter.step_arm or "not chosen"
        else:
            last = controller.history[-1] if controller is not None and controller.history else None
            k = max(last.drafts, default=0) if last is not None else 0
            reason = last.reason if last is not None else "none"
        steps.append({"t": now - t0, "committed": committed, "width": len(outs), "k": k, "reason": reason})
    burst_ends = [s["t"] for s in steps if s["width"] > 1]
    end_of_burst = max(burst_ends) if burst_ends else burst_at
    return {"burst_at": burst_at, "burst_end": end_of_burst, "steps": steps,
            "windows": windows(steps, burst_at, end_of_burst)}


def windows(steps: list[dict], start: float, end: float) -> dict:
    """Committed tokens per second before, during and after the burst."""
    out = {}
    bounds = {"before": (0.0, start), "burst": (start, end), "after": (end, steps[-1]["t"] if steps else end)}
    for name, (a, b) in bounds.items():
        tokens = sum(s["committed"] for s in steps if a < s["t"] <= b)
        out[name] = {"tokens": tokens, "seconds": b - a, "tokens_per_s": tokens / (b - a) if b > a else 0.0}
    return out


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = record["runs"]["loopspec adaptive"][-1]
    t = [s["t"] for s in run["steps"]]
    fig, (ax_k, ax_w) = plt.subplots(2, 1, sharex=True, figsize=(9, 5))
    ax_k.step(t, [s["k"] for s in run["steps"]], where="post", lw=0.8)
    ax_k.set_ylabel("K of the step (0 = plain)")
    ax_k.axvspan(run["burst_at"], run["burst_end"], color="orange", alpha=0.15, label="burst of 16 sampled")
    ax_k.legend(loc="upper right")
    ax_w.step(t, [s["width"] for s in run["steps"]], where="post", color="gray", lw=0.8)
    ax_w.set_ylabel("requests in step")
    ax_w.set_xlabel("seconds since the greedy request's first token")
    ratio = record["summary"]["burst_speedup_median"]
    schedule = record["speculative_config"].get("schedule", "default schedule")
    fig.suptitle(f"loopspec ({schedule}) under a burst: throughput during the burst {ratio:.2f}x native (median)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    ap.add_argument("--compiled", action="store_true", help="vLLM's default (compiled) mode for both engines")
    # Thirty: native's own burst window varies by a third between repeats on
    # the 2-core CPU host (three repeats gave 0.98x where nine gave 0.89x),
    # and with nine the ratio's spread was wider than the 3-5% it was judged
    # on; thirty put the adaptive engine over both natives at 0.995 +- 0.011
    # (standard error), the twin native at 0.99-1.01x (thirty-eighth session).
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--greedy-tokens", type=int, default=900)
    ap.add_argument("--burst-tokens", type=int, default=96)
    ap.add_argument("--burst-after-tokens", type=int, default=200,
                    help="tokens the greedy request decodes alone before the burst arrives")
    ap.add_argument("--schedule", choices=["round", "auto"], default=None,
                    help="the loopspec engine's schedule (default: loopspec's default)")
    ap.add_argument("--draft-loops", type=int, nargs="+", default=None,
                    help="the loopspec engine's draft_loops (several: each step chooses its depth, with "
                         "\"schedule\": \"auto\"); default: loopspec's default")
    ap.add_argument("--out", type=Path, default=RESULTS / "adaptive_burst.json")
    ap.add_argument("--plot", type=Path, default=None,
                    help="where the plot goes (default: results/plots/<--out's stem>.png; name it when --out "
                         "is a scratch file, e.g. a run from a worktree to be committed under another name)")
    ap.add_argument("--no-twin", dest="twin", action="store_false",
                    help="leave out the second native engine (the noise floor: its ratio to the first)")
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM

    common = ENGINE_ARGS | {"enforce_eager": not args.compiled}
    spec = {"method": "loopspec"} | ({"schedule": args.schedule} if args.schedule else {})
    if args.draft_loops:
        spec["draft_loops"] = args.draft_loops if len(args.draft_loops) > 1 else args.draft_loops[0]
    engines = {"native": LLM(str(args.checkpoint), **common),
               "loopspec adaptive": LLM(str(args.checkpoint), speculative_config=spec, **common)}
    if args.twin:
        # Built last, so that it is as far from the first native in the
        # process as the loopspec engine is: the spread between two native
        # engines (placement, the host's drift) is what a ratio near 1 is
        # judged against. In the order of a repeat it sits where the first
        # native does in the next (the order is reversed every repeat).
        engines[TWIN] = LLM(str(args.checkpoint), **common)
    prompts = load_prompts("mixed")
    greedy_prompt, burst = prompts[0], [prompts[(1 + i) % len(prompts)] for i in range(16)]
    for name, llm in engines.items():  # warm-up: shapes, and the policy's cost model
        run_timeline(llm, argparse.Namespace(**{**vars(args), "greedy_tokens": 300, "burst_after_tokens": 100}),
                     greedy_prompt, burst, f"warm-{name}")
    runs = {name: [] for name in engines}
    for rep in range(args.repeats):
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        for name in order:
            runs[name].append(run_timeline(engines[name], args, greedy_prompt, burst, f"{rep}-{name}"))
        print(f"repeat {rep + 1}/{args.repeats}", flush=True)

    def med(name, window):
        return statistics.median(r["windows"][window]["tokens_per_s"] for r in runs[name])

    summary = {f"{w}_tokens_per_s": {n: med(n, w) for n in engines} for w in ("before", "burst", "after")}
    for w in ("before", "burst", "after"):
        summary[f"{w}_speedup_median"] = med("loopspec adaptive", w) / med("native", w)
        if TWIN in engines:
            summary[f"{w}_twin_ratio_median"] = med(TWIN, w) / med("native", w)
            # The adaptive engine runs between the two natives in each repeat:
            # over their geometric mean, the host's drift within the repeat cancels.
            around = report.burst_sandwich_ratios({"runs": runs}, w)
            summary[f"{w}_vs_both_natives"] = {"median": statistics.median(around),
                                               "mean": statistics.mean(around),
                                               "standard_error": statistics.stdev(around) / math.sqrt(len(around))
                                               if len(around) > 1 else None}
    record = {
        "benchmark": "adaptive_burst", "command": " ".join(["python", *sys.argv]),
        "engine": "in-process vLLM V1, " + ("compiled (default mode)" if args.compiled else "enforce_eager"),
        "speculative_config": spec,
        "workload": {"greedy_tokens": args.greedy_tokens, "burst": 16, "burst_tokens": args.burst_tokens,
                     "burst_temperature": 0.8, "burst_after_tokens": args.burst_after_tokens},
        "vllm": vllm.__version__, "torch": torch.__version__, "cpu": cpu_name(), "cores": os.cpu_count(),
        "machine_load": list(os.getloadavg()), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        # PASSIVE makes this machine's steps 2-4x slower in one process: record it.
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset: OpenMP default)"),
        "summary": summary, "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    plot(record, args.plot or RESULTS / "plots" / f"{args.out.stem}.png")
    for w in ("before", "burst", "after"):
        print(f"{w:>6}: native {summary[w + '_tokens_per_s']['native']:.0f} tok/s, adaptive "
              f"{summary[w + '_tokens_per_s']['loopspec adaptive']:.0f} tok/s ({summary[w + '_speedup_median']:.2f}x)"
              + (f", twin native {summary[w + '_twin_ratio_median']:.2f}x; adaptive over both natives "
                 f"{summary[w + '_vs_both_natives']['median']:.3f}x median, {summary[w + '_vs_both_natives']['mean']:.3f}"
                 f" mean" if TWIN in engines else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
