"""Issue 13 diagnostic over the committed auto sweeps (no engine): what an
auto engine's trials cost against engines that run the same steps.

* Auto trials that ran only plain steps (no draft), against the native
  trial run just before them (``--native-beside-auto``), beside the second
  native engine against the first (also run right after it): the whole
  trial, its model forward and the time outside it.
* Auto trials that ran only pipelined steps, against the fixed pipelined
  arm of the same d in the same repeat.

    python benchmarks/probes/auto_trial_overheads.py [SWEEP.json ...]

(default: every ``benchmarks/results/adaptive_sweep_auto*.json``).
"""
import collections
import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def ratios(a: dict, b: dict) -> tuple[float, float, float]:
    """Trial ``a`` over trial ``b``: throughput, forward seconds, seconds outside the forward."""
    return (a["tokens_per_s"] / b["tokens_per_s"], a["forward_seconds"] / b["forward_seconds"],
            (a["seconds"] - a["forward_seconds"]) / (b["seconds"] - b["forward_seconds"]))


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted(RESULTS.glob("adaptive_sweep_auto*.json"))
    plain, twin, piped = [], [], []
    plain_excess_us = collections.defaultdict(list)
    for path in paths:
        record = json.loads(path.read_text())
        for cell, by_c in record.get("raw", {}).items():
            for c, raw in by_c.items():
                for x, y in zip(raw["native"], raw.get("native (second engine)", [])):
                    if "forward_seconds" in x and "forward_seconds" in y:
                        twin.append(ratios(y, x))
                for d in "123":
                    auto, beside = raw.get(f"loopspec d{d} auto"), raw.get(f"native (beside loopspec d{d} auto)")
                    for x, y in zip(auto or [], beside or []):
                        if x["spec"]["drafts"] == 0 and x["steps"] == y["steps"] and "forward_seconds" in x:
                            plain.append(ratios(x, y))
                            plain_excess_us[(cell, c)].append(
                                ((x["seconds"] - x["forward_seconds"]) - (y["seconds"] - y["forward_seconds"]))
                                / x["steps"] * 1e6)
                    fixed = raw.get(f"pipelined d{d} K16" + (" s2" if d == "1" else ""))
                    for x, y in zip(auto or [], fixed or []):
                        pipe = x.get("pipeline")
                        if pipe and x["steps"] == pipe["pipelined_steps"] == y["steps"] and "forward_seconds" in y:
                            piped.append(ratios(x, y))

    def line(name: str, rows: list) -> None:
        if rows:
            med = [statistics.median(r[i] for r in rows) for i in range(3)]
            print(f"{name}: {len(rows)} trials, throughput {med[0]:.3f}x, forward {med[1]:.3f}x, "
                  f"outside the forward {med[2]:.3f}x (medians)")

    print(f"{len(paths)} sweeps")
    line("auto, only plain steps, over the native trial before it", plain)
    line("second native engine over the first", twin)
    line("auto, only pipelined steps, over the fixed pipelined arm", piped)
    print("auto plain-only trials: time outside the forward over native's, us per step (median), by cell:")
    for (cell, c), values in sorted(plain_excess_us.items()):
        print(f"  {cell:11s} c{c:3s} {len(values):4d} trials  {statistics.median(values):6.1f}")


if __name__ == "__main__":
    main()
