"""The adaptive policy's memory: what the engine measured, fed to
:func:`vllm_loopspec.speculative.policy.decide` every step.

* **Acceptance** per request and draft position, an exponentially weighted
  estimate started from the engine-wide estimate of the request's sampling
  mode (greedy and sampled requests accept differently).
* **Step costs**, fitted by least squares from the engine's own step timings
  (model runner from ``execute_model`` to the end of ``sample_tokens``, plus
  the median gap after each kind of step: the scheduler and output handling). Until
  both kinds of step have been timed in enough shapes (warm-up), rounds use
  the configured starting K, cycling through other K and plain steps to
  sample the shapes; afterwards one step in :data:`EXPLORE_EVERY` tries a
  neighbour of the decision, so the fit follows a machine that changes.
* **Width cap** with hysteresis: when the policy has chosen plain steps
  :data:`DISARM_AFTER` times in a row, the width it did so at becomes the
  cap and every step is plain (vLLM's plain step, no rejection sampler, no
  policy work) until the batch narrows to
  :func:`~vllm_loopspec.speculative.policy.rearm_width` of the cap, or a
  periodic probe finds speculation paying again at the current width.
* **Per-request off switch**: a request the policy gives no drafts for its
  low acceptance is paused, then re-probed with one draft after a back-off
  that doubles each time the probe fails.
* **Measured-rate guard**: the model above predicts; the guard checks. For
  decode-only steps it keeps the committed tokens per second that plain
  steps and speculative steps actually delivered, per batch-width bucket
  (powers of two). Where speculation has delivered less than plain decoding
  at this width, a speculative decision becomes a plain step (counted as
  ``measured_rate``, and toward the width cap), so a cost model that is off
  at some width (a per-row cost it could not separate, a busy machine)
  cannot keep the engine slower than native. Exploration and the disarmed
  probes keep both figures fresh.

No constant here is a machine cost; every cost comes from measurement.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from vllm_loopspec.speculative.policy import Candidate, StepCosts, decide, fit_linear, rearm_width, shape_medians

ACCEPTANCE_PRIOR = 0.5  # engine-wide start, replaced by measurement within a few rounds
# Weight of the newest observation: a running mean over the first 1/w
# observations of a position, then an exponentially weighted one.
REQUEST_WEIGHT = 0.1
ENGINE_WEIGHT = 0.02
WARMUP_PLAIN_SAMPLES = 6
WARMUP_SPEC_SAMPLES = 12
EXPLORE_EVERY = 8  # steps
DISARM_AFTER = 4  # consecutive plain decisions
REFIT_EVERY = 8  # new samples
SAMPLE_WINDOW = 512
PROBE_BACKOFF = (8, 256)  # steps: first pause, longest pause

# Reasons a request decodes one token without drafting (metrics labels).
SKIP_WIDTH_CAP = "width_cap"
SKIP_LOW_ACCEPTANCE = "low_acceptance"
SKIP_COST = "cost_model"
SKIP_MEASURED = "measured_rate"

# The measured-rate guard: weight of a new step's rate once a bucket has this
# many samples (a running mean before), and samples both kinds of step need
# at a width before the guard speaks.
GUARD_WEIGHT = 0.1
GUARD_MIN_SAMPLES = 4


@dataclass
class _Estimate:
    """Conditional acceptance per draft position, exponentially weighted.
    A position never drafted yet reads as the last position that was (the
    chain's tail is untested, not worse)."""

    values: np.ndarray
    seen: np.ndarray

    @classmethod
    def prior(cls, k: int) -> "_Estimate":
        return cls(np.full(k, ACCEPTANCE_PRIOR), np.zeros(k, dtype=np.int64))

    def copy(self) -> "_Estimate":
        return _Estimate(self.values.copy(), self.seen.copy())

    def update(self, outcome: np.ndarray, weight: float) -> None:
        n = len(outcome)
        self.seen[:n] += 1
        step = np.maximum(1.0 / self.seen[:n], weight)
        self.values[:n] += step * (outcome - self.values[:n])

    def read(self) -> tuple[float, ...]:
        out = self.values.copy()
        for j in range(1, len(out)):
            if not self.seen[j]:
                out[j] = out[j - 1]
        return tuple(out)


@dataclass
class _Rate:
    """Committed tokens per second of one kind of step, weighted to recent."""

    value: float = 0.0
    samples: int = 0

    def update(self, rate: float) -> None:
        self.samples += 1
        self.value += max(1.0 / self.samples, GUARD_WEIGHT) * (rate - self.value)


def width_bucket(width: int) -> int:
    """Widths 1, 2, 3-4, 5-8, 9-16, ...: rates are compared within a bucket."""
    return max(int(width) - 1, 0).bit_length()


@dataclass
class _RequestState:
    acceptance: _Estimate
    paused_until: int = -1
    backoff: int = PROBE_BACKOFF[0]
    probing: bool = False


@dataclass
class StepRecord:
    """One decision, kept for plots and tests."""

    step: int
    width: int
    drafts: tuple[int, ...]
    reason: str  # "warmup" | "explore" | "policy" | "width_cap" | "measured_rate"


@dataclass
class AdaptiveController:
    max_k: int
    start_k: int
    step: int = 0
    armed: bool = True
    cap: int | None = None
    costs: StepCosts | None = None
    plain_streak: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=4096))

    def __post_init__(self) -> None:
        self._requests: dict[str, _RequestState] = {}
        self._engine_acceptance = {mode: _Estimate.prior(self.max_k) for mode in (False, True)}
        self._plain: deque = deque(maxlen=SAMPLE_WINDOW)  # (tokens, seconds)
        self._spec: deque = deque(maxlen=SAMPLE_WINDOW)  # (ticks, spec_rows, tokens, seconds)
        # Time between a step's end and the next step's start (scheduler,
        # output handling), by the kind of the step it follows: a round
        # hands back more tokens than a plain step.
        self._gaps: dict[bool, deque] = {False: deque(maxlen=64), True: deque(maxlen=64)}
        self._last_kind: bool | None = None  # speculative? of the last timed step
        self._pending_rate: tuple[tuple[int, bool], int, float] | None = None
        self._shapes_seen: set[tuple[int, int, int]] = set()
        self._new_samples = 0
        self._rates: dict[tuple[int, bool], _Rate] = {}  # (width bucket, speculative) -> delivered

    # -- measurements -------------------------------------------------------------
    def observe_round(self, req_id: str, sampled: bool, num_drafts: int, num_accepted: int) -> None:
        """A verified round: drafts ``1..num_accepted`` accepted, the next (if
        drafted) rejected."""
        tested = min(num_accepted + 1, num_drafts)
        outcome = (np.arange(tested) < num_accepted).astype(np.float64)
        self._engine_acceptance[sampled].update(outcome, ENGINE_WEIGHT)
        state = self._request(req_id, sampled)
        state.acceptance.update(outcome, REQUEST_WEIGHT)
        if state.probing:
            state.probing = False

    def observe_step(self, ticks: int, spec_rows: int, tokens: int, seconds: float,
                     width: int | None = None, committed: int | None = None) -> None:
        """A timed engine step (``ticks == 0``: plain). The first step of
        each shape is not a sample: it pays one-off work (kernel selection,
        compilation of a new size) that later steps of the shape do not.
        ``width``/``committed``: for a decode-only step, its requests and
        the tokens they committed (the measured-rate guard's input)."""
        shape = (ticks, spec_rows, tokens)
        self._last_kind, self._pending_rate = ticks > 0, None
        if shape not in self._shapes_seen:
            self._shapes_seen.add(shape)
            return
        if width and committed:
            # Its rate counts the gap that follows it (observe_gap).
            self._pending_rate = ((width_bucket(width), ticks > 0), committed, seconds)
        if ticks == 0:
            self._plain.append((tokens, seconds))
        else:
            self._spec.append((ticks, spec_rows, tokens, seconds))
        self._new_samples += 1
        if self._new_samples >= REFIT_EVERY:
            self._refit()

    def observe_gap(self, seconds: float | None) -> None:
        """Time between the end of one step and the start of the next; None
        where it may hold idle time (the next step admits new requests: the
        engine may have waited for them), which is no step's cost."""
        if self._last_kind is None:
            return
        if seconds is not None:
            self._gaps[self._last_kind].append(seconds)
        if self._pending_rate is not None:
            key, committed, step_seconds = self._pending_rate
            gap = self._median_gap(key[1])
            self._rates.setdefault(key, _Rate()).update(committed / max(step_seconds + gap, 1e-9))
            self._pending_rate = None

    def _median_gap(self, speculative: bool) -> float:
        """Median gap after a kind of step (all gaps while the kind has fewer
        than 8: plain steps may be rare)."""
        gaps = self._gaps[speculative]
        if len(gaps) < 8:
            gaps = [g for kind in (False, True) for g in self._gaps[kind]]
        return float(np.median(gaps)) if len(gaps) else 0.0

    def forget(self, live_req_ids) -> None:
        """Drop the state of requests no longer in the batch."""
        for req_id in set(self._requests) - set(live_req_ids):
            del self._requests[req_id]

    # -- decision -----------------------------------------------------------------
    def plan(self, requests: list[tuple[str, bool, int]], other_tokens: int = 0) -> tuple[list[int], dict[str, int]]:
        """``K_i`` for ``(req_id, sampled, max_drafts)`` of the next step, and
        request-steps without drafts counted by reason."""
        self.step += 1
        width = len(requests)
        skipped: dict[str, int] = {}
        if not requests:
            return [], skipped
        if self.costs is None:
            drafts = self._warmup(requests)
            self._record(width, drafts, "warmup")
            return drafts, skipped
        if not self.armed and width <= rearm_width(self.cap):
            self.armed, self.cap = True, None
        if not self.armed and self.step % (2 * EXPLORE_EVERY) != 0:
            skipped[SKIP_WIDTH_CAP] = width
            drafts = [0] * width
            self._record(width, drafts, "width_cap")
            return drafts, skipped
        # (Disarmed, one step in 2 * EXPLORE_EVERY asks the policy: if
        # speculation pays again at this width it re-arms, otherwise the step
        # is a one-draft round that measures what a round costs this wide.)
        probes = []
        candidates = []
        for req_id, sampled, limit in requests:
            state = self._request(req_id, sampled)
            paused = state.paused_until > self.step
            probe = not paused and state.paused_until >= 0 and limit > 0
            probes.append(probe)
            candidates.append(Candidate(state.acceptance.read(), 0 if paused or probe else limit))
        decision = decide(candidates, self.costs, self.max_k, other_tokens)
        drafts = list(decision.drafts)
        reason = "policy"
        measured_loss = not decision.plain and self.speculation_loses(width)
        if not self.armed:
            if decision.plain or measured_loss:
                # Stay disarmed; measure a round of this width: the policy's
                # own drafts where it wanted to speculate, else one draft.
                if decision.plain:
                    drafts = [min(1, c.max_drafts) for c in candidates]
                self._record(width, drafts, "explore")
                return drafts, skipped
            self.armed, self.cap = True, None
        if measured_loss:
            drafts, reason = [0] * width, SKIP_MEASURED
        eligible = any(c.max_drafts for c in candidates)
        plain = decision.plain or measured_loss
        self.plain_streak = self.plain_streak + 1 if plain and eligible else 0
        if self.plain_streak >= DISARM_AFTER:
            self.armed, self.cap, self.plain_streak = False, width, 0
        if self.step % EXPLORE_EVERY == 0:
            drafts = self._explore(list(decision.drafts) if measured_loss else drafts,
                                   [c.max_drafts for c in candidates])
            reason = "explore"
        for i, (req_id, _, limit) in enumerate(requests):
            state = self._requests[req_id]
            if probes[i]:
                drafts[i] = 1  # re-probe a paused request with one draft
                state.paused_until = -1
                state.probing = True
            elif state.paused_until > self.step:
                skipped[SKIP_LOW_ACCEPTANCE] = skipped.get(SKIP_LOW_ACCEPTANCE, 0) + 1
            elif drafts[i] == 0 and limit > 0 and any(drafts):
                # Others draft but this one is not worth a draft: pause it.
                self._pause(state)
                skipped[SKIP_LOW_ACCEPTANCE] = skipped.get(SKIP_LOW_ACCEPTANCE, 0) + 1
            elif drafts[i] == 0 and limit > 0:
                why = SKIP_MEASURED if reason == SKIP_MEASURED else SKIP_COST
                skipped[why] = skipped.get(why, 0) + 1
        self._record(width, drafts, reason)
        return drafts, skipped

    def speculation_loses(self, width: int) -> bool:
        """Speculative steps of this width bucket have delivered fewer
        committed tokens per second than plain ones (both measured enough)."""
        bucket = width_bucket(width)
        plain, spec = self._rates.get((bucket, False)), self._rates.get((bucket, True))
        if plain is None or spec is None or min(plain.samples, spec.samples) < GUARD_MIN_SAMPLES:
            return False
        return spec.value < plain.value

    # -- internals ----------------------------------------------------------------
    def _request(self, req_id: str, sampled: bool) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            state = _RequestState(self._engine_acceptance[sampled].copy())
            self._requests[req_id] = state
        return state

    def _pause(self, state: _RequestState) -> None:
        state.paused_until = self.step + state.backoff
        state.backoff = min(state.backoff * 2, PROBE_BACKOFF[1])

    def _warmup(self, requests) -> list[int]:
        """Before the cost model exists: the configured K, with every fourth
        step plain and the K of the others cycling, so that the fit sees
        both kinds of step in several shapes."""
        phase = self.step % 4
        if phase == 0:
            return [0] * len(requests)
        k = (self.start_k, 1, self.max_k)[phase - 1]
        return [min(k, limit) for _, _, limit in requests]

    def _explore(self, drafts: list[int], limits: list[int]) -> list[int]:
        """A neighbour of the decision: one draft more, one fewer, or plain,
        in turn."""
        turn = (self.step // EXPLORE_EVERY) % 3
        if turn == 2 or not any(limits):
            return [0] * len(drafts)
        k = max(drafts) if any(drafts) else 0
        k = min(self.max_k, k + 1) if turn == 0 else max(1, k - 1)
        return [min(k, limit) for limit in limits]

    def _refit(self) -> None:
        self._new_samples = 0
        plain = np.array(self._plain, dtype=np.float64).reshape(-1, 2)
        spec = np.array(self._spec, dtype=np.float64).reshape(-1, 4)
        if len(plain) < WARMUP_PLAIN_SAMPLES or len(spec) < WARMUP_SPEC_SAMPLES:
            return
        shapes, seconds, counts = shape_medians(spec)
        ticks, rows, tokens = shapes[:, 0], shapes[:, 1], shapes[:, 2]
        spec_coef = fit_linear(np.column_stack([np.ones(len(shapes)), ticks, ticks * rows, tokens]), seconds, counts)
        shapes, seconds, counts = shape_medians(plain)
        if len(shapes) >= 2:
            plain_coef = fit_linear(np.column_stack([np.ones(len(shapes)), shapes[:, 0]]), seconds, counts)
        elif spec_coef is not None:
            # One plain shape only (decode steps of one width, no prefill
            # seen): its per-token cost is the rounds' per-token cost.
            per_token = spec_coef[3]
            plain_coef = np.array([max(seconds[0] - per_token * shapes[0, 0], 0.0), per_token])
        else:
            plain_coef = None
        if plain_coef is None or spec_coef is None:
            return
        plain_coef[0] += self._median_gap(False)
        spec_coef[0] += self._median_gap(True)
        self.costs = StepCosts(plain=tuple(float(c) for c in plain_coef), spec=tuple(float(c) for c in spec_coef))

    def _record(self, width: int, drafts: list[int], reason: str) -> None:
        self.history.append(StepRecord(self.step, width, tuple(drafts), reason))
