"""The pipelined schedule's own host cost, no engine or model (issue 12):
``PipelineSchedule`` driven through a step of ``c`` rows with ``K`` slots
at ``d1`` (R = 4), a tenth of the first proposals wrong; prints the best of
7 repeats in microseconds per tick. Prints only.

    .venv/bin/python benchmarks/probes/schedule_host_cost.py C K D1
"""
import random
import sys
import time

import numpy as np

from vllm_loopspec.speculative.pipeline import PipelineSchedule
from vllm_loopspec.speculative.plan import StepLayout


def layout(rows):
    query = np.array([n + k for n, k, _ in rows])
    start = np.concatenate([[0], np.cumsum(query)])
    return StepLayout(query_start=start, num_drafts=np.array([k for _, k, _ in rows]),
                      seq_lens=np.array([c for _, _, c in rows]) + query)


def drive(schedule, wrong):
    while not schedule.done:
        for _ in schedule.passes():
            pass
        propose, _, verify = schedule.finish_tick()
        for r, j in propose:
            schedule.proposed(r, j, 7 if (r, j + 1) in wrong else 1)
        for r, j in verify:
            schedule.verified(r, j, 1)


def main():
    c, k, d1 = (int(a) for a in sys.argv[1:4])
    random.seed(0)
    best = float("inf")
    for _ in range(7):
        wrong = {(r, j) for r in range(c) for j in range(1, k + 1) if random.random() < 0.1}
        start, ticks = time.perf_counter(), 0
        for _ in range(20):
            schedule = PipelineSchedule(layout([(1, k, 40 + 3 * r) for r in range(c)]), 4, d1)
            drive(schedule, wrong)
            ticks += schedule.counts.ticks
        best = min(best, (time.perf_counter() - start) / ticks * 1e6)
    print(f"c{c} K{k} d1 {d1}: {best:.1f} us per tick (schedule only)")


if __name__ == "__main__":
    main()
