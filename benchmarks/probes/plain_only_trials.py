"""Issue 13 diagnostic, from a committed sweep (no engine): how fast an
"auto" engine's trials run when every step of them was plain, against the
native trial run just before each (``kv_sweep.py --native-beside-auto``),
and the second native engine against the first for scale.

A trial counts as plain when it drafted nothing and ran no pipelined step.
Bar 1 (auto >= 0.97x native in every cell) has that trial's ratio as its
ceiling in the cells where plain steps win: what exploring costs comes
on top of it.

    python benchmarks/probes/plain_only_trials.py [SWEEP_JSON]
"""
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "adaptive_sweep_auto.json"
    sweep = json.loads(Path(path).read_text())
    every, twins = [], []
    for cell, by_width in sweep["raw"].items():
        for width, arms in by_width.items():
            twin = [n["seconds"] / t["seconds"] for n, t in zip(arms["native"], arms["native (second engine)"])]
            twins += twin
            line = [f"{cell:11s} c{width:>2}: second native {statistics.median(twin):.3f}"]
            for arm in (a for a in sweep["adaptive_policies"] if a.endswith(" auto")):
                beside = arms.get(f"native (beside {arm})")
                if not beside:
                    continue
                ratios = [n["seconds"] / t["seconds"] for t, n in zip(arms[arm], beside)
                          if not t["spec"]["drafts"] and not t.get("pipeline", {}).get("pipelined_steps")]
                every += ratios
                if ratios:
                    line.append(f"{arm.split()[1]} {statistics.median(ratios):.3f} ({len(ratios)})")
            print(", ".join(line))
    print(f"all plain auto trials over the native beside them: median {statistics.median(every):.3f} "
          f"({len(every)} trials); the second native over the first: median {statistics.median(twins):.3f} "
          f"({len(twins)} trials)")


if __name__ == "__main__":
    main()
