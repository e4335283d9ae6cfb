"""The pipelined schedule's ceiling beside the round's (issue 12; RFC §7).

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_ceiling.py      # JSON to results/pipeline_ceiling.json

No engine runs here: the pipelined schedule is designed, not built. This
prices it with what the machine measured, so that the benchmark of the
built schedule has a ceiling to be held to (DESIGN.md §4, general form):

* ``L(rows)``: one loop pass over ``rows`` rows, ``results/cost_curve.json``;
* ``S`` (a step's cost outside the model) and ``P`` (a tick's fixed cost:
  embedding, ``lm_head``, host work), from the newest sweep's cost model
  (``results/adaptive_sweep.json``, else ``kv_sweep.json``), concurrency 1;
* acceptance of a first draft at depth ``d1`` (and of a second at ``d2``
  where the first was wrong): greedy agreement from the checkpoint's
  calibration (teacher-forced, held-out text) and, where the sweep has it,
  the first-draft acceptance measured on the benchmark prompts.

Per engine step with ``K`` draft slots per request (batch 1):

    native      per token  S + R·L(1)
    round       per step   S + K·P + d(K+1)·L(1) + (R−d)·L(K+1);  commits 1 + Σ_j a^j
    pipelined   per step   S + T·(d1·L(n) + P);  commits K + 1
                T = K + R/d1 + rejections·(R/d1 − 1) (rescued by a second proposal: (d2 − d1)/d1)
                n = R/d1 tokens in flight (+1 while a second proposal runs)

(the pipeline fills and drains once per step: RFC §7's choice of how it
meets vLLM's step). A rejection is where the first draft disagrees; the
chance that a draft of position j survives is not needed: every slot ends
verified.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def interpolate(points: list[dict], rows: float) -> float:
    """Loop ms at ``rows`` rows, linear between measured row counts."""
    pts = sorted((p["rows"], p["loop_ms"]) for p in points)
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
        if rows <= r1:
            return v0 + (v1 - v0) * (rows - r0) / (r1 - r0)
    (r0, v0), (r1, v1) = pts[-2], pts[-1]
    return v1 + (v1 - v0) * (rows - r1) / (r1 - r0)


def pipelined_step_ms(k: int, R: int, d1: int, d2: int | None, a1: float, rescue: float,
                      S: float, P: float, L) -> tuple[float, float]:
    """(ms per step, ticks per step) of the pipelined schedule, ``k`` slots."""
    stages = R // d1
    rejections = k * (1.0 - a1)
    restart_ticks = (stages - 1) * (1.0 - rescue) + ((d2 - d1) / d1 if d2 else 0.0) * rescue
    ticks = k + stages + rejections * restart_ticks
    rows = stages + (1.0 - a1 if d2 else 0.0)  # a second proposal rides along where the first is doubtful
    return S + ticks * (d1 * L(rows) + P), ticks


def measured_tick_ceiling(k: int, R: int, d1: int, a1: float, S: float, native_step_ms: float,
                          tick_ms: float) -> float:
    """Speedup over native of a pipelined step whose every tick costs the
    measured ``tick_ms`` (one arm's model forward over its ticks, host work
    in it, at that arm's rows per pass), with the batch-1 tick count at
    first-proposal acceptance ``a1`` and the step's ``S``: issue 12's
    ceiling "with the measured tick cost per row count". What it leaves out
    is what the schedule, not the tick, loses: a step lasts as long as its
    slowest request's pipeline, and its fills and drains."""
    ms, _ = pipelined_step_ms(k, R, d1, None, a1, 0.0, S, tick_ms, lambda rows: 0.0)
    return native_step_ms / (ms / (k + 1))


def round_step_ms(k: int, R: int, d: int, S: float, P: float, L) -> float:
    return S + k * P + d * (k + 1) * L(1) + (R - d) * L(k + 1)


def round_tokens(a: float, k: int) -> float:
    return 1.0 + sum(a ** j for j in range(1, k + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--out", type=Path, default=RESULTS / "pipeline_ceiling.json")
    args = ap.parse_args()

    calibration = json.loads((args.checkpoint / "loopspec_calibration.json").read_text())
    R = calibration["loops"]
    agreement = {row["r"]: row["agreement"] for row in calibration["per_loop"]}
    curve = json.loads((RESULTS / "cost_curve.json").read_text())["shapes"]["bundled"]["points"]
    sweep_name = "adaptive_sweep.json" if (RESULTS / "adaptive_sweep.json").exists() else "kv_sweep.json"
    sweep = json.loads((RESULTS / sweep_name).read_text())
    cell = sweep["results"]["short"]["1"]
    costs = next(r["cost_model"] for n, r in cell.items() if n.startswith("loopspec d1 K") and "cost_model" in r)
    S, P = costs["S_ms"], costs["P_ms"]
    # Scale the cost curve (its own run) to the sweep's measured one-row loop.
    scale = costs["L1_ms"] / interpolate(curve, 1)

    def L(rows: float) -> float:
        return scale * interpolate(curve, rows)

    measured_first = {d: cell[f"loopspec d{d} K1"]["acceptance"] for d in (1, 2, 3)
                      if f"loopspec d{d} K1" in cell and cell[f"loopspec d{d} K1"].get("acceptance") is not None}
    native_ms = S + R * L(1)
    bases = {"calibration (held-out, teacher-forced)": agreement}
    if measured_first:
        bases["benchmark prompts (first-draft acceptance, K=1 rounds)"] = measured_first
    out = {}
    for basis, acc in bases.items():
        rows = []
        for d1 in (1, 2):
            if d1 not in acc:
                continue
            for d2 in (None, *[d for d in range(d1 + 1, R) if d in acc]):
                a1 = acc[d1]
                # Rescued: the second proposal is right where the first was wrong.
                rescue = max(0.0, (acc[d2] - a1) / (1.0 - a1)) if d2 and a1 < 1 else 0.0
                for k in args.ks:
                    ms, ticks = pipelined_step_ms(k, R, d1, d2, a1, rescue, S, P, L)
                    rows.append({"schedule": "pipelined", "d1": d1, "d2": d2, "K": k, "acceptance": a1,
                                 "rescue": rescue, "ticks": ticks, "ms_per_token": ms / (k + 1),
                                 "speedup": native_ms / (ms / (k + 1))})
        for d in range(1, R):
            if d not in acc:
                continue
            for k in args.ks:
                e = round_tokens(acc[d], k)
                ms = round_step_ms(k, R, d, S, P, L)
                rows.append({"schedule": "round", "d": d, "K": k, "acceptance": acc[d], "tokens": e,
                             "ms_per_token": ms / e, "speedup": native_ms / (ms / e)})
        out[basis] = rows
    record = {
        "benchmark": "pipeline_ceiling", "checkpoint": str(args.checkpoint.relative_to(ROOT)), "loops": R,
        "inputs": {"S_ms": S, "P_ms": P, "L1_ms": L(1), "L_ms": {str(r): L(r) for r in (1, 2, 4, 5, 8, 16)},
                   "native_ms_per_token": native_ms, "costs_from": f"results/{sweep_name} short c=1",
                   "curve_from": "results/cost_curve.json (scaled to the sweep's L1)"},
        "command": "python benchmarks/pipeline_ceiling.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "results": out,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for basis, rows in out.items():
        best = {s: max((r for r in rows if r["schedule"] == s), key=lambda r: r["speedup"]) for s in ("round",
                                                                                                       "pipelined")}
        print(f"{basis}: best round {best['round']['speedup']:.2f}x, best pipelined "
              f"{best['pipelined']['speedup']:.2f}x ({best['pipelined']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
