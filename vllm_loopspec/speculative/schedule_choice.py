"""``"schedule": "auto"``: each decode step is one of three arms, whichever
has delivered the most committed tokens per second at this batch width and
sampling mix:

* ``plain``: every request decodes one token (vLLM's own step);
* ``policy``: the adaptive policy's step (:mod:`.adaptive`: a round of its
  ``K_i``, or a plain step where it prices rounds as losing);
* ``pipelined``: a pipelined step of every slot a request may have
  (:mod:`.pipeline`).

Why measured and not priced: the policy prices rounds from a fit of round
steps, and its choices are only as good as that fit where the batch runs; a
pipelined step's cost depends on its restarts (how often a first proposal is
replaced at verification), which depends on the requests in flight. Every
arm delivers committed tokens, so the rates compare directly (a
speculative step charged for the lag it adds to its batch, each token of it
at one row's cost, :mod:`.batch_drain`: rounds advance rows by their own
acceptance and may leave one to decode alone); each step is
timed from its start to the next step's start (scheduler and output
handling included). The plain arm makes "never slower than native" a
measured floor: where the policy's rounds lose to plain steps, the steps are
plain.

Per key — width bucket (powers of two), sampling mix and context bucket
(the rows' mean length, powers of two from :data:`CONTEXT_UNIT` tokens: a
step over long prompts is slower whatever its arm, and arms measured at
different lengths must not be compared) — the chooser keeps, for each arm,
the median rate (committed tokens per request over seconds: a bucket spans
widths, and a batch narrows as its requests finish) of its last
:data:`RATE_WINDOW` steps: a median, because a step that met a new shape
(kernel selection, compilation) costs many ordinary ones. The engine feeds only steps that
represent their arm (not an arm's first step at a width, not the policy's warm-up,
which cycles K to fit its cost model), and the chooser drops a step that
follows a step of another arm (:meth:`ScheduleChooser.observe`'s
``after``): the first plain step after a pipelined one runs 15-20% slower
(``benchmarks/probes/arm_rates_forced.py``: 5.5 against 4.7 ms at width 4,
long prompts, T=0.8; the model forward itself is slower, and the excess
fades over three steps there; a later trace at short T=0.8 c4 saw plain's
fade last six), so plain steps measured between speculative ones
made a pipeline that loses 10% to plain steps look 10% faster. So the
steps right after a switch (:func:`switch_steps`: six for plain,
whose steps after a speculative one fade slowest, two for the others) are
no samples: short arms are measured in streaks, and a short arm's try
lasts that many steps more than its sample; a long step (:data:`LONG_STEP` times the
shortest arm's) counts after a switch (a pipelined step after a plain one
takes as long as one after a pipelined one: the same probe). A step is
observed when the next one starts, so a long arm's step in flight is not
followed by another before it is seen (one may show it losing).

An arm with no steps at a key borrows the last few steps
(:data:`BORROWED_STEPS`) of an adjacent context bucket (same width bucket
and mix) where it was measured, and counts as measured; a speculative arm's
borrowed steps are scaled by plain's rate and step time here over there,
and follow plain's until the arm has steps of its own here (what carries
across a context bucket is a rate relative to plain steps); the arms
still unmeasured are measured :data:`MIN_SAMPLES` times (fewest samples first, a width bucket new to the
chooser starting with its neighbour's winner; an arm whose first sample
clearly lost, :data:`CLEAR_LOSS`, once; an arm of long steps,
:data:`LONG_STEP`, half as often, and once where its step loses as the
arm lost at the next narrower width bucket). Then the chooser takes the arm
with the best rate, a speculative arm having to beat the plain one by
:data:`SPECULATION_MARGIN` (vLLM's plain step is the safer choice within
the rates' noise), and, where its steps are long, only once the two were
compared in pairs (else plain is measured beside it first, once:
:data:`PLAIN_DOUBT_STEPS`; plain's samples at a key are often unsettled or
stale; and where its lead is narrow, :data:`NARROW_LEAD`: its own rate rests
on few steps), and tries each other arm in turn one step in an interval
that doubles while it keeps losing (:data:`RETRY_BACKOFF`), and not before
the winner has run long enough for
the try to cost at most its share of :data:`RETRY_TIME_SHARE` of the
time (each loser has a budget of its own: an expensive loser waiting for its
budget does not hold back a cheap one's try; a long loser close to the
winner has a larger one, :data:`CLOSE_LOSER_BOOST`).

Rates measured at different times do not compare well: this machine's
speed drifts by tens of percent over seconds, and a loser's window holds
its tries, spread over minutes, while the winner's holds its last steps. So
a sample and the last sample of another arm a few steps before it
(:data:`PAIR_GAP`) make a pair, whose ratio of rates sees one speed; where
an arm has :data:`MIN_PAIRS` pairs with the leader by rate (of the arms
rated from the key's own steps, not borrowed ones), it is rated by
their median ratio to the leader (:func:`_best`). A try is then compared
with the winner's steps around it. Pairs hold only while the workload
does: an arm whose rate moved by :data:`PAIRS_STALE` since its last pair
with another drops their pairs (a greedy request's text turning hard cuts
the policy arm's rate 3x), and rate an arm only where they agree with its
own rate within the machine's drift (:data:`PAIRS_AGREE`). A plain
winner's verdict says how many steps no try can be due in
(:attr:`ScheduleChoice.hold`): the engine runs them plain without asking,
while its batch stays the same, and credits them (:meth:`credit_held`),
timed as one sample of the plain arm: a plain verdict is checked by the
plain steps it holds, not only by the one chosen step between holds.

A pure object, tested without an engine (``tests/test_schedule_choice.py``).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field

from vllm_loopspec.speculative.adaptive import width_bucket

PLAIN, POLICY, PIPELINED = "plain", "policy", "pipelined"
CONTEXT_UNIT = 64  # tokens: mean row lengths below this share a context bucket
ARMS = (PLAIN, POLICY, PIPELINED)
# The ``after`` of a step that follows one the chooser did not choose (a
# prefill, a step with arrivals): a switch too. The first plain step after a
# batch's prefill took 3.58 ms against 2.9-3.0 for the next ones (width 4,
# short prompts, T=0.8: arm_rates_forced_short_c4_t08.txt).
UNCHOSEN = "unchosen"


def arms_for_depths(depths) -> tuple[str, ...]:
    """The arms of an engine whose steps may draft at each of ``depths``:
    plain, then the policy's and the pipelined arm at each depth, named
    ``policy@d`` and ``pipelined@d`` (one depth: :data:`ARMS`)."""
    depths = list(depths)
    if len(depths) == 1:
        return ARMS
    return (PLAIN, *(f"{kind}@{d}" for kind in (POLICY, PIPELINED) for d in depths))


def switch_steps(arm: str) -> int:
    """Steps of ``arm`` right after another arm's that are no samples of it
    (:data:`PLAIN_SWITCH_STEPS` for plain, :data:`SWITCH_STEPS` otherwise)."""
    return PLAIN_SWITCH_STEPS if arm == PLAIN else SWITCH_STEPS


def arm_kind(arm: str) -> str:
    """PLAIN, POLICY or PIPELINED, whatever the arm's depth."""
    return arm.partition("@")[0]


def arm_depth(arm: str, default: int) -> int:
    """The draft depth an arm named for one (``policy@2``) runs at, else ``default``."""
    _, at, depth = arm.partition("@")
    return int(depth) if at else default

MIN_SAMPLES = 4  # steps of each arm at a key before the rates decide
# An arm whose first step at a key delivered under this share of another
# arm's measured rate, and took more than twice that arm's step, is measured
# enough: an expensive clear loser (a pipelined step of a wide sampled batch
# costs many plain steps) is left to the tries.
CLEAR_LOSS = 0.7
# An arm whose steps take more than this many times another arm's is
# measured after half the steps: a long step averages over many ticks, and
# each costs as much as several short ones (one is not enough: on this
# shared machine a step now and then takes three times its usual time).
LONG_STEP = 4
# An arm of long steps that rates below this share of plain's at an adjacent
# context bucket, after any number of its steps there, counts as measured at a
# bucket where it has none (it borrows them): it is left to the tries, whose
# time share is bounded, instead of being measured again at each bucket that
# a batch's lengths cross. In the sweep's wide sampled cells a pipelined step
# costs some twenty plain ones, and it was measured again at each bucket,
# spread over the repeats (benchmarks/results/findings.md, twenty-sixth
# session: level overall in an A/B, 1-5% better in the widest cells). Not a clear loss
# (:data:`CLEAR_LOSS`), which would count at its own key: a close loser stays
# measured where it is.
LONG_LOSER_BORROW = 0.9
# A speculative arm whose step costs at least this many plain steps wins a
# key over plain only once the two were compared there in MIN_PAIRS pairs
# (:data:`PAIR_GAP`: measured at one moment), or plain was measured beside
# it once: a streak of plain steps right after the leader's, which costs
# less than one of its steps. Plain's samples at a key are often slow and
# stale. In the burst (width 17, mixed) the warm-up left plain samples of
# 7.3-11.0 ms a step, and a plain streak after a prefill ran 11.0, 8.4,
# ~7.0, then 6.8 ms; pipelined steps of ~110 ms rated 150-166 tokens/s per
# request won on them (leads of 1.2x-1.65x) and carried the burst in most
# repeats, where plain, measured again later, ran at 5.6-6.3 ms (160-177).
# A plain try under such a winner is due only every dozen or more of its
# steps (RETRY_TIME_SHARE, RETRY_BACKOFF), more than a burst has at a key
# (benchmarks/results/findings.md, thirty-sixth and thirty-seventh
# sessions). Not for shorter leaders: at width 1 a pipelined step costs a
# few plain ones, a streak several of its steps, and with every narrow
# lead doubted, or doubted again whenever pairs went stale, greedy c1 lost
# 5-17% in an A/B (chooser_ab_plain_doubt_first.json).
PLAIN_DOUBT_STEPS = 8
# Plain samples at a key after which its own rate decides without pairs
# (pairs need the leader's step observed just before: a bound, should it not be).
PLAIN_DOUBT_SAMPLES = 16
# A speculative arm of long steps (:data:`LONG_STEP` plain ones) whose own
# rate leads plain's by less than this factor wins over plain only once the
# two were compared in MIN_PAIRS pairs, however many samples plain has: its
# rate rests on two or three steps, each off by the machine's drift
# (0.77-1.34x, :data:`PAIR_GAP`), while plain's has many. At short T=0.8
# c4, d2, a pipeline rated from two own steps at 5-8% over plain's 29 won
# context buckets 1-2 where its trials ran 0.84-0.91x native and its pairs
# with plain said 0.94x (benchmarks/results/findings.md, forty-sixth
# session). Plain is measured beside it once, as for PLAIN_DOUBT_STEPS;
# where that streak makes too few pairs, plain keeps the key and the arm's
# tries (one pair each) make the rest.
NARROW_LEAD = 1.15
# A short arm's first this many steps after a step of another arm (or one the
# chooser did not choose, :data:`UNCHOSEN`) are no samples. Plain steps at
# width 4, T=0.8: long prompts, 4.66 ms in a run of them; after a pipelined
# step the first 5.52 ms, the second and third 4.96 (arm_rates_forced.json).
# Short prompts, 3.0 ms in a run; after a pipelined step 3.51, 3.14, 3.03,
# 2.95 (arm_rates_forced_short_c4_t08.txt). With only the first dropped, a
# plain try's sample (its second step) rated plain some 5% low, and a
# pipeline level with plain steps won by the margin: at short T=0.8 c4 it
# rated 365-380 tokens/s per request against plain's 328-356, ran 40-90% of
# the trials' time, at 0.90-0.95x the native trial beside it
# (auto_cost_split_sampled_wide_d2_perstep.json). Two, not three: each
# dropped step lengthens every short arm's measuring streak and try
# (chooser_ab_one_switch_step*.json, thirty-third session).
SWITCH_STEPS = 2
# The plain arm's: its steps right after a speculative one fade slowly. An
# auto d2 engine at short T=0.8 c4, its plain steps by steps since its last
# speculative one: 3.67, 3.37, 3.24, 3.11, 3.08, 3.08 ms, then 2.94-3.13 (3.01
# over 288 settled steps; chooser_samples_trace_d2_c4_t08_short_fortieth.txt).
# Dropping two, a plain try's sample read plain ~8% slow, and pipelined steps
# ~5% slower than settled plain ones won sampled c4 keys by the margin
# (benchmarks/results/findings.md, fortieth session). A plain try is then
# this many steps and one more: plain steps are the cheap ones, and the try
# budget (RETRY_TIME_SHARE) counts them all.
PLAIN_SWITCH_STEPS = 6
RATE_WINDOW = 8  # an arm's rate: the median of its last this many steps at a key
BORROWED_STEPS = 3  # steps an arm new to a key takes from an adjacent key's
# A speculative arm must beat the plain one by this share.
SPECULATION_MARGIN = 0.03
# Steps at a key between tries of a losing arm, first and longest: a
# workload that changed shows within a few tries.
RETRY_BACKOFF = (8, 64)
# And the losing arms' tries take at most this share of the time, split
# evenly between them: a pipelined step of a wide sampled batch costs as many
# as twenty plain steps. (The full share per arm tried the policy's losing
# rounds three times as often in the sampled cells: 0.92-0.97x paired at d2,
# chooser_ab_one_try_budget_per_arm_share.json.) A budget per arm: with one
# for both losers, taken in turn, a pipelined try due only every 700 steps
# held back the plain arm's tries, so a policy arm that decided plain steps
# and had rated 14% above plain by noise ran 380 steps without a plain step
# to pair it with, at 0.93x native (short T=0.8 c16, d2: findings,
# thirty-first session).
RETRY_TIME_SHARE = 0.03
# A long loser's share, where it is close: a try loses the winner's rate
# times its time only by the loser's shortfall, and a long arm is rated
# from two or three steps, each off by the machine's drift (0.77-1.34x,
# :data:`PAIR_GAP`). A loser short of the winner by this share or more
# takes its share of RETRY_TIME_SHARE; a closer one as many times more as
# keep its tries' loss the same, up to CLOSE_LOSER_BOOST times. Under a
# plain winner at width 16, a pipelined step costs some fifteen plain
# ones, and with the plain share its try was due every ~1000 plain steps:
# at long greedy c16, d2, a first pipelined measurement that lost to plain
# held the key plain for seven repeats of the sweep, at 0.83-1.01x native,
# where the run before ran rounds and pipelined steps at 0.96-1.19x
# (benchmarks/results/findings.md, forty-fifth session). Not for short tries (a few steps of a cheap arm),
# whose settling steps slow the winner's next steps beyond their own time.
CLOSE_LOSER_SHORTFALL = 0.3
CLOSE_LOSER_BOOST = 4.0
# At most this many steps the plain arm is chosen for at once, for a batch
# that does not change (:attr:`ScheduleChoice.hold`): the context grows a
# token a step, and a verdict is kept no further than this from where it was made.
HOLD_STEPS = 32
# Paired comparisons: a sample of one arm and the last sample of another at
# the same width bucket and mix, at most this many samples apart (the
# steps after a switch, no samples, do not count; a held span counts its
# steps, :meth:`ScheduleChooser.credit_held`), are a pair; their rates'
# ratio is free of the machine's speed, which drifts by tens of percent
# over seconds (``probes/adjacent.py``: two identical engines' trials
# differ by 0.84-1.17x when adjacent, 0.77-1.34x nineteen trials apart),
# while the two arms' windows are measured at different times (the
# winner's now, a loser's over its spaced tries).
PAIR_GAP = 3
PAIR_WINDOW = 8  # an arm pair's ratio: the median of its last this many pairs
MIN_PAIRS = 3  # pairs before they overrule the rates
# An arm whose rate moved by this factor since its last pair with another
# arm (more than the machine's drift, 0.77-1.34x) drops their pairs, and the
# rates decide until new pairs are made: the workload at the key changed.
# The key does not see acceptance, and a greedy request's text turning hard
# moves the policy arm's rate 3x (width 1, d1: 1000 against 350 tokens/s per
# request); pairs made on easy text kept it "faster" than the pipeline for
# 30 steps at a third of its old rate, until a pipelined try was due
# (``benchmarks/results/findings.md``, twenty-ninth and thirtieth sessions).
PAIRS_STALE = 2.0
# Pairs rate an arm only while that rating agrees with the arm's own rate
# (its window) within this factor: the full span of the machine's drift
# between steps measured apart (0.77-1.34x, above). A rating further off is pairs and an
# anchor from two regimes: the median of pairs made on easy and on hard
# text, or pairs made now times a leader's window still full of its steps
# on the previous prompts. Traced at short greedy c1, d1
# (``sweep_replay_trace_d1_c1_fortyfourth.txt``): a policy arm at its own
# 263-395 tokens/s (its rounds declined on hard text) rated 820 by its
# pairs with the pipeline (732) and ran 45 steps at plain's speed; plain at
# its own 359 rated 975 by pairs with a policy window (965) from the last
# prompt, and held 32 steps. PAIRS_STALE cannot see either: the arm's rate
# moved little since its last pair.
PAIRS_AGREE = 1.75
# A speculative step's lag (:mod:`.batch_drain`) is charged as the mean of
# its arm's last RATE_WINDOW charges at the key, each the seconds its added
# lag costs later over the step's own: lag comes in lumps (a row that
# rejects early in one round of eight), which a median of steps would not
# see. A step that narrowed the spread takes back at most this share.
LAG_CREDIT = 0.5


@dataclass
class _ArmRate:
    recent: deque = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))  # (tokens/s/request, seconds) per step
    samples: int = 0
    own: int = 0  # of them, steps of this key (not borrowed)
    borrowed: bool = False  # started from an adjacent key's steps: measured enough to decide
    rate: float = 0.0  # median tokens/s per request of the recent steps
    step_seconds: float = 0.0  # their median seconds

    def update(self, tokens: float, seconds: float, steps: int = 1, replace_borrowed: bool = False) -> None:
        """``steps`` steps that committed ``tokens`` per request in ``seconds``;
        ``replace_borrowed``: the first of the key's own replaces the
        borrowed ones (see :meth:`ScheduleChooser._update`)."""
        if replace_borrowed and self.borrowed and not self.own:
            self.recent.clear()
            self.samples = 0
        self.recent.append((tokens / seconds, seconds / steps))
        self.samples += 1
        self.own += 1
        self._summarise()

    def borrow(self, other: "_ArmRate", rate_scale: float = 1.0, time_scale: float = 1.0) -> None:
        """Start from ``other``'s last :data:`BORROWED_STEPS` steps (an
        adjacent key's, measured there), their rates and seconds scaled
        (see :meth:`ScheduleChooser._fill_from_neighbours`): few, so that
        this key's own steps outweigh them soon (an arm's rate changes with
        the context)."""
        self.recent.extend((r * rate_scale, s * time_scale) for r, s in list(other.recent)[-BORROWED_STEPS:])
        self.samples = len(self.recent)
        self.borrowed = True
        self._summarise()

    def rescale(self, rate_scale: float, time_scale: float) -> None:
        """Scale borrowed steps, while the arm has none of its own here."""
        if self.own or not self.recent:
            return
        self.recent = deque(((r * rate_scale, s * time_scale) for r, s in self.recent), maxlen=RATE_WINDOW)
        self._summarise()

    def _summarise(self) -> None:
        # Read several times a step, written once: summarised on write.
        self.rate = statistics.median(r for r, _ in self.recent)
        self.step_seconds = statistics.median(s for _, s in self.recent)


@dataclass
class _Key:
    arms: dict[str, _ArmRate]  # per arm, in the chooser's order
    # (arm, other) -> log(rate of arm / rate of other) of recent pairs; both orders kept.
    pairs: dict[tuple[str, str], deque] = field(default_factory=dict)
    steps: int = 0
    retry_interval: int = RETRY_BACKOFF[0]
    next_retry: int | None = None  # set when the rates first decide
    # Per arm: steps of a winning arm since the arm's last try (its try
    # budget, :data:`RETRY_TIME_SHARE`).
    since_try: dict[str, int] = field(default_factory=dict)
    retries: int = 0  # where the tries' rotation over the losing arms stands
    last_winner: str | None = None
    trying: str | None = None  # a short arm whose try has steps to come
    try_left: int = 0  # and how many
    # (arm, other) -> the arm's rate when their last pair was made (PAIRS_STALE).
    paired_rate: dict[tuple[str, str], float] = field(default_factory=dict)
    doubted: set = field(default_factory=set)  # winners plain was measured beside (PLAIN_DOUBT_STEPS)
    doubting: str | None = None  # the winner of a plain streak under way
    doubt_from: int = 0  # plain's own samples when that streak began
    lag_charges: dict = field(default_factory=dict)  # per speculative arm: its last steps' lag charges (LAG_CREDIT)


@dataclass
class ScheduleChoice:
    """The arm of the next step of a batch, and why."""

    arm: str  # PLAIN | POLICY | PIPELINED, or one of these at a depth (arms_for_depths)
    reason: str  # "measure" | "faster" | "retry"
    # The winning plain arm: the steps after this one that no try can be
    # due in. The engine may run them plain without asking while its batch
    # stays the same, then :meth:`ScheduleChooser.credit_held` counts them:
    # a decision every step costs a few percent of a narrow plain step.
    hold: int = field(default=0, compare=False)

    @property
    def pipelined(self) -> bool:
        return arm_kind(self.arm) == PIPELINED


class ScheduleChooser:
    def __init__(self, arms: tuple[str, ...] = ARMS) -> None:
        self.arms = arms  # PLAIN first (arms_for_depths)
        self._keys: dict[tuple[int, int, int], _Key] = {}  # (width bucket, mix, context bucket)
        self.decisions: dict[tuple[str, str], int] = {}  # (arm, reason) -> steps
        self.switch_steps = 0  # steps not sampled: they followed a step of another arm
        # The arm of the last observed step, and how many of its steps in a
        # row came before that one (SWITCH_STEPS).
        self._run: tuple[str | None, int] = (None, 0)
        self._last_arm: str | None = None  # the arm of the last choice, at any key
        self._last_seconds: dict[str, float] = {}  # per arm: its last observed step, at any key
        self._last_key: _Key | None = None  # the key of the last choice
        self._last_where: tuple[int, int, int] = (0, 0, 0)  # and where it is
        self._clock = 0  # samples observed, at any key
        # (width bucket, mix) -> arm -> (clock, rate, context bucket)
        self._last_sample: dict[tuple[int, int], dict[str, tuple[int, float, int]]] = {}

    def choose(self, width: int, mix: int, context: int = 0, in_flight: str | None = None) -> ScheduleChoice:
        """The arm of the next step of ``width`` decoding requests of
        sampling ``mix`` (see :func:`~.adaptive.sampling_mix`) and mean
        length ``context``; ``in_flight``: the arm of the step that ran
        last if it is still to be observed."""
        where = _where(width, mix, context)
        key = self._last_key = self._key(where)
        self._last_where = where
        key.steps += 1
        choice = self._choose(key, where, in_flight)
        self.decisions[(choice.arm, choice.reason)] = self.decisions.get((choice.arm, choice.reason), 0) + 1
        self._last_arm = choice.arm
        return choice

    def _choose(self, key: _Key, where: tuple[int, int, int], in_flight: str | None) -> ScheduleChoice:
        unmeasured = [arm for arm in self.arms if not _measured(key, arm)]
        if unmeasured:
            self._fill_from_neighbours(key, where)  # borrowing only adds evidence: measured arms stay measured
            unmeasured = [arm for arm in unmeasured
                          if not _measured(key, arm) and not self._loser_as_at_narrower_width(key, where, arm)]
        if unmeasured:
            # A long arm's step still in flight (observed at the next
            # step's start) is not followed by another: it may be all it
            # takes to see the arm lose, and a pipelined step of a 17-wide
            # batch moves the batch's context by 17 tokens, so the next may
            # be at a new key.
            waiting = in_flight if in_flight in unmeasured and self._long(in_flight) else None
            open_arms = [arm for arm in unmeasured if arm != waiting]
            if not open_arms:
                # Meanwhile the best measured arm here, else a plain step.
                measured = [arm for arm in self.arms if arm != waiting and key.arms[arm].samples]
                return ScheduleChoice(_best(key, measured) if measured else PLAIN, "measure")
            neighbour = self._neighbour_winner(where)
            if neighbour in open_arms and all(key.arms[arm].samples == 0 for arm in self.arms if arm != neighbour):
                return ScheduleChoice(neighbour, "measure")  # the neighbour's winner first
            if self._last_arm in open_arms and not self._long(self._last_arm):
                # A streak: the step after a switch is no sample. Not of
                # long steps, which count after a switch.
                return ScheduleChoice(self._last_arm, "measure")
            # The policy first: its warm-up (before its cost model exists)
            # feeds no samples, and must run before its steps can count.
            fewest = min(open_arms, key=lambda arm: (key.arms[arm].samples, arm_kind(arm) != POLICY))
            return ScheduleChoice(fewest, "measure")
        if key.trying is not None:
            arm = key.trying
            key.try_left -= 1
            if not key.try_left:
                key.trying = None
            return ScheduleChoice(arm, "retry")  # the try's settling steps, then its sampled step
        winner = _winner(key)
        if winner == PLAIN:
            key.doubting = None
        elif self._doubt_plain(key, where, winner, in_flight):
            return ScheduleChoice(PLAIN, "measure")
        elif winner in key.doubted and _unpaired_narrow_lead(key, winner):
            # Plain's streak beside it made too few pairs (a third arm's
            # sample came between): the tries make them, one a try.
            winner = PLAIN
        if key.last_winner is not None and winner != key.last_winner:
            key.retry_interval = RETRY_BACKOFF[0]  # the verdict changed: the losers are close, try them soon
        key.last_winner = winner
        if key.next_retry is None:
            key.next_retry = key.steps + key.retry_interval
        losers = [arm for arm in self.arms if arm != winner]
        won = key.arms[winner]
        if key.steps >= key.next_retry:
            # The next loser in turn whose try its budget affords: an
            # expensive loser (a pipelined step of a wide sampled batch, 100
            # ms) waits for its budget without holding back a cheap one's
            # try (two plain steps), whose pairs with the winner keep a
            # winner that is level with plain honest.
            for offset in range(len(losers)):
                loser = losers[(key.retries + offset) % len(losers)]
                if key.since_try[loser] >= _try_budget_steps(key, winner, loser, len(losers)):
                    key.next_retry = key.steps + key.retry_interval
                    key.retry_interval = min(2 * key.retry_interval, RETRY_BACKOFF[1])
                    key.since_try[loser] = 0
                    key.retries += offset + 1
                    key.trying = loser if _short_try(key, winner, loser) else None
                    key.try_left = switch_steps(loser) if key.trying else 0
                    return ScheduleChoice(loser, "retry")
        for arm in self.arms:
            key.since_try[arm] += 1
        if winner != PLAIN or not won.step_seconds:
            return ScheduleChoice(winner, "faster")
        # Steps until a choice could try a loser: both conditions above,
        # with the held steps counted as winning ones.
        until_due = max(key.next_retry - key.steps - 1,
                        min(_try_budget_steps(key, winner, loser, len(losers)) - key.since_try[loser]
                            for loser in losers), 0)
        return ScheduleChoice(winner, "faster", hold=int(min(until_due, HOLD_STEPS)))

    def credit_held(self, steps: int, timed: int = 0, seconds: float = 0.0) -> None:
        """``steps`` plain steps ran on the last choice's hold (at its key);
        ``timed`` of them, in a row, took ``seconds`` (start to next start).
        Those are one sample of the plain arm: without it a plain verdict
        would rest on the chosen steps between holds alone (one in
        :data:`HOLD_STEPS`), and on the samples it started from, perhaps an
        adjacent context's (:meth:`_fill_from_neighbours`). Not where the
        hold began inside a switch's settling steps (:data:`PLAIN_SWITCH_STEPS`):
        timed as one, the span carries their slowness, as a step does."""
        key = self._last_key
        if key is None or steps <= 0:
            return
        key.steps += steps
        # The span is one sample, at its end: its steps are steps on the
        # pairs' clock (PAIR_GAP), so that it pairs only with a sample a few
        # steps before that end, not with one taken before a hold of up to
        # HOLD_STEPS steps (a pair is one moment of the machine's speed).
        self._clock += steps - 1
        run = self._run[1] if self._run[0] == PLAIN else 0
        settled = self._run[0] == PLAIN and run + 1 >= PLAIN_SWITCH_STEPS
        self._run = (PLAIN, run + steps)
        for arm in self.arms:
            key.since_try[arm] += steps
        self.decisions[(PLAIN, "faster")] = self.decisions.get((PLAIN, "faster"), 0) + steps
        if timed > 0 and seconds > 0 and settled:
            self._update(key, PLAIN, timed, seconds, steps=timed)
            self._pair(key, self._last_where, PLAIN, timed / seconds)

    def skip(self, arm: str, after: str | None) -> None:
        """A step of ``arm`` that ran after one of ``after`` (as in
        :meth:`observe`) and is no sample (the engine does not time an arm's
        first step at a width, nor the policy's warm-up): it still counts in
        the run of ``arm`` that its next steps settle in (:func:`switch_steps`)."""
        self._run_before(arm, after)

    def observe(self, width: int, mix: int, arm: str, committed: int, seconds: float, context: int = 0,
                after: str | None = None, declined: bool = False, lag: float = 0.0) -> None:
        """A decode step of ``width`` requests of mean length ``context``:
        its arm, the tokens it committed and the seconds from its start to
        the next step's start; ``after``: the arm of the step before it
        (:data:`UNCHOSEN`: a step the chooser did not choose; None: not
        known, the step counts as one after a settled run of its arm);
        ``lag``: tokens of lag it added to its batch
        (:func:`~.batch_drain.lag_growth`), charged at one row's cost
        (:meth:`_lag_charge`).

        ``declined``: a step of the policy arm that drafted nothing, a plain
        step (with the policy's planning): a sample of both arms, paired
        with itself. Where the policy declines, its arm is the plain arm
        without holds; rated from its own steps alone, it won on noise (a
        window measured at a faster moment: 223 against plain's 195 tokens/s)
        and ran some 400 steps at 0.93x native (short T=0.8 c16 at d2:
        findings, thirty-first session). The pair of one step says the arms
        are level, and the margin then gives the steps to plain."""
        if seconds <= 0:
            return
        self._last_seconds[arm] = seconds
        key = self._key(_where(width, mix, context))
        charge = 0.0 if declined else self._lag_charge(key, arm, width, mix, context, committed, seconds, lag)
        run = self._run_before(arm, after)
        if run is not None and run < switch_steps(arm) and not self._long_step(key, arm, seconds):
            # The steps after a switch of arm are slower (see the module
            # docstring); a long one carries that as a share of one short step.
            self.switch_steps += 1
            return
        # Per request: a width bucket spans widths (5-8, 9-16), and a
        # batch narrows as its requests finish; a step of 5 rows must
        # not look 40% slower than one of 8.
        per_request = committed / max(int(width), 1) / (1.0 + charge)
        for observed_arm in (arm, PLAIN) if declined and arm != PLAIN else (arm,):
            self._update(key, observed_arm, per_request, seconds)
            self._pair(key, _where(width, mix, context), observed_arm, per_request / seconds)

    def _lag_charge(self, key: _Key, arm: str, width: int, mix: int, context: int, committed: int,
                    seconds: float, lag: float) -> float:
        """The share of its seconds by which a step of speculative ``arm``
        is charged for lag: the seconds the ``lag`` tokens it added cost
        later, decoded by a row alone (:meth:`_one_row_seconds`), less what
        they cost in this step; the mean over the arm's last steps here
        (:data:`LAG_CREDIT`). Measured for every step of the arm, settled or
        not: the lag a step adds does not fade with a switch."""
        if arm_kind(arm) == PLAIN or width < 2 or committed <= 0:
            return 0.0
        extra = lag * max(self._one_row_seconds(key, mix, context) - seconds / committed, 0.0)
        charges = key.lag_charges.setdefault(arm, deque(maxlen=RATE_WINDOW))
        charges.append(extra / seconds)
        return max(statistics.fmean(charges), -LAG_CREDIT)

    def _one_row_seconds(self, key: _Key, mix: int, context: int) -> float:
        """Seconds per token of a row decoding alone: the best rate of any
        arm at width 1 (this mix, this context bucket or an adjacent one),
        as the tail of a batch runs; else a plain step's seconds at ``key``
        (one row's token costs less than a whole step: the bound above)."""
        alone, _, bucket = _where(1, mix, context)
        for near in (bucket, bucket + 1, bucket - 1):
            narrow = self._keys.get((alone, mix, near))
            best = max((r.rate for r in narrow.arms.values() if r.samples), default=0.0) if narrow else 0.0
            if best > 0:
                return 1.0 / best
        return key.arms[PLAIN].step_seconds

    def _run_before(self, arm: str, after: str | None) -> int | None:
        """Steps of ``arm`` in a row before this observed one; None where
        ``after`` is not known (the step counts as settled). After
        :data:`UNCHOSEN` or another arm: 0. A step after one of its own arm
        that the chooser neither observed nor was told of (:meth:`skip`,
        :meth:`credit_held`) comes after a settled run."""
        if after is None:
            self._run = (arm, switch_steps(arm))
            return None
        last_arm, last_run = self._run
        run = 0 if after != arm else last_run + 1 if last_arm == arm else switch_steps(arm)
        self._run = (arm, run)
        return run

    @staticmethod
    def _update(key: _Key, arm: str, tokens: float, seconds: float, steps: int = 1) -> None:
        """A sample of ``arm`` at ``key``. The plain arm's first own sample
        replaces its borrowed ones: they were measured elsewhere (another
        context bucket, perhaps another batch's prompts), and a plain arm
        borrowed from a short-prompt batch kept outvoting the plain steps of
        a long-prompt batch of the same width until its window turned over
        (``benchmarks/probes/chooser_sim.py``). Plain steps are many and
        cheap; a speculative arm's first own step may be a try, one noisy
        sample, and is mixed with the borrowed ones (replaced, one such step
        lost the greedy cells' pipelined arm: ``auto_relative_borrow_ab.json``).
        A sample of the plain arm moves the arms still rated from borrowed
        steps alone with it: they were borrowed relative to plain
        (:meth:`_fill_from_neighbours`)."""
        rate = key.arms[arm]
        before = (rate.rate, rate.step_seconds)
        rate.update(tokens, seconds, steps, replace_borrowed=arm == PLAIN)
        _drop_stale_pairs(key, arm)
        if arm != PLAIN or not (before[0] > 0 and before[1] > 0):
            return
        for other, borrowed in key.arms.items():
            if other != PLAIN:
                borrowed.rescale(rate.rate / before[0], rate.step_seconds / before[1])

    def _pair(self, key: _Key, where: tuple[int, int, int], arm: str, rate: float) -> None:
        """Pair a sample of ``arm`` with the last of each other arm at its
        width bucket and mix if it is recent (:data:`PAIR_GAP`), at the same
        or a shorter context bucket: a few steps apart, the rows grew a
        little, and pairs across a bucket carry an arm's lead from one to
        the next (keyed by the whole key they cost the d1 greedy cells,
        ``chooser_ab_cross_context_pairs_reverted.json``). A sample at a
        longer bucket than this one's came before the batch turned over
        (rows only grow): shorter rows' steps are faster whatever the arm,
        and such a pair rated this arm for the new rows' length, not for
        its own speed (``pair_ages_d2_c4_t08_short_cd7d61e_fiftyfourth.txt``:
        plain at bucket 0 against pipelined at bucket 2)."""
        self._clock += 1
        last = self._last_sample.setdefault(where[:2], {})
        if rate <= 0:
            return
        for other, (when, other_rate, other_context) in last.items():
            if other != arm and self._clock - when <= PAIR_GAP and other_rate > 0 and other_context <= where[2]:
                ratio = math.log(rate / other_rate)
                key.pairs.setdefault((arm, other), deque(maxlen=PAIR_WINDOW)).append(ratio)
                key.pairs.setdefault((other, arm), deque(maxlen=PAIR_WINDOW)).append(-ratio)
                key.paired_rate[(arm, other)] = key.arms[arm].rate
                key.paired_rate[(other, arm)] = key.arms[other].rate
        last[arm] = (self._clock, rate, where[2])

    def _doubt_plain(self, key: _Key, where: tuple[int, int, int], winner: str, in_flight: str | None) -> bool:
        """Whether to measure plain beside speculative ``winner`` before its
        lead decides (:data:`PLAIN_DOUBT_STEPS`): once per key and winner, in
        one streak begun right after the winner's step (so that plain's
        samples pair with it; its first PLAIN_SWITCH_STEPS are no samples) and on
        until the pairs are made or plain has :data:`PLAIN_DOUBT_SAMPLES`
        (a narrow lead, :data:`NARROW_LEAD`: MIN_PAIRS more than it had)."""
        plain, won = key.arms[PLAIN], key.arms[winner]
        stale = plain.own < PLAIN_DOUBT_SAMPLES and won.step_seconds >= PLAIN_DOUBT_STEPS * plain.step_seconds
        if _paired_with_plain(key, winner) or not (_narrow_lead(key, winner) or stale):
            key.doubting = None
            return False
        if key.doubting == winner and self._last_arm == PLAIN:
            if plain.own < max(PLAIN_DOUBT_SAMPLES, key.doubt_from + MIN_PAIRS):
                return True  # the streak goes on
            key.doubting = None
            return False
        last = self._last_sample.get(where[:2], {}).get(winner)
        anchored = in_flight == winner or (last is not None and self._clock - last[0] < PAIR_GAP)
        if winner in key.doubted or not anchored:
            key.doubting = None
            return False  # measured beside it once; or the winner's step first, to pair with
        key.doubted.add(winner)
        key.doubting = winner
        key.doubt_from = plain.own
        return True

    def _key(self, where: tuple[int, int, int]) -> _Key:
        key = self._keys.get(where)  # not setdefault: a _Key built every step costs more than the lookup
        if key is None:
            key = self._keys[where] = _Key(arms={arm: _ArmRate() for arm in self.arms},
                                           since_try={arm: 0 for arm in self.arms})
        return key

    def rates(self, width: int, mix: int, context: int = 0) -> dict[str, tuple[float, int]]:
        """Per arm: measured tokens per second per request, and samples."""
        key = self._keys.get(_where(width, mix, context))
        if key is None:
            return {}
        return {arm: (r.rate, r.samples) for arm, r in key.arms.items()}

    def _long_step(self, key: _Key, arm: str, seconds: float) -> bool:
        """Whether a step of ``arm`` took :data:`LONG_STEP` times the
        shortest step of another arm: at this key, else its last anywhere
        (measured against the shortest, two long arms alternating count
        each other's steps as samples)."""
        others = [r.step_seconds for a, r in key.arms.items() if a != arm and r.samples]
        if not others:
            others = [s for a, s in self._last_seconds.items() if a != arm]
        return bool(others) and seconds > LONG_STEP * min(others)

    def _long(self, arm: str) -> bool:
        """Whether ``arm``'s last step, anywhere, took :data:`LONG_STEP`
        times another arm's last."""
        others = [s for a, s in self._last_seconds.items() if a != arm]
        return arm in self._last_seconds and bool(others) and self._last_seconds[arm] > LONG_STEP * min(others)

    def _fill_from_neighbours(self, key: _Key, where: tuple[int, int, int]) -> None:
        """Each arm without steps of its own at this key starts from the
        recent steps of an adjacent context bucket where it was measured
        (the shorter one first): a request's length crosses context
        buckets as it decodes, and measuring every
        arm again at each bucket would cost slow pipelined steps and rounds
        each time (a pipelined step of a wide sampled batch costs some
        thirty plain steps). Per arm, so that a bucket entered while its
        neighbour was still measuring takes what is known there; an arm
        measured once as a clear loser counts as measured. The key's own
        steps then replace the borrowed ones, and the losers' tries check
        them."""
        bucket, mix, context = where
        # Not from another width bucket: a rate there is not a rate here
        # (a step of twice the rows commits twice the tokens in less than
        # twice the time); a new width bucket takes only its neighbour's
        # winner first (:meth:`_neighbour_winner`).
        neighbours = [self._keys.get((bucket, mix, context - 1)), self._keys.get((bucket, mix, context + 1))]
        for arm, rate in key.arms.items():
            if rate.samples:
                continue
            source = next((n for n in neighbours if n is not None and _measured(n, arm)), None)
            if source is None:
                source = next((n for n in neighbours if n is not None and _long_loser(n, arm)), None)
            if source is not None:
                rate.borrow(source.arms[arm], *_relative_to_plain(key, source, arm))

    def _loser_as_at_narrower_width(self, key: _Key, where: tuple[int, int, int], arm: str) -> bool:
        """Whether ``arm``'s steps here (one is enough) lose as a long loser
        (:func:`_long_loser`), as they did at the next narrower width bucket
        of the same mix (same context bucket or one apart): measured enough,
        left to the tries. A long arm is measured in two steps
        (:data:`LONG_STEP`: one losing step alone may be noise), and in the
        sweep's wide sampled cells each pipelined step costs 100-300 ms, 15-25
        plain steps; the second at each new width bucket took 15-25% of its
        trial (``benchmarks/results/findings.md``, twenty-eighth session).
        Speculation loses ground to plain steps as a batch widens (every
        sweep: ``benchmarks/RESULTS.md``), so a loss at the narrower width
        predicts this one, and one step here that agrees confirms it. Unlike
        a borrowed verdict (tried and reverted, twenty-seventh session), the
        arm is still measured here once."""
        if not _long_loser(key, arm):
            return False
        bucket, mix, context = where
        return any(other is not None and _long_loser(other, arm)
                   for other in (self._keys.get((bucket - 1, mix, c)) for c in (context, context - 1, context + 1)))

    def _neighbour_winner(self, where: tuple[int, int, int]) -> str | None:
        """The winning arm at an adjacent width bucket of the same mix and
        context, where every arm was measured (see :func:`_all_measured`)."""
        bucket, mix, context = where
        for other in (bucket - 1, bucket + 1):
            key = self._keys.get((other, mix, context))
            if key and _all_measured(key):
                return _winner(key)
        return None


def _where(width: int, mix: int, context: int) -> tuple[int, int, int]:
    return width_bucket(width), mix, (max(int(context), 0) // CONTEXT_UNIT).bit_length()


def _relative_to_plain(key: _Key, source: _Key, arm: str) -> tuple[float, float]:
    """How to scale ``source``'s steps of ``arm`` (a speculative arm) for
    ``key``: by plain's rate and step seconds here over plain's there. What
    carries from one context bucket to the next is an arm's rate relative to
    plain steps, not the rate itself: a bucket doubles the rows' length, and
    at width 16, long prompts and T=0.8 plain steps ran at 206 tokens/s per
    request in one bucket and 132 in the next; a pipelined arm borrowed
    unscaled from the shorter bucket (169, where it lost to plain's 206)
    beat plain in the longer one and ran there, 70 ms a step, at 0.86x
    native (``benchmarks/results/findings.md``, twenty-seventh session)."""
    plain_here, plain_there = key.arms[PLAIN], source.arms[PLAIN]
    if arm == PLAIN or not (plain_here.rate > 0 and plain_there.rate > 0
                            and plain_here.step_seconds > 0 and plain_there.step_seconds > 0):
        return 1.0, 1.0
    return plain_here.rate / plain_there.rate, plain_here.step_seconds / plain_there.step_seconds


def _drop_stale_pairs(key: _Key, arm: str) -> None:
    """Drop ``arm``'s pairs with each other arm made when its rate was
    :data:`PAIRS_STALE` times away from what it is now: they were made
    before a change of workload."""
    rate = key.arms[arm].rate
    if rate <= 0:  # a step that committed nothing (rates are medians, so rarely)
        return
    for (first, other), then in list(key.paired_rate.items()):
        if first == arm and then > 0 and not then / PAIRS_STALE <= rate <= then * PAIRS_STALE:
            for pair in ((arm, other), (other, arm)):
                key.pairs.pop(pair, None)
                key.paired_rate.pop(pair, None)


def _try_budget_steps(key: _Key, winner: str, loser: str, losers: int) -> int:
    """Steps of ``winner`` after which a try of ``loser`` costs at most its
    share of :data:`RETRY_TIME_SHARE` (split evenly over the ``losers``): a
    short arm's try is :func:`switch_steps` + 1 steps, all but the last paying the switch;
    a close long loser's share is larger (:func:`_close_loser_boost`)."""
    won, lost = key.arms[winner], key.arms[loser]
    short = _short_try(key, winner, loser)
    cost = (switch_steps(loser) + 1 if short else 1) * lost.step_seconds
    if not won.step_seconds:
        return 0 if not cost else sys.maxsize
    share = RETRY_TIME_SHARE / losers * (1.0 if short else _close_loser_boost(key, winner, loser))
    # Rounded down where the division's rounding could wait one step too many.
    return math.ceil(cost / share / won.step_seconds * (1 - 1e-9))


def _close_loser_boost(key: _Key, winner: str, loser: str) -> float:
    """How many times its share of :data:`RETRY_TIME_SHARE` a long loser's
    tries may take: as many as keep what they lose against the winner,
    time times the loser's shortfall, at what a loser short by
    :data:`CLOSE_LOSER_SHORTFALL` loses with its plain share, up to
    :data:`CLOSE_LOSER_BOOST`."""
    rated = _ratings(key, key.arms)
    if rated[winner] <= 0:
        return 1.0
    shortfall = 1.0 - rated[loser] / rated[winner]
    if shortfall <= CLOSE_LOSER_SHORTFALL / CLOSE_LOSER_BOOST:
        return CLOSE_LOSER_BOOST
    return max(1.0, CLOSE_LOSER_SHORTFALL / shortfall)


def _short_try(key: _Key, winner: str, loser: str) -> bool:
    """Whether a try of ``loser`` is several steps (a short arm's first steps
    after a switch pays it and is no sample) rather than one long step."""
    return key.arms[loser].step_seconds <= LONG_STEP * key.arms[winner].step_seconds


def _narrow_lead(key: _Key, arm: str) -> bool:
    """Whether ``arm``'s steps are long (:data:`LONG_STEP` plain ones) and
    its rate leads plain's by under :data:`NARROW_LEAD`."""
    plain, rate = key.arms[PLAIN], key.arms[arm]
    return rate.step_seconds >= LONG_STEP * plain.step_seconds and rate.rate < NARROW_LEAD * plain.rate


def _paired_with_plain(key: _Key, arm: str) -> bool:
    """Whether ``arm`` has :data:`MIN_PAIRS` pairs with plain at ``key``."""
    return len(key.pairs.get((arm, PLAIN), ())) >= MIN_PAIRS


def _unpaired_narrow_lead(key: _Key, arm: str) -> bool:
    """A narrow lead (:func:`_narrow_lead`) without :data:`MIN_PAIRS` pairs with plain."""
    return _narrow_lead(key, arm) and not _paired_with_plain(key, arm)


def _measured(key: _Key, arm: str) -> bool:
    rate = key.arms[arm]
    if rate.samples >= MIN_SAMPLES or rate.borrowed:
        return True
    others = [r for a, r in key.arms.items() if a != arm and r.samples >= MIN_SAMPLES // 2]
    if not rate.samples or not others:
        return False
    if rate.samples >= MIN_SAMPLES // 2 and rate.step_seconds > LONG_STEP * min(r.step_seconds for r in others):
        return True
    best = max(others, key=lambda r: r.rate)
    return rate.rate < CLEAR_LOSS * best.rate and rate.step_seconds > 2 * best.step_seconds


def _rests_on_own_steps(rate: _ArmRate) -> bool:
    """Whether most of an arm's window is steps of its own key, not ones
    borrowed from an adjacent key (:meth:`_ArmRate.borrow`)."""
    return 2 * min(rate.own, len(rate.recent)) > len(rate.recent)


def _long_loser(key: _Key, arm: str) -> bool:
    """Whether ``arm`` has steps at ``key``, their median over
    :data:`LONG_STEP` times plain's there, and rates below :data:`LONG_LOSER_BORROW` of plain's
    (plain measured enough to compare)."""
    rate, plain = key.arms[arm], key.arms[PLAIN]
    return (arm != PLAIN and rate.samples > 0 and plain.samples >= MIN_SAMPLES // 2
            and rate.step_seconds > LONG_STEP * plain.step_seconds
            and rate.rate < LONG_LOSER_BORROW * plain.rate)


def _all_measured(key: _Key) -> bool:
    """Every arm measured enough to decide (a clear loser after one step)."""
    return all(_measured(key, arm) for arm in key.arms)


def _winner(key: _Key) -> str:
    """The arm with the best rate; a speculative one must beat plain by the margin."""
    return _best(key, key.arms)


def _best(key: _Key, arms) -> str:
    """The arm of ``arms`` with the best rate (a speculative one must beat
    plain by the margin), where an arm with :data:`MIN_PAIRS` pairs with
    the leader is rated from them: the leader's rate times their median
    ratio, where that agrees with the arm's own rate (:data:`PAIRS_AGREE`).
    The leader is the arm with the best rate of those rated from
    this key's own steps (:func:`_rests_on_own_steps`), if any: a pair
    says how two arms compare, and a rate borrowed from another context
    bucket, anchoring it, passes its error to every arm paired with it. At
    long greedy c8 (d2) a policy arm borrowed from the short prompts' bucket
    (387 tokens/s per request) anchored plain's pairs with it (1.07x):
    plain rated 414 against its own 230, and beat a pipeline at 252 for the
    66 plain steps of every repeat's first context bucket, at 0.91-0.96x
    the fixed pipeline (``sweep_replay_trace_d2_fortythird.txt``)."""
    rated = _ratings(key, arms)
    return max(rated, key=lambda arm: rated[arm] * _margin(arm))


def _margin(arm: str) -> float:
    return 1.0 if arm == PLAIN else 1.0 - SPECULATION_MARGIN


def _ratings(key: _Key, arms) -> dict[str, float]:
    """Per arm of ``arms``: its rate, or where it has :data:`MIN_PAIRS`
    pairs with the leader that agree with it, the rate they give (see
    :func:`_best`)."""
    arms = list(arms)
    anchors = [arm for arm in arms if _rests_on_own_steps(key.arms[arm])] or arms
    leader = max(anchors, key=lambda arm: key.arms[arm].rate * _margin(arm))
    rated = {}
    for arm in arms:
        pairs = key.pairs.get((arm, leader)) if arm != leader else None
        own = key.arms[arm].rate
        rated[arm] = own
        if pairs is not None and len(pairs) >= MIN_PAIRS:
            paired = key.arms[leader].rate * math.exp(statistics.median(pairs))
            if own <= 0 or own / PAIRS_AGREE <= paired <= own * PAIRS_AGREE:
                rated[arm] = paired
    return rated
