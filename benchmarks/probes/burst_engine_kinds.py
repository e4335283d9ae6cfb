"""Issue 13 diagnostic: where the burst's plain steps lose their ~3% to
native's (``adaptive_burst.py``: at width 17 the auto engine's steps, nearly
all plain, 1.025-1.035x native's step by step index, the twin native
0.99-1.02x, in the forty-ninth's committed run and the fiftieth's).

The burst's timeline (``adaptive_burst.run_timeline``: one greedy request,
16 sampled ones arriving after its 200th token) on engines of several kinds
in one process, in turn (the order reversed every repeat):

* ``native``, and ``native twin`` built last (the noise floor);
* ``auto``: ``"schedule": "auto"`` as committed (speculates before and after
  the burst, plain steps in it);
* ``forced plain``: the same engine whose chooser answers plain with a hold
  from its first step (``chooser_ab.choose_plain``): a speculative engine
  that never speculated;
* ``bare``: forced plain with every loopspec hook of the runner bypassed
  (``bare_plain_engines.bypass_runner_hooks``): vLLM's runner and scheduler
  built for a speculative config, no loopspec code in the steps.

Reported per engine: the burst window's throughput over the geometric mean
of the two natives' in the same repeat (median, mean ± s.e.), and its
width-17 steps' time over native's at the same step index (median over
repeats, mean over the indexes 8 on: the steady steps).

    python benchmarks/probes/burst_engine_kinds.py REPEATS OUT.json[.gz] [KIND,KIND,...]

The optional list names the engines in the order they are built (default:
the order above); it must include both natives.
"""
import argparse
import gzip
import json
import math
import statistics
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive_burst  # noqa: E402  (sets the in-process environment)
from bare_plain_engines import bypass_runner_hooks  # noqa: E402
from chooser_ab import choose_plain  # noqa: E402
from loopspec_decode import ROOT, load_prompts  # noqa: E402
from vllm_loopspec.engine_internals import model_runner  # noqa: E402

KINDS = ("native", "auto", "forced plain", "bare", "native twin")


def build(kind: str):
    """An engine of ``kind`` (a kind with a suffix, ``bare2``, is another of
    that kind), compiled, with the burst's engine arguments."""
    from vllm import LLM

    checkpoint = str(ROOT / "checkpoints" / "ouro-stdlib")
    if kind.startswith("native"):
        return LLM(checkpoint, **adaptive_burst.ENGINE_ARGS)
    llm = LLM(checkpoint, speculative_config={"method": "loopspec", "schedule": "auto"}, **adaptive_burst.ENGINE_ARGS)
    runner = model_runner(llm)
    if kind != "auto":
        runner.drafter.chooser.choose = types.MethodType(choose_plain, runner.drafter.chooser)
    if kind.startswith("bare"):
        bypass_runner_hooks(runner)
    return llm


def burst_steps(run: dict) -> list[float]:
    """Seconds of each step ending inside the burst window."""
    out, prev = [], None
    for s in run["steps"]:
        if prev is not None and run["burst_at"] < s["t"] <= run["burst_end"] + 1e-9:
            out.append(s["t"] - prev)
        prev = s["t"]
    return out


def main() -> None:
    repeats, out = int(sys.argv[1]), Path(sys.argv[2])
    kinds = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else KINDS
    assert set(kinds) <= set(KINDS) and {"native", "native twin"} <= set(kinds), kinds
    args = argparse.Namespace(greedy_tokens=900, burst_tokens=96, burst_after_tokens=200)
    engines = {kind: build(kind) for kind in kinds}
    prompts = load_prompts("mixed")
    greedy, burst = prompts[0], [prompts[(1 + i) % len(prompts)] for i in range(16)]
    for kind, llm in engines.items():
        adaptive_burst.run_timeline(llm, argparse.Namespace(greedy_tokens=300, burst_tokens=96,
                                                            burst_after_tokens=100),
                                    greedy, burst, f"warm-{kind}")
    runs = {kind: [] for kind in kinds}
    for rep in range(repeats):
        for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
            runs[kind].append(adaptive_burst.run_timeline(engines[kind], args, greedy, burst, f"{rep}-{kind}"))
        print(f"repeat {rep + 1}/{repeats}", flush=True)
    summary = {}
    for kind in (k for k in kinds if k != "native"):
        around = [r["windows"]["burst"]["tokens_per_s"]
                  / math.sqrt(n["windows"]["burst"]["tokens_per_s"] * t["windows"]["burst"]["tokens_per_s"])
                  for r, n, t in zip(runs[kind], runs["native"], runs["native twin"])]
        by_index = {}
        for r, n in zip(runs[kind], runs["native"]):
            mine, theirs = burst_steps(r), burst_steps(n)
            if len(mine) == len(theirs):  # a repeat with speculative steps in the burst has fewer
                for i, (a, b) in enumerate(zip(mine, theirs)):
                    by_index.setdefault(i, []).append(a / b)
        steady = [statistics.median(v) for i, v in sorted(by_index.items()) if i >= 8]
        summary[kind] = {"burst_vs_both_natives_median": statistics.median(around),
                         "burst_vs_both_natives_mean": statistics.mean(around),
                         "standard_error": statistics.stdev(around) / math.sqrt(len(around))
                         if len(around) > 1 else float("nan"),
                         "steady_step_over_native": statistics.mean(steady) if steady else None,
                         "repeats_with_equal_steps": len(by_index.get(8, []))}
        print(f"{kind:>13}: burst over both natives median {summary[kind]['burst_vs_both_natives_median']:.3f}, "
              f"mean {summary[kind]['burst_vs_both_natives_mean']:.3f} ± {summary[kind]['standard_error']:.3f}; "
              f"steady step over native's {summary[kind]['steady_step_over_native']:.3f} "
              f"({summary[kind]['repeats_with_equal_steps']} repeats)", flush=True)
    text = json.dumps({"command": " ".join(["python", *sys.argv]), "built_in_order": kinds,
                       "summary": summary, "runs": runs}, separators=(",", ":")) + "\n"
    # Every step of every trial: OUT.json.gz keeps it small enough to commit.
    if out.suffix == ".gz":
        out.write_bytes(gzip.compress(text.encode()))
    else:
        out.write_text(text)


if __name__ == "__main__":
    main()
