"""Issue 13: bars 1 and 2 (at the best d, by medians, as
``report.adaptive_section`` counts them) of a committed sweep recomputed
over subsets of its repeats: how many of the 16 cells a run of fewer
repeats of the same engines, in the same hour, would meet. Within one run
only: the host's state between runs is not in it. Prints only.

    python benchmarks/probes/subsample_bars.py SWEEP.json SUBSET_SIZE
"""
import collections, itertools, json, random, statistics, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import adaptive_suffix, best_d_bars

rec = json.load(open(sys.argv[1]))
size = int(sys.argv[2])
repeats = rec["repeats"]
subsets = list(itertools.combinations(range(repeats), size))
random.seed(0)
if len(subsets) > 300:
    subsets = random.sample(subsets, 300)

suffix = adaptive_suffix(rec)


def bars(keep):
    ok_native = ok_best = 0
    for cell, by_c in rec["raw"].items():
        for c, arms in by_c.items():
            med = {n: statistics.median(t["tokens_per_s"] for t in trials if t["repeat"] in keep)
                   for n, trials in arms.items() if trials}
            bar_native, bar_best = best_d_bars(med, suffix)
            ok_native += bar_native
            ok_best += bar_best
    return ok_native, ok_best

print(sys.argv[1], "all", repeats, "repeats:", bars(set(range(repeats))))
got = [bars(set(s)) for s in subsets]
for i, name in enumerate(("bar 1", "bar 2")):
    counts = [g[i] for g in got]
    print(f"{name} over {len(got)} subsets of {size}: median {statistics.median(counts)}, "
          f"mean {statistics.mean(counts):.2f}, range {min(counts)}-{max(counts)}, "
          f"distribution {dict(sorted(collections.Counter(counts).items()))}")
