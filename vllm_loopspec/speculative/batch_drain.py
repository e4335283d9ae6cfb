"""A step of ``"schedule": "auto"`` rated by how fast it drains its batch.

The chooser (:mod:`.schedule_choice`) compares arms by committed tokens per
request per second. A round advances each row by the row's own acceptance:
at width 8 on greedy short prompts, seven rows commit 15-17 tokens a round
and one commits 1-9; the seven finish, and the eighth decodes on alone at
width 1. Its rounds were observed at 387 tok/s per request against the
pipeline's 353, yet an all-round trial of the batch took 0.784 s against the
pipeline's 0.575 (``benchmarks/results/arm_rates_forced_short_c8_greedy.txt``):
the mean rate does not see the tail a lagging row leaves.

With a step's cost proportional to its width (``t`` at the full width ``n``),
a batch whose rows have ``R_i`` tokens left and commit ``e_i`` a step of an
arm drains in ``t/n * sum(R_i / e_i)``: ``H_R(e) / t`` tokens per request per
second, ``H_R`` the ``R``-weighted harmonic mean of the paces, where the
step's own rate is ``mean(c) / t``. The chooser is fed the step's committed
tokens times ``H_R(e) / mean(e)`` (:func:`drain_factor`): 1 where the rows
keep pace (plain steps; rounds whose rows accept alike), below 1 where a row
with work left lags the others.

A pace is the request's committed tokens per step of that arm over its
life, shrunk toward the step's mean by :data:`PRIOR_STEPS` steps: a lasting
pace, not one step's draw. Rating each step by the harmonic mean of its
own rows' commits (``benchmarks/results/chooser_ab_harmonic_rows.diff``)
read one unlucky round of a row as a straggler and cost the rounds their
lead where they win (long greedy prompts, width 4: 0.93-0.95x).

Only the current batch is counted (as in :func:`.policy.later_rates`):
requests still to arrive would fill the rows that finish early.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PRIOR_STEPS = 2.0  # a new request's pace: the step's mean, weighing this many steps of its own


def drain_factor(paces: Sequence[float], remaining: Sequence[float]) -> float:
    """``H_R(paces) / mean(paces)``: the rate at which a step's arm drains
    its batch (rows with ``remaining`` tokens left, committing ``paces`` a
    step) over the step's mean rate. 1 for fewer than two rows, or when no
    row has tokens left."""
    if len(paces) < 2:
        return 1.0
    left = [(r, p) for r, p in zip(remaining, paces) if r > 0 and p > 0]
    if not left:
        return 1.0
    harmonic = sum(r for r, _ in left) / sum(r / p for r, p in left)
    return harmonic / (sum(paces) / len(paces))


class DrainPaces:
    """Each request's committed tokens per step, per arm, for
    :func:`drain_factor`."""

    def __init__(self) -> None:
        self._totals: dict[str, dict[str, list[float]]] = {}  # req_id -> arm -> [tokens, steps]

    def rate_factor(self, arm: str, req_ids: Sequence[str], committed: Sequence[int],
                    remaining: Sequence[int]) -> float:
        """Count a step of ``arm`` (per row: request, tokens committed,
        tokens left after the step) and return its :func:`drain_factor`."""
        if len(req_ids) < 2:
            return 1.0
        mean = sum(committed) / len(committed)
        paces = []
        for req_id, tokens in zip(req_ids, committed):
            total = self._totals.setdefault(req_id, {}).setdefault(arm, [0.0, 0.0])
            total[0] += tokens
            total[1] += 1
            paces.append((total[0] + PRIOR_STEPS * mean) / (total[1] + PRIOR_STEPS))
        return drain_factor(paces, remaining)

    def forget(self, live: Iterable[str]) -> None:
        """Drop the requests not in ``live`` (finished or preempted)."""
        live = set(live)
        for req_id in [r for r in self._totals if r not in live]:
            del self._totals[req_id]
