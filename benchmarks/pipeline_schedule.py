"""The pipelined schedule's counted costs on the bundled checkpoint (issue 12).

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_schedule.py   # JSON to results/pipeline_schedule.json

``benchmarks/pipeline_ceiling.py`` prices the schedule from *modelled*
rejections; this runs it (the serial oracle, ``vllm_loopspec.pipelined_reference``)
on the benchmark prompts and counts what it does: ticks and in-flight rows
per committed token, first-candidate acceptance, how often a second proposal
rescues a rejection, and the loop passes spent on pruned tokens, greedy and
at T=0.8. Each run is checked against plain decoding (greedy: token for
token). The counts are then priced with the machine's measured costs (the
inputs of ``results/pipeline_ceiling.json``: ``S`` per step, ``P`` per tick,
``L(rows)`` per loop pass), for a step of ``K`` slots that fills and drains
its pipeline once (RFC §7):

    pipelined ms per token = (S + (ticks_per_token·(K+1) + R/d1 − 1)·(d1·L(rows) + P)) / (K+1)

against native's ``S + R·L(1)``. No wall-clock is measured here: the oracle
runs one token per matmul, so its own time says nothing about the engine's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from vllm_loopspec.pipelined_reference import Sampling, decode_pipelined, decode_plain  # noqa: E402


def load_prompts(name: str) -> list[str]:
    return [json.loads(line)["prompt"] for line in (ROOT / "benchmarks" / "prompts" / f"{name}.jsonl")
            .read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    ap.add_argument("--prompts", default="mixed")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--out", type=Path, default=RESULTS / "pipeline_schedule.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vllm_loopspec.reference import OuroReference

    torch.manual_seed(0)
    model = OuroReference.from_pretrained(args.checkpoint)
    R = model.config.total_ut_steps
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    prompts = [tokenizer.encode(p)[-256:] for p in load_prompts(args.prompts)[: args.num_prompts]]
    ceiling = json.loads((RESULTS / "pipeline_ceiling.json").read_text())["inputs"]
    S, P = ceiling["S_ms"], ceiling["P_ms"]
    L = {int(r): ms for r, ms in ceiling["L_ms"].items()}

    def loop_ms(rows: float) -> float:
        pts = sorted(L.items())
        for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
            if rows <= r1:
                return v0 + (v1 - v0) * max(rows - r0, 0) / (r1 - r0)
        return pts[-1][1]

    native_ms = S + R * loop_ms(1)
    configs = [(d1, d2) for d1 in (1, 2) for d2 in (None, *range(d1 + 1, R))]
    modes = {"greedy": Sampling(), "T0.8": Sampling(0.8)}
    rows_out = []
    for mode, sampling in modes.items():
        plain = [decode_plain(model, ids, args.new_tokens) for ids in prompts] if sampling.greedy else None
        for d1, d2 in configs:
            totals = dict(ticks=0, rows=0, passes=0, pruned=0, committed=0, first=0, second=0, proposals=0)
            gen = torch.Generator().manual_seed(1)
            for i, ids in enumerate(prompts):
                out, st = decode_pipelined(model, ids, args.new_tokens, d1, d2, sampling=sampling, generator=gen)
                if plain is not None and out != plain[i]:
                    raise AssertionError(f"pipelined greedy output differs from plain decoding (d1={d1}, d2={d2})")
                for key, value in (("ticks", st.ticks), ("rows", st.rows), ("passes", st.loop_passes),
                                   ("pruned", st.pruned_loop_passes), ("committed", st.committed),
                                   ("first", st.first_accepted), ("second", st.second_accepted),
                                   ("proposals", st.second_proposals)):
                    totals[key] += value
            n = totals["committed"]
            rejected = n - totals["first"]
            row = {"mode": mode, "d1": d1, "d2": d2, "committed": n,
                   "ticks_per_token": totals["ticks"] / n, "rows_per_tick": totals["rows"] / totals["ticks"],
                   "loop_passes_per_token": totals["passes"] / n, "pruned_pass_share": totals["pruned"] / totals["passes"],
                   "first_acceptance": totals["first"] / n,
                   "second_proposals_per_token": totals["proposals"] / n,
                   "rescued_share_of_rejections": totals["second"] / rejected if rejected else None}
            tick_ms = d1 * loop_ms(row["rows_per_tick"]) + P
            row["priced"] = {f"K{k}": round(native_ms / ((S + (row["ticks_per_token"] * (k + 1) + R / d1 - 1) * tick_ms)
                                                          / (k + 1)), 3) for k in args.ks}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    record = {"benchmark": "pipeline_schedule", "checkpoint": str(args.checkpoint.relative_to(ROOT)), "loops": R,
              "prompts": f"{args.prompts} (first {args.num_prompts}, last 256 tokens)", "new_tokens": args.new_tokens,
              "priced_with": {"S_ms": S, "P_ms": P, "L_ms": L, "native_ms_per_token": native_ms,
                              "from": "results/pipeline_ceiling.json inputs"},
              "command": "python benchmarks/pipeline_schedule.py " + " ".join(sys.argv[1:]),
              "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "results": rows_out}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
