"""Issue 13 diagnostic: replay greedy requests through the real
:class:`~vllm_loopspec.speculative.adaptive.AdaptiveController` with no
engine, to see what the adaptive policy's K choices cost against fixed K,
apart from the machine's noise. Seconds of CPU.

Each request's acceptance is its real one (``greedy_acceptance_traces.json``
from ``greedy_acceptance_traces.py``: for every committed length, the drafts
a round starting there accepts at depth ``d``); a step's time is a linear
cost model (:class:`~vllm_loopspec.speculative.policy.StepCosts`) taken from
a sweep's fitted adaptive policy at that ``d`` (``--sweep``), times a
log-normal factor (``--noise``). The sweep's greedy cells run in its order
(repeats x short, long x concurrency 1, 4, 8, 16; prompts as the sweep
picks them), one controller per ``d`` for the whole run as in an engine;
each trial is compared with engines running fixed K (every row drafts
``min(K, its budget)``) and plain steps on the same cost model.

    python benchmarks/probes/policy_sim.py [--max-k 8] [--repeats 5] [--seeds 4] [--set NAME=VALUE ...]

``--set`` overrides a constant of :mod:`~vllm_loopspec.speculative.adaptive`
to compare rules.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from vllm_loopspec.speculative import adaptive as ad  # noqa: E402
from vllm_loopspec.speculative.policy import StepCosts  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def costs_of(sweep: dict, d: int) -> StepCosts:
    c = sweep["adaptive_policies"][f"loopspec d{d} adaptive"]["costs"]
    return StepCosts(tuple(c["plain"]), tuple(c["spec"]), tuple(c["context"]))


class Trial:
    """One cell's requests decoding together until all reach their budget."""

    def __init__(self, requests: list[dict], d: int, new_tokens: int, tag: str):
        self.runs = [r["runs"][str(d)] for r in requests]
        self.prompt = [r["prompt_tokens"] for r in requests]
        self.ids = [f"{tag}-{i}" for i in range(len(requests))]
        self.n = new_tokens

    def run(self, choose, costs: StepCosts, rng: random.Random, noise: float, max_k: int, controller=None) -> float:
        t = [0] * len(self.runs)
        seconds = 0.0
        while True:
            live = [i for i in range(len(t)) if t[i] < self.n]
            if not live:
                return seconds
            limits = [min(max_k, self.n - t[i] - 1) for i in live]
            drafts = choose(live, limits, t)
            ticks = max(drafts, default=0)
            rows = sum(1 for k in drafts if k)
            tokens = len(live) + sum(drafts)
            context = sum(self.prompt[i] + t[i] for i in live)
            step = (costs.spec_step(ticks, rows, tokens, context) if ticks
                    else costs.plain_step(tokens, context)) * rng.lognormvariate(0.0, noise)
            seconds += step
            committed = 0
            for i, k in zip(live, drafts):
                accepted = min(k, self.runs[i][t[i]]) if k else 0
                if controller is not None and k:
                    controller.observe_round(self.ids[i], False, k, accepted)
                t[i] += accepted + 1
                committed += accepted + 1
            if controller is not None:
                controller.observe_step(ticks, rows, tokens, step, width=len(live), committed=committed,
                                        context=context, mix=ad.GREEDY)
                controller.observe_gap(0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=Path, default=RESULTS / "greedy_acceptance_traces.json")
    ap.add_argument("--sweep", type=Path, default=RESULTS / "adaptive_sweep_auto_2918861.json")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--start-k", type=int, default=4)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE")
    args = ap.parse_args()
    for item in args.set:
        name, value = item.split("=")
        setattr(ad, name, type(getattr(ad, name))(value))
    traces = json.loads(args.traces.read_text())
    sweep = json.loads(args.sweep.read_text())
    concurrency = (1, 4, 8, 16)
    table: dict[tuple[str, int, int], dict[str, list[float]]] = {}
    for seed in range(args.seeds):
        for d in args.draft_loops:
            costs = costs_of(sweep, d)
            rng = random.Random(seed * 10 + d)
            controller = ad.AdaptiveController(max_k=args.max_k, start_k=args.start_k)
            serial = 0
            for rep in range(args.repeats):
                for setting, cell in traces["settings"].items():
                    reqs = cell["requests"]
                    for c in concurrency:
                        batch = [reqs[(rep * c + i) % len(reqs)] for i in range(c)]
                        serial += 1
                        trial = Trial(batch, d, cell["new_tokens"], f"s{serial}")

                        def policy(live, limits, t, trial=trial):
                            ids = [trial.ids[i] for i in live]
                            remaining = [trial.n - t[i] for i in live] if len(live) > 1 else None
                            context = sum(trial.prompt[i] + t[i] for i in live)
                            drafts, _ = controller.plan([(r, False, k) for r, k in zip(ids, limits)],
                                                        context=context, remaining=remaining)
                            controller.forget(ids)
                            return list(drafts)

                        out = table.setdefault((setting, c, d), {})
                        plain = trial.run(lambda live, limits, t: [0] * len(live), costs, rng, args.noise, args.max_k)
                        out.setdefault("adaptive", []).append(
                            plain / trial.run(policy, costs, rng, args.noise, args.max_k, controller))
                        for k in args.ks:
                            fixed = trial.run(lambda live, limits, t, k=k: [min(k, lim) for lim in limits],
                                              costs, rng, args.noise, max(args.ks))
                            out.setdefault(f"K{k}", []).append(plain / fixed)
    print(f"{'cell':6s} {'c':>3s} {'d':>2s}  adaptive  " + "  ".join(f"{'K' + str(k):>5s}" for k in args.ks)
          + "   adaptive/best fixed")
    ratios = []
    for (setting, c, d), arms in table.items():
        med = {a: statistics.median(v) for a, v in arms.items()}
        best = max(v for a, v in med.items() if a != "adaptive")
        ratios.append(med["adaptive"] / best)
        print(f"{setting:6s} {c:3d} {d:2d}  {med['adaptive']:8.2f}  "
              + "  ".join(f"{med[f'K{k}']:5.2f}" for k in args.ks) + f"   {med['adaptive'] / best:.3f}")
    # Means weigh the trials a trap slowed, which a median of five repeats may hide.
    by_mean = [statistics.mean(arms["adaptive"]) / max(statistics.mean(v) for a, v in arms.items() if a != "adaptive")
               for arms in table.values()]
    print(f"mean adaptive/best fixed: {statistics.mean(ratios):.4f}; within 5%: "
          f"{sum(r >= 0.95 for r in ratios)}/{len(ratios)}; by means over trials: {statistics.mean(by_mean):.4f}, "
          f"within 5% {sum(r >= 0.95 for r in by_mean)}/{len(by_mean)}")


if __name__ == "__main__":
    main()
