"""How much to speculate in the next step: a pure decision from measured costs.

The core is :func:`decide`: for the requests of the next step (each with its
estimated acceptance per draft position and the drafts its budget allows) and
the engine's step costs (:class:`StepCosts`, fitted from its own timings),
it returns ``K_i`` per request that maximises expected committed tokens per
second (DESIGN.md §4, general form):

    plain step    T = s_p + t_p·tokens + x_p·context    commits 1 per request
    loopspec step T = s_s + c_k·K + c_r·K·B_s + t_s·tokens + x_s·context
                                                        commits 1 + Σ_j Π_{i≤j} a_i

``K`` is the step's number of draft ticks (the largest ``K_i``), ``B_s`` the
rows that draft, ``tokens`` every scheduled token (drafts are verified rows),
``context`` the tokens the step's rows attend to (their lengths, summed):
without it, steps of one width over short and long contexts are one shape
and the fitted intercepts sit between them.
``K = 0`` everywhere is vLLM's plain step. Nothing here touches an engine:
:mod:`vllm_loopspec.speculative.adaptive` feeds it measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Candidate:
    """A decoding request as the policy sees it for the next step."""

    acceptance: tuple[float, ...]
    """Estimated probability that draft ``j`` is accepted given drafts
    ``1..j-1`` were (index ``j-1``)."""
    max_drafts: int
    """Drafts the request may make (budget, context, options); 0: none."""


@dataclass(frozen=True)
class StepCosts:
    """Seconds per engine step, linear in the step's shape."""

    plain: tuple[float, float]
    """``(s_p, t_p)``: intercept, per scheduled token."""
    spec: tuple[float, float, float, float]
    """``(s_s, c_k, c_r, t_s)``: intercept, per draft tick, per drafting row
    and tick, per scheduled token."""
    context: tuple[float, float] = (0.0, 0.0)
    """``(x_p, x_s)``: per context token of a plain and of a loopspec step."""

    def plain_step(self, tokens: int, context: int = 0) -> float:
        s, t = self.plain
        return s + t * tokens + self.context[0] * context

    def spec_step(self, ticks: int, spec_rows: int, tokens: int, context: int = 0) -> float:
        s, c_k, c_r, t = self.spec
        return s + c_k * ticks + c_r * ticks * spec_rows + t * tokens + self.context[1] * context


@dataclass(frozen=True)
class Decision:
    drafts: tuple[int, ...]
    """``K_i`` per candidate (all 0: a plain step)."""
    rate: float
    """Expected committed tokens per second of the chosen step."""
    plain_rate: float
    """The same for a plain step, for comparison."""

    @property
    def plain(self) -> bool:
        return not any(self.drafts)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Committed tokens of a round with ``k`` drafts: ``1 + Σ_j Π_{i≤j} a_i``."""
    reach = np.cumprod(np.asarray(acceptance[:k], dtype=np.float64))
    return 1.0 + float(reach.sum())


def decide(candidates: Sequence[Candidate], costs: StepCosts, max_k: int, other_tokens: int = 0,
           context: int = 0, factors: Sequence[float] | None = None, margin: float = 0.0,
           later_rates: Sequence[float] | None = None) -> Decision:
    """``K_i`` per candidate for the next step. ``other_tokens``: scheduled
    tokens that commit nothing this step (prefill chunks); ``context``: the
    step's rows' lengths, summed; ``factors[k]``: measured over predicted
    time of steps with ``k`` draft ticks (0: plain), which scales the
    prediction; ``margin``: how much faster (a share) a round must be
    expected to be than the plain step to be chosen, a hedge against the
    estimates' error where the two are close; ``later_rates[i]``: tokens
    per second at which the tokens request i does not commit now would be
    committed later (see :func:`later_rates`; default: the step's own
    rate). Every number of draft ticks ``1..max_k`` is evaluated at once
    (one row per choice)."""
    n = len(candidates)
    factors = np.ones(max_k + 1) if factors is None else np.asarray(factors, dtype=np.float64)
    plain_rate = n / max(costs.plain_step(n + other_tokens, context) * factors[0], 1e-9)
    plain = Decision(tuple([0] * n), plain_rate, plain_rate)
    if n == 0 or max_k < 1:
        return plain
    reach = _reach_matrix(candidates, max_k)
    gains = np.concatenate([np.zeros((n, 1)), np.cumsum(reach, axis=1)], axis=1)  # gains[i, k]
    limits = np.array([min(max(c.max_drafts, 0), max_k) for c in candidates], dtype=np.int64)
    drafts = np.minimum(limits[None, :], np.arange(1, max_k + 1)[:, None])  # [choice, request]
    later = None if later_rates is None else np.asarray(later_rates, dtype=np.float64)
    drafts = _trim(drafts, reach, gains, costs, other_tokens, context, factors, later)
    rates = _rates(drafts, gains, costs, other_tokens, context, factors)
    best = int(np.argmax(rates))
    if rates[best] <= plain_rate * (1.0 + margin) or not drafts[best].any():
        return plain
    return Decision(tuple(int(x) for x in drafts[best]), float(rates[best]), plain_rate)


def width_cap(costs: StepCosts, acceptance: Sequence[float], max_k: int, max_width: int) -> int | None:
    """The smallest batch width at which a batch of requests with this
    acceptance decodes faster plainly (None: speculation pays at every width
    up to ``max_width``)."""
    if max_k < 1:
        return 1
    widths = np.arange(1, max_width + 1, dtype=np.float64)
    reach = _reach_matrix([Candidate(tuple(acceptance), max_k)], max_k)[0]
    plain = widths / np.maximum(costs.plain[0] + costs.plain[1] * widths, 1e-9)
    best_spec = np.zeros_like(widths)
    for k in range(1, max_k + 1):
        s, c_k, c_r, t = costs.spec
        seconds = s + c_k * k + c_r * k * widths + t * widths * (1 + k)
        best_spec = np.maximum(best_spec, widths * (1.0 + reach[:k].sum()) / np.maximum(seconds, 1e-9))
    losing = np.nonzero(best_spec <= plain)[0]
    return int(widths[losing[0]]) if len(losing) else None


def later_rates(candidates: Sequence[Candidate], remaining: Sequence[int], costs: StepCosts,
                context: int = 0, plain_factor: float = 1.0) -> np.ndarray:
    """Per request: tokens per second at which the tokens it does not commit
    in this step would be committed later, for :func:`decide` to price its
    drafts against (``inf``: the step's own rate).

    A request left without drafts while the others draft falls behind them.
    If it would then finish after all of them (its ``remaining`` tokens, one
    a step, outlast every other's remaining over the tokens a round at its
    limit commits), the tokens it did not commit are decoded at the end, in
    plain steps of one row (a straggler: once 13 of 16 greedy requests
    drafting 8 tokens a round are done, the 3 left behind run narrow plain
    steps for a hundred more). Its drafts are then priced against that
    rate, not the step's. A request that finishes before another anyway
    commits its deferred tokens in steps that run regardless, and keeps the
    step's rate. ``context``: the step's rows' lengths, summed.

    Only the current batch is counted: requests still to arrive would keep
    the batch wide, so under a queue of arrivals this drafts more for rows
    that lag than the step's rate alone would."""
    n = len(candidates)
    later = np.full(n, np.inf)
    if n < 2:
        return later
    max_k = max(max((c.max_drafts for c in candidates), default=0), 1)
    reach = _reach_matrix(candidates, max_k)
    limits = np.array([min(max(c.max_drafts, 0), max_k) for c in candidates], dtype=np.int64)
    gains = np.concatenate([np.zeros((n, 1)), np.cumsum(reach, axis=1)], axis=1)
    remaining = np.maximum(np.asarray(remaining, dtype=np.float64), 1.0)
    drafting_steps = remaining / (1.0 + gains[np.arange(n), limits])
    # The latest other finish, per request: the largest drafting_steps but
    # its own (the second largest for the request holding the largest).
    order = np.argsort(drafting_steps)
    latest_other = np.full(n, drafting_steps[order[-1]])
    latest_other[order[-1]] = drafting_steps[order[-2]]
    one_row = (costs.plain[0] + costs.plain[1] + costs.context[0] * context / n) * plain_factor
    later[remaining > latest_other] = 1.0 / max(one_row, 1e-9)
    return later


def seeded_costs(tick: tuple[float, float], logits: tuple[float, float], num_loops: int,
                 draft_loops: int) -> StepCosts:
    """Step costs before any engine step was timed, from the model's pieces
    timed at startup: ``tick = (a, b)``, seconds of one loop of the layer
    stack over ``n`` rows as ``a + b·n``; ``logits = (e, f)``, of ``lm_head``
    over ``n`` rows. A plain step is ``R`` loops over its tokens and
    ``lm_head`` over them; a round adds, per draft tick, ``d`` loops and
    ``lm_head`` over its drafting rows, and its tokens take ``R`` loops
    (shallow ticks, then deep ones) and verification logits each.

    No attention (the pieces ran without KV, so the context terms are 0),
    no scheduler, sampler or host bookkeeping: a seed to decide the first
    steps with, replaced by the fit of the engine's own step timings as soon
    as it has the samples (:meth:`~.adaptive.AdaptiveController.seed`)."""
    a, b = (max(float(c), 0.0) for c in tick)
    e, f = (max(float(c), 0.0) for c in logits)
    intercept = num_loops * a + e
    per_token = num_loops * b + f
    return StepCosts(plain=(intercept, per_token),
                     spec=(intercept, draft_loops * a + e, draft_loops * b + f, per_token))


def rearm_width(cap: int) -> int:
    """Width at or below which speculation re-arms after the cap turned it
    off: a quarter below the cap (at least one row below), so that a batch
    hovering at the cap does not flip every step. 0 for a cap of 1: a lone
    request held plain is re-armed by a probe, not by the width."""
    return max(0, cap - max(1, cap // 4))


# -- internals ------------------------------------------------------------------

def _reach_matrix(candidates: Sequence[Candidate], max_k: int) -> np.ndarray:
    """``reach[i, j]``: probability that request i's draft j+1 is accepted
    (all earlier ones were). Estimates shorter than ``max_k`` repeat their
    last value."""
    rows = [c.acceptance[:max_k] for c in candidates]
    if any(len(a) < max_k for a in rows):
        rows = [tuple(a) + (a[-1] if len(a) else 0.0,) * (max_k - len(a)) for a in rows]
    return np.cumprod(np.clip(np.array(rows, dtype=np.float64), 0.0, 1.0), axis=1)


def expected_rate(candidates: Sequence[Candidate], drafts: Sequence[int], costs: StepCosts, other_tokens: int = 0,
                  context: int = 0, factors: Sequence[float] | None = None) -> float:
    """Expected committed tokens per second of a step with these ``K_i``."""
    k = max(max(drafts, default=0), 1)
    reach = _reach_matrix(candidates, k)
    gains = np.concatenate([np.zeros((len(candidates), 1)), np.cumsum(reach, axis=1)], axis=1)
    factors = None if factors is None else np.asarray(factors, dtype=np.float64)
    return float(_rates(np.asarray([drafts], dtype=np.int64), gains, costs, other_tokens, context, factors)[0])


def _rates(drafts: np.ndarray, gains: np.ndarray, costs: StepCosts, other_tokens: int,
           context: int = 0, factors: np.ndarray | None = None) -> np.ndarray:
    """Expected committed tokens per second of each row of ``drafts``
    (``[choice, request]``)."""
    n = drafts.shape[1]
    committed = n + gains[np.arange(n)[None, :], drafts].sum(axis=1)
    ticks = drafts.max(axis=1)
    tokens = n + other_tokens + drafts.sum(axis=1)
    s, c_k, c_r, t = costs.spec
    x_p, x_s = costs.context
    seconds = np.where(ticks > 0,
                       s + c_k * ticks + c_r * ticks * (drafts > 0).sum(axis=1) + t * tokens + x_s * context,
                       costs.plain[0] + costs.plain[1] * tokens + x_p * context)
    if factors is not None:
        seconds = seconds * factors[ticks]
    return committed / np.maximum(seconds, 1e-9)


def _trim(drafts: np.ndarray, reach: np.ndarray, gains: np.ndarray, costs: StepCosts,
          other_tokens: int, context: int = 0, factors: np.ndarray | None = None,
          later: np.ndarray | None = None) -> np.ndarray:
    """Drop drafts that cost more than they bring at the step's rate (or, for
    a row with a ``later`` rate below it, at that rate: what its tokens
    would cost if left for later): a tail
    draft worth ``reach`` tokens costs its verification ``t_s``; a row's
    whole share costs ``c_r`` per draft tick (every drafting row runs every
    tick) plus ``t_s`` per draft. Repeated until stable (dropping drafts
    raises the rate). ``reach`` falls along each row, so the drafts kept
    are a prefix."""
    _, _, per_row_tick, per_token = (max(c, 0.0) for c in costs.spec)
    rows = np.arange(drafts.shape[1])[None, :]
    for _ in range(3):
        rate = _rates(drafts, gains, costs, other_tokens, context, factors)[:, None]
        if later is not None:
            rate = np.minimum(rate, later[None, :])  # [choice, request]
        scale = 1.0 if factors is None else factors[drafts.max(axis=1)][:, None]
        worth = (reach[None, :, :] >= (rate * scale * per_token)[:, :, None]).sum(axis=2)
        kept = np.minimum(drafts, worth)
        row_cost = scale * (per_row_tick * kept.max(axis=1, keepdims=True) + per_token * kept)
        kept = np.where(gains[rows, kept] < rate * row_cost, 0, kept)
        if (kept == drafts).all():
            break
        drafts = kept
    return drafts


def fit_linear(features: np.ndarray, seconds: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray | None:
    """Weighted least squares with non-negative coefficients (a cost cannot
    shrink as a step grows): features with a negative fit are dropped and
    the rest refitted. A slight ridge splits the cost between features the
    samples cannot tell apart (at one batch width, draft ticks and drafting
    rows move together) instead of giving it all to one. None without
    two distinct samples."""
    if features.shape[0] < 2:
        return None
    w = np.sqrt(weights if weights is not None else np.ones(len(seconds)))
    scale = np.linalg.norm(features, axis=0)
    scale[scale == 0] = 1.0
    x = features / scale * w[:, None]
    y = seconds * w
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        xa = x[:, active]
        ridge = 1e-4 * np.eye(len(active))
        sol = np.linalg.solve(xa.T @ xa + ridge, xa.T @ y)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol / scale[active]
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def shape_medians(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Median seconds per distinct step shape (the columns before the last)
    and the number of samples of each: timings on a shared machine have
    outliers a mean would follow."""
    shapes, inverse, counts = np.unique(samples[:, :-1], axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    # Sorted by shape, then by seconds: each shape's median sits in the
    # middle of its run (vectorised; the policy refits on the hot path).
    order = np.lexsort((samples[:, -1], inverse))
    seconds = samples[order, -1]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    medians = 0.5 * (seconds[starts + (counts - 1) // 2] + seconds[starts + counts // 2])
    return shapes, medians, counts.astype(np.float64)
