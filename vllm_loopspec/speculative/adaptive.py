"""The adaptive policy's memory: what the engine measured, fed to
:func:`vllm_loopspec.speculative.policy.decide` every step.

* **Acceptance** per request and draft position, an exponentially weighted
  estimate started from the engine-wide estimate of the request's sampling
  mode (greedy and sampled requests accept differently) at the weight of
  :data:`PRIOR_ROUNDS` of its own rounds (one for greedy requests, which
  differ from each other; many for sampled ones, whose rounds vary by
  draw), scaled by a per-position calibration (accepted over estimated drafts, over every
  round of the mode): estimates are read where the policy chose to draft,
  where they were high, so deep positions run optimistic.
* **Step costs**, fitted by least squares from the engine's own step timings
  (model runner from ``execute_model`` to the end of ``sample_tokens``, plus
  the median gap after each kind of step: the scheduler and output handling).
  Until both kinds of step have been timed in enough shapes, the policy
  decides on costs seeded at startup (:meth:`AdaptiveController.seed`: the
  model's tick and ``lm_head`` timed by the drafter,
  :func:`~vllm_loopspec.speculative.policy.seeded_costs`), corrected by the
  measured factors below. Until then, if there is no seed, and until a
  sampling mode has :data:`MODE_PROBE_ROUNDS` rounds engine-wide for a batch
  with its requests, rounds use the configured starting K, cycling through
  other K and plain steps (warm-up: it measures acceptance at every draft
  position, and shapes for the fit). Afterwards one step in
  :data:`EXPLORE_EVERY` tries a neighbour of the decision, so the fit
  follows a machine that changes.
* **Margin**: a round must be expected to beat the plain step by
  :data:`SPECULATION_MARGIN`; within the estimates' error the plain step,
  vLLM's own and compiled, is the safer choice.
* **Width cap** with hysteresis: when the policy has chosen plain steps
  :data:`DISARM_AFTER` times in a row and a batch of this width with the
  engine-wide acceptance would decode plainly too, the width becomes the
  cap and every step is plain (vLLM's plain step, no rejection sampler, no
  policy work: :meth:`AdaptiveController.holds_plain`) until the batch narrows to
  :func:`~vllm_loopspec.speculative.policy.rearm_width` of the cap, its
  sampling mix changes (the cap was earned by one mix's acceptance), or a
  periodic probe finds speculation paying again at the current width. A cap
  of 1 (a lone request decodes plainly: sampled requests where a round
  costs several plain steps) is left by a probe or a change of mix only; a
  lone greedy request sets none (the next greedy request may accept
  everything). A run of plain decisions for the same requests decides
  again on one step in :data:`PLAIN_RECHECK_EVERY` only (no round moves
  their estimates meanwhile).
* **Per-request off switch**: a request the policy gives no drafts for its
  low acceptance is paused, then re-probed with one draft after a back-off
  that doubles with each pause and starts again once the request drafts on
  its own merits. A greedy request measured by fewer than
  :data:`THIN_EVIDENCE_ROUNDS` rounds of its own is paused in a plain step
  too (no other row drafting) and re-probed with the starting K: one
  missed first round must not leave it plain (the replay in
  ``benchmarks/probes/policy_sim.py``). A request that would be left
  behind (told its remaining tokens, :func:`~.policy.later_rates`) is not
  trimmed for the step's rate: it would finish alone, in one-row plain
  steps.
* **Measured correction** (the guard): the fit predicts; measurement
  checks it where the engine runs. For decode-only steps the controller
  keeps, per batch-width bucket (powers of two), sampling mix (all greedy,
  mixed, all sampled) and draft count (the step's largest ``K_i``; 0 is a
  plain step), the ratio of each step's measured time to the fit's
  prediction for it. The policy decides with predictions times these
  factors, so a fit that is off where it matters (a per-row cost it could
  not separate, the wide rounds it extrapolates to, a busy machine) is
  corrected by what steps of that kind really cost here. Time is compared,
  not delivered tokens: a draft count's tokens per second depend on when
  the policy chose it (high acceptance), its step time does not. A plain
  decision that only the factors produced counts as ``measured_rate``.
  A width and mix without factors of its own takes those of the same
  width's other mixes, then of an adjacent width bucket. At a width and
  mix seen for the first time, unless the model wants plain steps there
  with round factors measured nearby, plain steps, one-draft rounds and
  the model's choice are measured first (exploration every
  ``EXPLORE_EVERY // 2`` steps until each has :data:`GUARD_MIN_SAMPLES`);
  afterwards exploration tries neighbours, rarely where the corrected model
  expects them to lose much, and the width cap's probes back off while they
  keep confirming the cap.

No constant here is a machine cost; every cost comes from measurement.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from vllm_loopspec.speculative.policy import (Candidate, StepCosts, decide, expected_rate, fit_linear, later_rates,
                                              rearm_width, shape_medians)

ACCEPTANCE_PRIOR = 0.5  # engine-wide start, replaced by measurement within a few rounds
# Weight of the newest observation: a running mean over the first 1/w
# observations of a position, then an exponentially weighted one.
REQUEST_WEIGHT = 0.1
# A new request's start (the engine-wide estimate of its mode) weighs as this
# many of its own rounds, by mode: greedy requests differ from each other (one
# repeats itself and accepts everything, the next does not), so a greedy
# request's own rounds take over at once; a sampled request's acceptance
# varies more from draw to draw than from request to request, and a few lucky
# rounds must not read as a request worth drafting for.
PRIOR_ROUNDS = {False: 1, True: 16}
# A greedy request with fewer rounds of its own than this that a plain step
# leaves without drafts is paused and re-probed like one the others outdraft,
# with the starting K (not one draft): its estimate rests on a round or two,
# and the first tokens of a generation are the hardest to draft (on the
# bundled checkpoint at d=2, a round at the first token is rejected at once
# for a fifth of the prompts that then accept nearly every draft); alone in
# the batch it would otherwise be re-tried only by exploration, with one
# draft, one step in EXPLORE_EVERY.
THIN_EVIDENCE_ROUNDS = 4
# ... in batches up to this wide (the widths the replay covers; restricting
# it to narrower batches gave back most of the gain there).
THIN_EVIDENCE_MAX_WIDTH = 16
# In a run of plain decisions for the same requests (their estimates move only
# with rounds), a full decision is made on one step in this many.
PLAIN_RECHECK_EVERY = 4
ENGINE_WEIGHT = 0.02
WARMUP_PLAIN_SAMPLES = 6
WARMUP_SPEC_SAMPLES = 12
# A fit replaces the startup seed once its round samples span this many
# draft counts (or every count up to max_k): the seed prices each draft tick
# from measured pieces, a fit of rounds of one or two lengths only
# extrapolates to the others.
SEED_REPLACED_AFTER_TICK_COUNTS = 3
EXPLORE_EVERY = 16  # steps
# A round must be expected to beat the plain step by this share: where the
# two are within the estimates' error, the plain step (vLLM's own, compiled,
# no bookkeeping) is the safer choice.
SPECULATION_MARGIN = 0.05
# Exploring toward a draft count measured below this share of the best
# measured one happens one exploration turn in EXPLORE_POOR_EVERY.
EXPLORE_POOR_SHARE = 0.85
EXPLORE_POOR_EVERY = 4
DISARM_AFTER = 4  # consecutive plain decisions
REFIT_EVERY = 16  # new samples
SAMPLE_WINDOW = 512
PROBE_BACKOFF = (8, 256)  # steps: first pause, longest pause
# Steps between width-cap probes, first and longest: a probe round costs
# several plain steps.
CAP_PROBE_BACKOFF = (4 * EXPLORE_EVERY, 512)
GAP_MEDIAN_EVERY = 8  # new gaps between recomputations of their medians
CONTEXT_BUCKET = 64  # tokens: step contexts closer than this are one shape of the fit

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
ACCEPTANCE_EVIDENCE = 32  # rounds of a sampling mode before its estimate is trusted to say "plain"
# Rounds of a sampling mode, engine-wide, before the policy decides for a
# batch with requests of that mode (before, it warms up: :meth:`_warmup`
# cycles K, and the "auto" chooser does not rate its arm by those steps,
# :meth:`AdaptiveController.warming_up`): before them the mode's estimate is
# the prior (ACCEPTANCE_PRIOR), or a few rounds at the first tokens of a
# generation, the hardest to draft. A policy seeded at startup and deciding
# at once priced a lone greedy request's rounds at the prior as losing, so
# its first steps were plain and measured no acceptance
# (benchmarks/probes/policy_warmup_samples.py); made to draft the starting
# K for 8 rounds, all rejected at d1, its greedy estimate read 0.17 and the
# chooser, which measured the policy's arm in those steps, rated it a third
# of plain and never ran it again (the thirty-ninth session's sweep: 61-98
# tokens/s per request at width 1, greedy, against 312-818 after the
# unseeded warm-up).
MODE_PROBE_ROUNDS = ACCEPTANCE_EVIDENCE
# Acceptance calibration: decay per tested draft, and the tested drafts a
# position needs before its own ratio is used.
CALIBRATION_WEIGHT = 0.01
CALIBRATION_MIN_DRAFTS = 48.0


@dataclass
class _Estimate:
    """Conditional acceptance per draft position, exponentially weighted.
    A position this estimate's own rounds never drafted reads as the last
    position they did (the chain's tail is untested, not worse; the
    calibration corrects the optimism); before any own round, a started
    estimate reads as its start."""

    values: np.ndarray
    seen: np.ndarray
    own: np.ndarray | None = None  # rounds of its own per position (seen includes the start's)

    def __post_init__(self) -> None:
        if self.own is None:
            self.own = self.seen.copy()
        self._read: tuple[float, ...] | None = None  # read() until the next update

    @classmethod
    def prior(cls, k: int) -> "_Estimate":
        return cls(np.full(k, ACCEPTANCE_PRIOR), np.zeros(k, dtype=np.int64))

    def copy(self) -> "_Estimate":
        return _Estimate(self.values.copy(), self.seen.copy(), self.own.copy())

    def started_from(self, weight: int) -> "_Estimate":
        """A new estimate starting at this one's values, worth ``weight`` rounds."""
        return _Estimate(self.values.copy(), np.minimum(self.seen, weight), np.zeros_like(self.own))

    def update(self, outcome: np.ndarray, weight: float) -> None:
        n = len(outcome)
        self.seen[:n] += 1
        self.own[:n] += 1
        step = np.maximum(1.0 / self.seen[:n], weight)
        self.values[:n] += step * (outcome - self.values[:n])
        self._read = None

    def read(self) -> tuple[float, ...]:
        if self._read is None:
            self._read = self._tail_filled()
        return self._read

    def _tail_filled(self) -> tuple[float, ...]:
        out = self.values.copy()
        tested = self.own > 0
        for j in range(1, len(out)):
            if not tested[j] and tested[j - 1]:
                tested[j] = True
                out[j] = out[j - 1]
        return tuple(out)


@dataclass
class _Ratio:
    """Measured over predicted time of one kind of step, weighted to recent."""

    value: float = 1.0
    samples: int = 0
    shape: tuple[int, int, int, int] | None = None  # (ticks, rows, tokens, context) of the last step

    def update(self, ratio: float) -> None:
        self.samples += 1
        self.value += max(1.0 / self.samples, GUARD_WEIGHT) * (ratio - self.value)


@dataclass
class _Calibration:
    """Accepted over estimated drafts per position, over every tested draft
    of one sampling mode (decayed sums). A request's estimate is read where
    the policy chose to draft, which is where it was high, and a position
    never tested reads as the last tested one; so the estimates of deeper
    positions run optimistic. Scaling them by this ratio brings them to what
    rounds really accept. A position tested too rarely takes the ratio of
    the nearest shallower one that was."""

    accepted: np.ndarray
    estimated: np.ndarray
    drafts: np.ndarray
    _ratios: np.ndarray | None = None  # ratios() until the next update

    @classmethod
    def empty(cls, k: int) -> "_Calibration":
        return cls(np.zeros(k), np.zeros(k), np.zeros(k))

    def update(self, estimate: np.ndarray, outcome: np.ndarray) -> None:
        n = len(outcome)
        keep = 1.0 - CALIBRATION_WEIGHT
        self.accepted[:n] = keep * self.accepted[:n] + outcome
        self.estimated[:n] = keep * self.estimated[:n] + estimate[:n]
        self.drafts[:n] = keep * self.drafts[:n] + 1.0
        self._ratios = None

    def ratios(self) -> np.ndarray:
        if self._ratios is None:
            self._ratios = self._compute_ratios()
        return self._ratios

    def _compute_ratios(self) -> np.ndarray:
        out = np.ones(len(self.accepted))
        for j in range(len(out)):
            if self.drafts[j] >= CALIBRATION_MIN_DRAFTS and self.estimated[j] > 0:
                out[j] = self.accepted[j] / self.estimated[j]
            elif j:
                out[j] = out[j - 1]
        return out


def _calibrated(estimate: _Estimate, ratios: np.ndarray) -> tuple[float, ...]:
    """An acceptance estimate scaled by its mode's calibration ratios."""
    return tuple(np.minimum(np.asarray(estimate.read()) * ratios, 1.0))


def _barely_measured(state: "_RequestState", sampled: bool) -> bool:
    """A greedy request with fewer than THIN_EVIDENCE_ROUNDS rounds of its own."""
    return not sampled and state.acceptance.own[0] < THIN_EVIDENCE_ROUNDS


def _predict(costs: StepCosts, ticks: int, rows: int, tokens: int, context: int) -> float:
    """Seconds of a step of this shape (``ticks == 0``: plain)."""
    return costs.plain_step(tokens, context) if ticks == 0 else costs.spec_step(ticks, rows, tokens, context)


def width_bucket(width: int) -> int:
    """Widths 1, 2, 3-4, 5-8, 9-16, ...: rates are compared within a bucket."""
    return max(int(width) - 1, 0).bit_length()


GREEDY, MIXED, SAMPLED = 0, 1, 2  # a batch's sampling mix


def sampling_mix(sampled) -> int:
    """The mix of a batch from its rows' sampled? flags (a list or a numpy array)."""
    n, count = len(sampled), int(np.count_nonzero(sampled))
    return SAMPLED if count == n else GREEDY if count == 0 else MIXED


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
    cap_mix: int | None = None  # the sampling mix of the batches the cap was set for
    costs: StepCosts | None = None
    seeded: bool = False  # costs is the startup seed, not yet a fit of timed steps
    plain_streak: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=4096))

    def __post_init__(self) -> None:
        self._requests: dict[str, _RequestState] = {}
        self._engine_acceptance = {mode: _Estimate.prior(self.max_k) for mode in (False, True)}
        self._calibration = {mode: _Calibration.empty(self.max_k) for mode in (False, True)}
        self._plain: deque = deque(maxlen=SAMPLE_WINDOW)  # (tokens, context, seconds)
        self._spec: deque = deque(maxlen=SAMPLE_WINDOW)  # (ticks, spec_rows, tokens, context, seconds)
        # Time between a step's end and the next step's start (scheduler,
        # output handling), by the kind of the step it follows: a round
        # hands back more tokens than a plain step.
        self._gaps: dict[bool, deque] = {False: deque(maxlen=64), True: deque(maxlen=64)}
        self._last_kind: bool | None = None  # speculative? of the last timed step
        self._gaps_added = 0
        self._gap_medians: dict[bool, tuple[int, float]] = {}  # kind -> (gaps added then, median)
        # (key, ticks, seconds, predicted, shape) of the last step, until its gap is known
        self._pending: tuple[tuple[int, int], int, float, float, tuple[int, int, int, int]] | None = None
        self._shapes_seen: set[tuple[int, int, int]] = set()
        self._spec_ticks: set[int] = set()  # draft counts of the round samples
        self._seed: StepCosts | None = None  # the startup seed as timed (seed())
        self._plain_added = 0  # plain samples ever added
        self._seed_calibrated_at = 0  # ... when the seed's intercepts were last calibrated
        self._new_samples = 0
        # (width bucket, sampling mix) -> draft count of the step -> measured / predicted time
        self._ratios: dict[tuple[int, int], dict[int, _Ratio]] = {}
        self._probe_interval = CAP_PROBE_BACKOFF[0]
        self._next_probe = 0
        self._plain_reason: str | None = None  # of the current run of plain decisions
        self._plain_run: tuple[tuple[str, ...], str, dict[str, int]] | None = None  # (requests, reason, skipped)

    # -- measurements -------------------------------------------------------------
    def seed(self, costs: StepCosts) -> None:
        """Step costs to decide with until the engine's own steps are timed
        in enough shapes (:func:`~.policy.seeded_costs`: the model's pieces
        timed at startup): without them the warm-up that cycles K would run
        until the fit has its samples, whatever the workload (after the sweep's
        warm-up a d1 engine had 2 of its 6 plain and 8 of its 12 round
        samples, ``benchmarks/probes/policy_warmup_samples.py``). The
        measured factors correct the seed where it is off; a fit replaces it
        (:meth:`_refit`)."""
        if self.costs is None:
            self.costs, self.seeded, self._seed = costs, True, costs

    def _calibrate_seed(self) -> None:
        """The seed leaves out what every step spends outside the model's
        pieces (input preparation, sampling, the scheduler): that is added
        to both intercepts, as the median of the plain samples' seconds over
        the seed's prediction for them, plus the median gap after a plain
        step. Without it a round costs the seed more plain steps than it
        does: the host work, a large share of a narrow plain step on a CPU,
        is missing from both. The measured factors are re-expressed against
        the calibrated seed."""
        plain = np.array(self._plain, dtype=np.float64).reshape(-1, 3)
        s_p, t_p = self._seed.plain
        host = max(float(np.median(plain[:, 2] - (s_p + t_p * plain[:, 0]))), 0.0) + self._median_gap(False)
        before = self.costs
        self.costs = StepCosts(plain=(s_p + host, t_p), spec=(self._seed.spec[0] + host, *self._seed.spec[1:]),
                               context=self._seed.context)
        self._seed_calibrated_at = self._plain_added
        self._rebase_factors(before)

    def warming_up(self, mix: int) -> bool:
        """Whether the policy's steps for a batch of sampling ``mix`` are its
        warm-up (:meth:`_warmup`, cycling K) rather than decisions: no costs
        yet (no startup seed), or a sampling mode of the batch with fewer
        than :data:`MODE_PROBE_ROUNDS` rounds engine-wide. The "auto"
        chooser does not rate the policy's arm by such steps."""
        modes = (False,) if mix == GREEDY else (True,) if mix == SAMPLED else (False, True)
        return self.costs is None or any(self._engine_acceptance[m].seen[0] < MODE_PROBE_ROUNDS for m in modes)

    def observe_round(self, req_id: str, sampled: bool, num_drafts: int, num_accepted: int) -> None:
        """A verified round: drafts ``1..num_accepted`` accepted, the next (if
        drafted) rejected."""
        tested = min(num_accepted + 1, num_drafts)
        outcome = (np.arange(tested) < num_accepted).astype(np.float64)
        self._engine_acceptance[sampled].update(outcome, ENGINE_WEIGHT)
        state = self._request(req_id, sampled)
        self._calibration[sampled].update(np.asarray(state.acceptance.read()), outcome)
        state.acceptance.update(outcome, REQUEST_WEIGHT)
        if state.probing:
            state.probing = False

    def observe_step(self, ticks: int, spec_rows: int, tokens: int, seconds: float,
                     width: int | None = None, committed: int | None = None,
                     context: int = 0, mix: int = GREEDY) -> None:
        """A timed engine step (``ticks == 0``: plain). The first step of
        each shape is not a sample: it pays one-off work (kernel selection,
        compilation of a new size) that later steps of the shape do not.
        ``context``: the step's rows' lengths, summed. ``width``/
        ``committed``: for a decode-only step, its requests and the tokens
        they committed (the measured-rate guard's input), ``mix`` their
        sampling mix."""
        shape = (ticks, spec_rows, tokens)
        self._last_kind, self._pending = ticks > 0, None
        if shape not in self._shapes_seen:
            self._shapes_seen.add(shape)
            return
        if width and self.costs is not None:
            # The prediction includes the median gap after the step; so does
            # the measurement (observe_gap).
            predicted = _predict(self.costs, ticks, spec_rows, tokens, context)
            self._pending = ((width_bucket(width), mix), ticks, seconds, predicted, (ticks, spec_rows, tokens, context))
        context = int(round(context / CONTEXT_BUCKET)) * CONTEXT_BUCKET
        if ticks == 0:
            self._plain.append((tokens, context, seconds))
            self._plain_added += 1
        else:
            self._spec.append((ticks, spec_rows, tokens, context, seconds))
            self._spec_ticks.add(ticks)
        self._new_samples += 1

    def observe_gap(self, seconds: float | None) -> None:
        """Time between the end of one step and the start of the next; None
        where it may hold idle time (the next step admits new requests: the
        engine may have waited for them), which is no step's cost."""
        if self._last_kind is None:
            return
        if seconds is not None:
            self._gaps[self._last_kind].append(seconds)
            self._gaps_added += 1
        if self._pending is not None:
            key, ticks, step_seconds, predicted, shape = self._pending
            measured = step_seconds + self._median_gap(ticks > 0)
            ratio = self._ratios.setdefault(key, {}).setdefault(ticks, _Ratio())
            ratio.update(measured / max(predicted, 1e-9))
            ratio.shape = shape
            self._pending = None

    def _median_gap(self, speculative: bool) -> float:
        """Median gap after a kind of step (all gaps while the kind has fewer
        than 8: plain steps may be rare); recomputed every
        :data:`GAP_MEDIAN_EVERY` new gaps, not on every step."""
        cached = self._gap_medians.get(speculative)
        if cached is not None and self._gaps_added - cached[0] < GAP_MEDIAN_EVERY:
            return cached[1]
        gaps = self._gaps[speculative]
        if len(gaps) < 8:
            gaps = [g for kind in (False, True) for g in self._gaps[kind]]
        median = float(np.median(gaps)) if len(gaps) else 0.0
        self._gap_medians[speculative] = (self._gaps_added, median)
        return median

    def forget(self, live_req_ids) -> None:
        """Drop the state of requests no longer in the batch."""
        for req_id in set(self._requests) - set(live_req_ids):
            del self._requests[req_id]

    # -- decision -----------------------------------------------------------------
    def plan(self, requests: list[tuple[str, bool, int]], other_tokens: int = 0,
             context: int = 0, remaining: list[int] | None = None) -> tuple[list[int], dict[str, int]]:
        """``K_i`` for ``(req_id, sampled, max_drafts)`` of the next step, and
        request-steps without drafts counted by reason. ``context``: the
        lengths of the step's rows, summed; ``remaining``: per request, the
        tokens it may still commit (its drafts are then priced against the
        batch it would finish in if left behind: :func:`~.policy.later_rates`)."""
        width = len(requests)
        mix = sampling_mix([sampled for _, sampled, _ in requests])
        if self.holds_plain(width, mix):
            return [0] * width, {SKIP_WIDTH_CAP: width}
        self.step += 1
        skipped: dict[str, int] = {}
        if not requests:
            return [], skipped
        if self._new_samples >= REFIT_EVERY or self.costs is None or self.seeded:
            self._refit()  # here, not per sample: plain steps under the width cap fit nothing
        if self.warming_up(mix):
            drafts = self._warmup(requests)
            self._record(width, drafts, "warmup")
            return drafts, skipped
        req_ids = tuple(req_id for req_id, _, _ in requests)
        if self._plain_run is not None and self._plain_run[0] == req_ids and self.step % PLAIN_RECHECK_EVERY:
            # The same requests as the last plain decisions, no round since:
            # plain again, without deciding (exploration and disarming fall
            # on the steps that decide).
            self.plain_streak += 1
            reason, skipped = self._plain_run[1], dict(self._plain_run[2])
            self._record(width, [0] * width, reason)
            return [0] * width, skipped
        self._plain_run = None
        key = (width_bucket(width), mix)
        probes = []
        candidates = []
        calibration = {mode: c.ratios() for mode, c in self._calibration.items()}
        for req_id, sampled, limit in requests:
            state = self._request(req_id, sampled)
            paused = state.paused_until > self.step
            # A paused request's re-probe: drafts at least one (a barely
            # measured greedy one: the starting K); 0: no probe.
            probe = not paused and state.paused_until >= 0 and limit > 0
            probes.append(0 if not probe else self.start_k if _barely_measured(state, sampled) else 1)
            # A request whose pause is over is a full candidate (the policy
            # may give it drafts again); below, it drafts at least one.
            candidates.append(Candidate(_calibrated(state.acceptance, calibration[sampled]), 0 if paused else limit))
        factors, rounds_measured = self._factors(key)
        unproven = any(self._engine_acceptance[sampled].seen[0] < ACCEPTANCE_EVIDENCE for _, sampled, _ in requests)
        later = (None if remaining is None or width < 2
                 else later_rates(candidates, remaining, self.costs, context, float(factors[0])))
        decision = decide(candidates, self.costs, self.max_k, other_tokens, context, factors, SPECULATION_MARGIN,
                          later_rates=later)
        drafts = list(decision.drafts)
        reason = "policy"
        if decision.plain and (self.plain_streak < DISARM_AFTER or self.plain_streak % EXPLORE_EVERY == 0):
            # Whether the plain steps are the measurement's doing: decided
            # again only now and then in a long run of plain decisions (a
            # second decision costs as much as the first).
            uncorrected = decide(candidates, self.costs, self.max_k, other_tokens, context, margin=SPECULATION_MARGIN)
            self._plain_reason = SKIP_MEASURED if not uncorrected.plain else None
        measured_loss = decision.plain and self._plain_reason == SKIP_MEASURED
        if not self.armed:
            # A probe step: if speculation pays again at this width it
            # re-arms; otherwise the step is a one-draft round that measures
            # what a round costs this wide, and the next probe waits twice
            # as long.
            if decision.plain:
                drafts = [min(1, c.max_drafts) for c in candidates]
                self._probe_interval = min(2 * self._probe_interval, CAP_PROBE_BACKOFF[1])
                self._next_probe = self.step + self._probe_interval
                self._record(width, drafts, "explore")
                return drafts, skipped
            self.armed, self.cap, self.cap_mix = True, None, None
        if measured_loss:
            reason = SKIP_MEASURED
        eligible = any(c.max_drafts for c in candidates)
        plain = not any(drafts)
        self.plain_streak = self.plain_streak + 1 if plain and eligible else 0
        limits = [c.max_drafts for c in candidates]
        own = self._measured(key)
        young = any(limits) and (not decision.plain or unproven or not rounds_measured
                                 or (any(k for k in own) and 1 not in own))
        unmeasured = self._unmeasured(key, {0, 1, max(decision.drafts)}) if young else []
        # Disarm only where rounds have been measured at this width and mix
        # or at the neighbour whose factors priced them, and the acceptance
        # that says "plain" rests on rounds, not on the prior: a fit
        # extrapolating to widths with no measured rounds near must not
        # switch speculation off before exploration has measured one.
        # Nor while this width's first measurements are still being made.
        # A lone greedy request sets no cap: greedy requests differ too much
        # (one repeats itself, the next drafts nothing) for one to speak for
        # the next; its plain decisions are cheap runs instead.
        if (self.plain_streak >= DISARM_AFTER and rounds_measured and not unproven and not unmeasured
                and (width > 1 or mix == SAMPLED)
                and self._typical_batch_plain(requests, calibration, factors, other_tokens, context)):
            self.armed, self.cap, self.cap_mix, self.plain_streak = False, width, mix, 0
            self._probe_interval = CAP_PROBE_BACKOFF[0]
            self._next_probe = self.step + self._probe_interval
        if unmeasured and self.step % (EXPLORE_EVERY // 2) == 0:
            # A width and mix seen first: measure plain steps, one-draft
            # rounds and the model's choice before trusting it. Where it
            # wants plain steps, priced with round factors measured at a
            # neighbouring width, they are vLLM's own and need no check
            # (a batch that just grew decodes plainly at once), unless the
            # acceptance is still mostly the prior or only longer rounds
            # were measured here.
            drafts, reason = [min(unmeasured[0], limit) for limit in limits], "explore"
        elif self.step % EXPLORE_EVERY == 0:
            explored = self._explore(drafts, candidates, factors, decision.rate, other_tokens, context)
            if explored is not None:
                drafts, reason = explored, "explore"
        for i, (req_id, sampled, limit) in enumerate(requests):
            state = self._requests[req_id]
            if probes[i]:
                drafts[i] = max(drafts[i], min(probes[i], limit))
                state.paused_until = -1
                state.probing = True
            elif drafts[i] and not state.probing:
                state.backoff = PROBE_BACKOFF[0]  # drafting on its own merits again: a new pause starts short
            elif state.paused_until > self.step:
                skipped[SKIP_LOW_ACCEPTANCE] = skipped.get(SKIP_LOW_ACCEPTANCE, 0) + 1
            elif drafts[i] == 0 and limit > 0 and any(drafts):
                # Others draft but this one is not worth a draft: pause it.
                self._pause(state)
                skipped[SKIP_LOW_ACCEPTANCE] = skipped.get(SKIP_LOW_ACCEPTANCE, 0) + 1
            elif drafts[i] == 0 and limit > 0 and width <= THIN_EVIDENCE_MAX_WIDTH \
                    and _barely_measured(state, sampled):
                # A plain step, and this greedy request's estimate rests on
                # too few rounds to keep it plain: pause it to be re-probed.
                self._pause(state)
                skipped[SKIP_LOW_ACCEPTANCE] = skipped.get(SKIP_LOW_ACCEPTANCE, 0) + 1
            elif drafts[i] == 0 and limit > 0:
                why = SKIP_MEASURED if reason == SKIP_MEASURED else SKIP_COST
                skipped[why] = skipped.get(why, 0) + 1
        if self.plain_streak >= DISARM_AFTER and not any(drafts):
            self._plain_run = (tuple(req_id for req_id, _, _ in requests), reason, dict(skipped))
        self._record(width, drafts, reason)
        return drafts, skipped

    def _typical_batch_plain(self, requests, calibration, factors, other_tokens: int, context: int) -> bool:
        """Whether a batch of this width and mix would decode plainly with
        the engine-wide acceptance: the width cap is a property of the
        width, not of the current requests (whose estimates dip and
        recover; they are paused one by one instead)."""
        typical = [Candidate(_calibrated(self._engine_acceptance[sampled], calibration[sampled]), limit)
                   for _, sampled, limit in requests]
        return decide(typical, self.costs, self.max_k, other_tokens, context, factors, SPECULATION_MARGIN).plain

    def holds_plain(self, width: int, mix: int) -> bool:
        """Whether the next step of ``width`` requests of sampling ``mix`` is
        a plain step under the width cap (counted as one, no decision
        needed); re-arms first if the batch has narrowed to the re-arm
        width or its mix is not the one the cap was set for (greedy and
        sampled requests accept differently: a cap one mix earned says
        nothing of the other)."""
        if not width or self.armed:
            return False
        if width <= rearm_width(self.cap) or mix != self.cap_mix:
            self.armed, self.cap, self.cap_mix = True, None, None
            return False
        if self.step + 1 >= self._next_probe:
            return False  # a probe step: plan() decides it
        self.step += 1
        self._record(width, [0] * width, "width_cap")
        return True

    def _factors(self, key: tuple[int, int]) -> tuple[np.ndarray, bool]:
        """Per draft count ``0..max_k``: measured over predicted step time at
        ``key`` (width bucket, sampling mix), and whether any round factor
        was measured (here or at a neighbour). A draft count measured too
        rarely takes the factor of the nearest measured one of its kind
        (rounds from rounds; plain steps only from plain steps). A kind not
        measured at ``key`` at all is taken from the same width bucket's
        other mixes, then from an adjacent bucket (a batch that just grew
        is priced as its neighbours were, not as the raw fit); else 1.
        Buckets further away are not used: the fit's error changes with
        the width."""
        nearest = sorted((k for k in self._ratios if abs(k[0] - key[0]) <= 1),
                         key=lambda k: (abs(k[0] - key[0]), k[1] != key[1], k))
        measured_at = [self._measured(k) for k in ([key] + [k for k in nearest if k != key])]
        plain = next((m[0] for m in measured_at if 0 in m), 1.0)
        rounds = next(({k: f for k, f in m.items() if k} for m in measured_at if any(k for k in m)), {})
        factors = np.ones(self.max_k + 1)
        factors[0] = plain
        spec = sorted(rounds)
        for k in range(1, self.max_k + 1):
            if spec:
                factors[k] = rounds[min(spec, key=lambda j: (abs(j - k), j))]
        return factors, bool(rounds)

    def time_factors(self, key: tuple[int, int]) -> np.ndarray:
        """Per draft count ``0..max_k``: measured over predicted step time at
        ``key`` (see :meth:`_factors`)."""
        return self._factors(key)[0]

    def measured_factors(self, width: int, mix: int = GREEDY) -> dict[int, float]:
        """The factors measured enough at this width and mix, by draft count."""
        return self._measured((width_bucket(width), mix))

    def _unmeasured(self, key: tuple[int, int], classes: set[int]) -> list[int]:
        """Of ``classes`` (draft counts), those not yet measured enough at
        ``key``, fewest samples first."""
        ratios = self._ratios.get(key, {})
        samples = {k: ratios[k].samples if k in ratios else 0 for k in classes}
        return sorted((k for k, n in samples.items() if n < GUARD_MIN_SAMPLES), key=lambda k: (samples[k], k))

    def _measured(self, key: tuple[int, int]) -> dict[int, float]:
        ratios = self._ratios.get(key, {})
        return {k: r.value for k, r in ratios.items() if r.samples >= GUARD_MIN_SAMPLES}

    # -- internals ----------------------------------------------------------------
    def _request(self, req_id: str, sampled: bool) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            # Started from the engine-wide estimate, worth a few rounds only:
            # requests differ (one repeats itself and accepts everything, the
            # next does not), and the engine's sample count would make this
            # one's own rounds move its estimate at the slow weight.
            state = _RequestState(self._engine_acceptance[sampled].started_from(PRIOR_ROUNDS[sampled]))
            self._requests[req_id] = state
        return state

    def _pause(self, state: _RequestState) -> None:
        state.paused_until = self.step + state.backoff
        state.backoff = min(state.backoff * 2, PROBE_BACKOFF[1])

    def _warmup(self, requests) -> list[int]:
        """Before the cost model or the batch's acceptance exists: the
        configured K, with every fourth step plain and the K of the others
        cycling (to the largest, which measures the deep draft positions),
        so that the fit sees both kinds of step in several shapes."""
        phase = self.step % 4
        if phase == 0:
            return [0] * len(requests)
        k = (self.start_k, 1, self.max_k)[phase - 1]
        return [min(k, limit) for _, _, limit in requests]

    def _explore(self, drafts: list[int], candidates: list[Candidate], factors: np.ndarray, rate: float,
                 other_tokens: int, context: int) -> list[int] | None:
        """A neighbour of the decision: one draft more, one fewer, or plain,
        in turn; None (no exploration this turn) where the corrected model
        expects that neighbour to deliver well below the decision, except
        one turn in :data:`EXPLORE_POOR_EVERY`."""
        exploration = self.step // EXPLORE_EVERY
        turn = exploration % 3
        limits = [c.max_drafts for c in candidates]
        if turn == 2 or not any(limits):
            explored = [0] * len(drafts)
        elif not any(drafts) and turn == 0:
            # From a plain decision: the model's best round (one draft would
            # only ever test the first position again).
            best = decide(candidates, self.costs, self.max_k, other_tokens, context, factors, margin=-1.0)
            explored = list(best.drafts) if any(best.drafts) else [min(1, limit) for limit in limits]
        else:
            k = max(drafts) if any(drafts) else 0
            k = min(self.max_k, k + 1) if turn == 0 else max(1, k - 1)
            explored = [min(k, limit) for limit in limits]
        expected = expected_rate(candidates, explored, self.costs, other_tokens, context, factors)
        if expected < EXPLORE_POOR_SHARE * rate and (exploration // 3) % EXPLORE_POOR_EVERY != 0:
            return None
        return explored

    def _refit(self) -> None:
        self._new_samples = 0
        if (self.seeded and len(self._plain) >= WARMUP_PLAIN_SAMPLES
                and self._plain_added - self._seed_calibrated_at >= GUARD_MIN_SAMPLES):
            self._calibrate_seed()
        # Checked before any array is built: until a fit is possible this
        # runs every step.
        if len(self._plain) < WARMUP_PLAIN_SAMPLES or len(self._spec) < WARMUP_SPEC_SAMPLES:
            return
        if self.seeded and len(self._spec_ticks) < min(SEED_REPLACED_AFTER_TICK_COUNTS, self.max_k):
            return
        plain = np.array(self._plain, dtype=np.float64).reshape(-1, 3)
        spec = np.array(self._spec, dtype=np.float64).reshape(-1, 5)
        shapes, seconds, counts = shape_medians(spec)
        ticks, rows, tokens, context = shapes.T
        spec_coef = fit_linear(np.column_stack([np.ones(len(shapes)), ticks, ticks * rows, tokens, context]),
                               seconds, counts)
        shapes, seconds, counts = shape_medians(plain)
        if len(shapes) >= 2:
            plain_coef = fit_linear(np.column_stack([np.ones(len(shapes)), shapes]), seconds, counts)
        elif spec_coef is not None:
            # One plain shape only (decode steps of one width, no prefill
            # seen): its per-token and per-context costs are the rounds'.
            per_token, per_context = spec_coef[3], spec_coef[4]
            plain_coef = np.array([max(seconds[0] - per_token * shapes[0, 0] - per_context * shapes[0, 1], 0.0),
                                   per_token, per_context])
        else:
            plain_coef = None
        if plain_coef is None or spec_coef is None:
            return
        plain_coef[0] += self._median_gap(False)
        spec_coef[0] += self._median_gap(True)
        before, self.costs = self.costs, StepCosts(plain=(float(plain_coef[0]), float(plain_coef[1])),
                                                   spec=tuple(float(c) for c in spec_coef[:4]),
                                                   context=(float(plain_coef[2]), float(spec_coef[4])))
        if self.seeded:
            self.seeded = False
            self._rebase_factors(before)

    def _rebase_factors(self, before: StepCosts) -> None:
        """The measured factors are measured over predicted time, predicted
        by ``before`` (the seed, which leaves out the step's host work and
        attention): re-expressed over the new fit's prediction of each
        factor's last step, they keep what was measured without the
        seed's error (which the fit no longer has)."""
        for ratios in self._ratios.values():
            for ratio in ratios.values():
                if ratio.shape is None:
                    continue
                old, new = (_predict(costs, *ratio.shape) for costs in (before, self.costs))
                ratio.value *= old / max(new, 1e-9)

    def _record(self, width: int, drafts: list[int], reason: str) -> None:
        self.history.append(StepRecord(self.step, width, tuple(drafts), reason))
