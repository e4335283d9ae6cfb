"""``"schedule": "auto"``: each step is either the adaptive policy's (a
round of its ``K_i``, or a plain step) or a pipelined step, whichever has
delivered more committed tokens per second at this batch width and
sampling mix.

Why measured and not priced: the policy's cost model
(:mod:`.policy`) prices rounds from a fit of round steps; a pipelined
step's cost depends on its restarts (how often a first proposal is
replaced at verification), which depends on the requests in flight, and
its rows commit every slot. Both arms deliver committed tokens, so their
rates compare directly (unlike draft counts inside the round policy, where
a K's rate depends on when the policy chose it); every step of either arm
is timed from its start to the next step's start (scheduler and output
handling included).

Per (width bucket, sampling mix) the chooser keeps, for each arm, an
exponentially weighted rate (committed tokens over seconds, both summed).
A key with fewer than :data:`MIN_SAMPLES` steps of either arm measures
that arm first, a width bucket with none of its own starting from an
adjacent bucket's verdict; afterwards it takes the faster arm (the
pipeline must beat the policy by :data:`PIPELINE_MARGIN`) and tries the
other one step in an interval that doubles while the other keeps losing
(:data:`RETRY_BACKOFF`), its rare steps weighing more (:data:`RETRY_WEIGHT`).

A pure object, tested without an engine (``tests/test_schedule_choice.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_loopspec.speculative.adaptive import width_bucket

MIN_SAMPLES = 4  # steps of each arm at a key before the rates decide
RATE_WEIGHT = 0.15  # weight of a new step in the exponentially weighted sums
# The pipelined step must beat the policy's step by this share: the plain
# step the policy falls back to is vLLM's own, and within the rates' noise
# the safer choice.
PIPELINE_MARGIN = 0.03
RETRY_BACKOFF = (16, 512)  # steps at a key between tries of the losing arm: first, longest
# Weight of a losing arm's new step: its steps are rare, and a machine or a
# workload that changed must show within a few tries.
RETRY_WEIGHT = 0.5


@dataclass
class _ArmRate:
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def update(self, tokens: int, seconds: float, weight: float = RATE_WEIGHT) -> None:
        w = max(weight, 1.0 / (self.samples + 1))  # a running mean over the first samples
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.samples += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Key:
    arms: dict[bool, _ArmRate] = field(default_factory=lambda: {False: _ArmRate(), True: _ArmRate()})
    steps: int = 0
    retry_interval: int = RETRY_BACKOFF[0]
    next_retry: int | None = None  # set when the rates first decide
    last_winner: bool | None = None


@dataclass
class ScheduleChoice:
    """Whether the next step of a batch pipelines, and why."""

    pipelined: bool
    reason: str  # "measure" | "faster" | "retry"


class ScheduleChooser:
    def __init__(self) -> None:
        self._keys: dict[tuple[int, int], _Key] = {}
        self.decisions: dict[tuple[bool, str], int] = {}  # (pipelined, reason) -> steps

    def choose(self, width: int, mix: int) -> ScheduleChoice:
        """The schedule of the next step of ``width`` decoding requests of
        sampling ``mix`` (see :func:`~.adaptive.sampling_mix`)."""
        key = self._key(width, mix)
        key.steps += 1
        choice = self._choose(key, (width_bucket(width), mix))
        self.decisions[(choice.pipelined, choice.reason)] = self.decisions.get((choice.pipelined, choice.reason), 0) + 1
        return choice

    def _choose(self, key: _Key, where: tuple[int, int]) -> ScheduleChoice:
        pipe, policy = key.arms[True], key.arms[False]
        if pipe.samples < MIN_SAMPLES or policy.samples < MIN_SAMPLES:
            neighbour = self._neighbour_winner(where)
            if neighbour is not None and min(pipe.samples, policy.samples) == 0 and (
                    key.arms[neighbour].samples < MIN_SAMPLES):
                return ScheduleChoice(neighbour, "measure")  # the neighbour's winner first
            return ScheduleChoice(pipe.samples < policy.samples, "measure")
        winner = pipe.rate > (1.0 + PIPELINE_MARGIN) * policy.rate
        if key.last_winner is not None and winner != key.last_winner:
            key.retry_interval = RETRY_BACKOFF[0]  # the verdict changed: the loser is close, try it soon
        key.last_winner = winner
        if key.next_retry is None:
            key.next_retry = key.steps + key.retry_interval
        if key.steps >= key.next_retry:
            key.next_retry = key.steps + key.retry_interval
            key.retry_interval = min(2 * key.retry_interval, RETRY_BACKOFF[1])
            return ScheduleChoice(not winner, "retry")
        return ScheduleChoice(winner, "faster")

    def observe(self, width: int, mix: int, pipelined: bool, committed: int, seconds: float) -> None:
        """A decode step of ``width`` requests: its schedule, the tokens it
        committed and the seconds from its start to the next step's start."""
        if seconds <= 0:
            return
        key = self._key(width, mix)
        losing = key.last_winner is not None and pipelined != key.last_winner
        key.arms[pipelined].update(committed, seconds, RETRY_WEIGHT if losing else RATE_WEIGHT)

    def rates(self, width: int, mix: int) -> dict[bool, tuple[float, int]]:
        """Per arm (True: pipelined): measured tokens per second and samples."""
        key = self._keys.get((width_bucket(width), mix))
        if key is None:
            return {}
        return {arm: (r.rate, r.samples) for arm, r in key.arms.items()}

    def _key(self, width: int, mix: int) -> _Key:
        return self._keys.setdefault((width_bucket(width), mix), _Key())

    def _neighbour_winner(self, where: tuple[int, int]) -> bool | None:
        """The faster arm at an adjacent width bucket of the same mix, where
        both were measured."""
        bucket, mix = where
        for other in (bucket - 1, bucket + 1):
            key = self._keys.get((other, mix))
            if key and all(a.samples >= MIN_SAMPLES for a in key.arms.values()):
                return key.arms[True].rate > (1.0 + PIPELINE_MARGIN) * key.arms[False].rate
        return None
