"""What the sampled pipelined decider costs per tick, alone (no engine): one
proposal and one verification of a seeded (and of an unseeded) row over a
4096-token vocabulary, ``process`` as the drafter's (one temperature for
the tick's rows, top-k/top-p none, a softmax; before the nineteenth
session the drafter gathered the rows' temperatures, a few operations
more), 2000 ticks, the best of three.

    .venv/bin/python benchmarks/probes/sampled_decider_cost.py [threads] [label]

Runs whichever ``vllm_loopspec`` is first on ``sys.path``: put a worktree of
an earlier revision on ``PYTHONPATH`` to price its decider (the decider of
revisions before the one-call API had ``propose``/``verify``). Appends a
record to ``benchmarks/results/sampled_decider_cost.json``.
"""

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 4096


def per_tick_us(seeded: bool, ticks: int = 2000) -> float:
    from vllm_loopspec.speculative import pipeline

    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    def process(logits, rows):  # as LoopSpecDrafter._pipeline_decider's: one temperature, no top-k/top-p
        return apply_top_k_top_p(logits.float() / 0.8, None, None).softmax(dim=-1, dtype=torch.float32)

    generators = {0: torch.Generator().manual_seed(1)} if seeded else {}
    decider = pipeline.SampledDecider(process, {0: True}, generators)
    one_call = hasattr(decider, "decide")
    logits = torch.randn(ticks + 1, 2, VOCAB) * 3
    first = (decider.decide(logits[0][:1], [(0, 0)], [], [], []) if one_call
             else decider.propose(logits[0][:1], [(0, 0)]))
    proposal = first[0]
    start = time.perf_counter()
    for t in range(ticks):
        if one_call:
            out = decider.decide(logits[t], [(0, t + 1)], [], [(0, t)], [proposal])
        else:
            out = decider.propose(logits[t][:1], [(0, t + 1)]) + decider.verify(logits[t][1:], [(0, t)], [proposal])
        proposal = out[0]
    return (time.perf_counter() - start) / ticks * 1e6


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    label = sys.argv[2] if len(sys.argv) > 2 else "current"
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    from vllm_loopspec.speculative import pipeline

    record = {"probe": "sampled_decider_cost", "when": time.strftime("%Y-%m-%d %H:%M:%S"), "label": label,
              "decider_from": pipeline.__file__, "threads": threads,
              "us_per_tick": {kind: min(per_tick_us(kind == "seeded") for _ in range(3))
                              for kind in ("seeded", "unseeded")}}
    out = ROOT / "benchmarks" / "results" / "sampled_decider_cost.json"
    records = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(records + [record], indent=1) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
