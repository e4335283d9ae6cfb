"""``"schedule": "auto"``'s chooser on synthetic measurements (no engine)."""

import math

import pytest
from collections import deque

from vllm_loopspec.speculative import schedule_choice
from vllm_loopspec.speculative.adaptive import GREEDY, SAMPLED
from vllm_loopspec.speculative.schedule_choice import (ARMS, BORROWED_STEPS, CLOSE_LOSER_BOOST, CONTEXT_UNIT, MIN_SAMPLES, PIPELINED, PLAIN, POLICY, RETRY_BACKOFF,
                                                      HOLD_STEPS, MIN_PAIRS, PAIR_GAP, RATE_WINDOW, SPECULATION_MARGIN, RETRY_TIME_SHARE, SWITCH_STEPS, UNCHOSEN,
                                                      PLAIN_SWITCH_STEPS, switch_steps,
                                                      ScheduleChoice, ScheduleChooser)

MEASURE = len(ARMS) * MIN_SAMPLES  # steps before the rates decide


def _run(chooser, width, mix, rates, steps, seconds=None):
    """``steps`` decisions at one key, each observed at its arm's rate
    (tokens per second; ``seconds`` per step, default 10 ms); the choices."""
    made = []
    for _ in range(steps):
        choice = chooser.choose(width, mix)
        made.append(choice)
        step = (seconds or {}).get(choice.arm, 0.01)
        chooser.observe(width, mix, choice.arm, rates[choice.arm] * step, step)
    return made


def test_measures_every_arm_then_takes_the_fastest():
    chooser = ScheduleChooser()
    rates = {PLAIN: 300.0, POLICY: 400.0, PIPELINED: 500.0}
    made = _run(chooser, 1, GREEDY, rates, MEASURE)
    assert all(c.reason == "measure" for c in made)
    assert made[0].arm == POLICY  # its warm-up comes first
    assert {arm: sum(c.arm == arm for c in made) for arm in ARMS} == {arm: MIN_SAMPLES for arm in ARMS}
    later = _run(chooser, 1, GREEDY, rates, 6)
    assert all(c.arm == PIPELINED and c.reason == "faster" for c in later)
    assert abs(chooser.rates(1, GREEDY)[PIPELINED][0] - 500.0) < 1e-6


def test_speculation_must_beat_plain_steps_by_the_margin():
    chooser = ScheduleChooser()
    rates = {PLAIN: 1000.0, POLICY: 1010.0, PIPELINED: 1020.0}
    _run(chooser, 8, SAMPLED, rates, MEASURE)
    assert all(c.arm == PLAIN for c in _run(chooser, 8, SAMPLED, rates, 6))


def test_contexts_are_measured_apart():
    """Steps over long prompts are slower whatever the arm: plain steps timed
    over long contexts must not make a pipeline timed over short ones win."""
    chooser = ScheduleChooser()
    chooser.observe(4, GREEDY, PLAIN, 4, 0.008, context=600)
    chooser.observe(4, GREEDY, PIPELINED, 20, 0.020, context=100)
    assert chooser.rates(4, GREEDY, 600)[PIPELINED][1] == 0
    assert chooser.rates(4, GREEDY, 100)[PLAIN][1] == 0
    assert chooser.rates(4, GREEDY, 110)[PIPELINED] == (250.0, 1)  # the same bucket; per request


def test_widths_and_mixes_are_measured_apart():
    chooser = ScheduleChooser()
    wins_pipelined = {PLAIN: 300.0, POLICY: 400.0, PIPELINED: 500.0}
    wins_plain = {PLAIN: 1000.0, POLICY: 900.0, PIPELINED: 800.0}
    _run(chooser, 1, GREEDY, wins_pipelined, MEASURE)
    _run(chooser, 16, SAMPLED, wins_plain, MEASURE)
    assert all(c.arm == PIPELINED for c in _run(chooser, 1, GREEDY, wins_pipelined, 4))
    assert all(c.arm == PLAIN for c in _run(chooser, 16, SAMPLED, wins_plain, 4))
    # A new width bucket measures its neighbour's winner first, and borrows
    # no rates from it (tokens per second differ with the width).
    assert chooser.choose(2, GREEDY) == ScheduleChoice(PIPELINED, "measure")
    assert all(samples == 0 for _, samples in chooser.rates(2, GREEDY).values())


def test_losers_are_tried_in_turn_less_and_less_often_and_can_win_back():
    chooser = ScheduleChooser()
    # The winner's steps are long, the losers' short: their tries' time
    # budgets come due at once (a plain try has more steps after the switch,
    # switch_steps, so the pipeline's step is as much longer), and the
    # interval between tries decides (the winner's step is long enough, for
    # RETRY_TIME_SHARE, that a try is due after some 19 of them).
    seconds = {PLAIN: 0.01, POLICY: 0.0075 / RETRY_TIME_SHARE,
               PIPELINED: 0.01 * (PLAIN_SWITCH_STEPS + 1) / (SWITCH_STEPS + 1)}
    rates = {PLAIN: 300.0, POLICY: 500.0, PIPELINED: 400.0}
    made = _run(chooser, 4, GREEDY, rates, MEASURE + 600, seconds)
    retries = [i for i, c in enumerate(made) if c.reason == "retry"]
    assert {made[i].arm for i in retries} == {PLAIN, PIPELINED}
    # A try of a short arm is switch_steps + 1 steps (the first pay the switch).
    assert all([(c.arm, c.reason) for c in made[i:i + switch_steps(made[i].arm) + 2]]
               == [(made[i].arm, "retry")] * (switch_steps(made[i].arm) + 1) + [(POLICY, "faster")]
               for i in retries if made[i - 1].reason != "retry")
    starts = [i for i in retries if made[i - 1].reason != "retry"]
    assert all(made[a].arm != made[b].arm for a, b in zip(starts, starts[1:]))  # in turn
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[0] <= RETRY_BACKOFF[0] + 2 and gaps[-1] >= RETRY_BACKOFF[1]
    # The workload changes: the pipeline becomes the faster arm; tries find it.
    rates = {PLAIN: 300.0, POLICY: 500.0, PIPELINED: 900.0}
    made = _run(chooser, 4, GREEDY, rates, 600, seconds)
    assert made[-1].arm == PIPELINED and made[-1].reason == "faster"


def test_an_expensive_loser_is_tried_within_a_small_share_of_the_time():
    """A pipelined step of a wide sampled batch costs many plain steps: its
    tries, once it loses, take at most RETRY_TIME_SHARE of the time."""
    chooser = ScheduleChooser()
    seconds = {PLAIN: 0.005, POLICY: 0.006, PIPELINED: 0.120}
    rates = {PLAIN: 1600.0, POLICY: 1400.0, PIPELINED: 1133.0}
    made = _run(chooser, 8, SAMPLED, rates, 12000, seconds)[MEASURE:]
    assert made[-1].arm == PLAIN
    spent = sum(seconds[c.arm] for c in made)
    tried = sum(seconds[c.arm] for c in made if c.arm == PIPELINED)
    assert 0 < tried <= 1.1 * RETRY_TIME_SHARE * spent


def test_a_close_long_loser_is_tried_more_often_for_the_same_loss():
    """Under a plain winner at a wide key, a pipelined arm 10% behind is
    tried some three times as often as one 31% behind (the tries of each lose
    about as much), and within CLOSE_LOSER_BOOST times its share: with the
    plain share, a close lead measured once as a loss was tried every ~1000
    plain steps (long greedy c16, d2: findings, forty-fifth session)."""
    seconds = {PLAIN: 0.005, POLICY: 0.006, PIPELINED: 0.075}

    def tried_share(pipelined_rate):
        chooser = ScheduleChooser()
        rates = {PLAIN: 1000.0, POLICY: 500.0, PIPELINED: pipelined_rate}
        made = _run(chooser, 16, GREEDY, rates, 20000, seconds)[MEASURE:]
        assert {c.arm for c in made if c.reason == "faster"} == {PLAIN}
        spent = sum(seconds[c.arm] for c in made)
        return sum(seconds[c.arm] for c in made if c.arm == PIPELINED and c.reason == "retry") / spent

    close, far = tried_share(900.0), tried_share(690.0)
    share = RETRY_TIME_SHARE / 2
    assert 0.8 * share <= far <= 1.1 * share
    assert 2.4 * share <= close <= 1.1 * CLOSE_LOSER_BOOST * share
    assert close * 0.10 <= 1.1 * far * 0.31  # the same loss, or less


def test_an_expensive_loser_does_not_hold_back_a_cheap_ones_tries():
    """A wide sampled batch where the policy arm wins and the pipeline's
    steps take 100 ms: the plain arm is still tried every 200 steps or less
    (each loser has a budget of its own), and the pipeline within its time
    share. With one budget for both losers taken in turn, the pipeline's
    try, due only every 700 steps, held back the plain tries after the
    first; a policy arm that decided plain steps had won by noise and ran
    380 steps with no plain step to pair it with, at 0.93x native (short
    T=0.8 c16 at d2: findings, thirty-first session)."""
    chooser = ScheduleChooser()
    seconds = {PLAIN: 0.005, POLICY: 0.005, PIPELINED: 0.100}
    rates = {PLAIN: 200.0, POLICY: 230.0, PIPELINED: 180.0}
    made = _run(chooser, 16, SAMPLED, rates, 2 * MEASURE + 3000, seconds)[2 * MEASURE:]
    assert made[-1] == ScheduleChoice(POLICY, "faster")
    plain_tries = [i for i, c in enumerate(made) if c.arm == PLAIN and c.reason == "retry"]
    # A try of PLAIN_SWITCH_STEPS + 1 plain steps at least every 1.3 budgets
    # (its budget: 467 steps; the pipeline's try takes its turn now and
    # then, every 1300 steps).
    budget = (PLAIN_SWITCH_STEPS + 1) * 2 / RETRY_TIME_SHARE
    assert len(plain_tries) >= (PLAIN_SWITCH_STEPS + 1) * 3000 // (1.3 * budget)
    assert max(b - a for a, b in zip(plain_tries, plain_tries[1:])) <= 1.3 * budget
    spent = sum(seconds[c.arm] for c in made)
    assert 0 < sum(seconds[c.arm] for c in made if c.arm == PIPELINED) <= 1.1 * RETRY_TIME_SHARE * spent


def test_a_policy_step_that_drafted_nothing_is_a_sample_of_plain_too():
    """Where the policy drafts nothing its steps are plain ones, and one
    measured at a faster moment (223 against plain's 195 tokens/s) must not
    make the policy arm win: each such step is a sample of both arms, paired
    with itself, and the margin gives the steps to plain (with its holds).
    Observed as the policy's alone, the policy arm wins."""
    seconds = {PLAIN: 0.005, POLICY: 0.005, PIPELINED: 0.100}
    for declined, winner in ((True, PLAIN), (False, POLICY)):
        chooser = ScheduleChooser()
        rates = {PLAIN: 195.0, POLICY: 223.0, PIPELINED: 172.0}
        for _ in range(2 * MEASURE):
            arm = chooser.choose(16, SAMPLED).arm
            chooser.observe(16, SAMPLED, arm, rates[arm] * seconds[arm], seconds[arm],
                            declined=declined and arm == POLICY)
        assert chooser.choose(16, SAMPLED).arm == winner
    assert chooser.rates(16, SAMPLED)[PLAIN][1] == MIN_SAMPLES


def _run_holding(chooser, width, mix, rates, steps, seconds, context=0):
    """As :func:`_run`, but as the engine runs a plain hold: the held steps
    are plain, not chosen, and credited at the next choice with the time
    from the first held step's start to the last one's."""
    made, held, left = [], 0, 0
    for _ in range(steps):
        if left:
            left, held = left - 1, held + 1
            made.append(ScheduleChoice(PLAIN, "held"))
            continue
        chooser.credit_held(held, held - 1, (held - 1) * seconds[PLAIN])
        held = 0
        choice = chooser.choose(width, mix, context)
        made.append(choice)
        left = choice.hold
        step = seconds[choice.arm]
        chooser.observe(width, mix, choice.arm, rates[choice.arm] * step, step, context)
    chooser.credit_held(held, held - 1, (held - 1) * seconds[PLAIN])
    return made


def test_a_plain_hold_changes_no_try():
    """A plain winner's hold spans only steps no try could be due in: the
    engine, skipping the choice in those steps, tries the losers at the same
    steps as asking every step would."""
    seconds = {PLAIN: 0.005, POLICY: 0.006, PIPELINED: 0.120}
    rates = {PLAIN: 1600.0, POLICY: 1400.0, PIPELINED: 1133.0}
    every_step = _run(ScheduleChooser(), 8, SAMPLED, rates, 12000, seconds)
    holding_chooser = ScheduleChooser()
    holding = _run_holding(holding_chooser, 8, SAMPLED, rates, 12000, seconds)
    tries = [(i, c.arm) for i, c in enumerate(every_step) if c.reason == "retry"]
    assert {arm for _, arm in tries} == {POLICY, PIPELINED}
    assert [(i, c.arm) for i, c in enumerate(holding) if c.reason == "retry"] == tries
    assert [c.arm for c in holding] == [c.arm for c in every_step]
    held = sum(c.reason == "held" for c in holding)
    assert held > 10000  # most plain steps are not asked
    assert max(c.hold for c in holding) == HOLD_STEPS
    assert holding_chooser.decisions[(PLAIN, "faster")] == every_step.count(ScheduleChoice(PLAIN, "faster"))
    # Only a plain winner holds: a speculative one is asked every step.
    assert all(c.hold == 0 for c in _run(ScheduleChooser(), 1, GREEDY, {PLAIN: 300.0, POLICY: 400.0,
                                                                        PIPELINED: 500.0}, 200))


def test_no_rate_without_time():
    chooser = ScheduleChooser()
    chooser.observe(1, GREEDY, PIPELINED, 5, 0.0)
    assert chooser.rates(1, GREEDY) == {}


def test_a_clear_loser_is_measured_once():
    """A burst of wide sampled requests must not pay four slow pipelined
    steps before the chooser settles on plain ones."""
    chooser = ScheduleChooser()
    seconds = {PLAIN: 0.008, POLICY: 0.009, PIPELINED: 0.150}
    rates = {PLAIN: 2100.0, POLICY: 1900.0, PIPELINED: 900.0}
    made = _run(chooser, 17, SAMPLED, rates, 2 * MEASURE, seconds)
    assert sum(c.arm == PIPELINED for c in made) == 1
    assert made[-1].arm == PLAIN


def test_a_new_context_bucket_starts_from_its_neighbour():
    """A request's length crosses context buckets as it decodes: the next
    bucket takes the measured one's rates instead of measuring every arm
    (slow pipelined steps and rounds) again."""
    chooser = ScheduleChooser()
    rates = {PLAIN: 1600.0, POLICY: 1200.0, PIPELINED: 900.0}
    _run(chooser, 8, SAMPLED, rates, 2 * MEASURE)
    first = chooser.choose(8, SAMPLED, context=100)
    assert first.arm == PLAIN and first.reason == "faster"
    assert chooser.rates(8, SAMPLED, 100)[PIPELINED][1] == BORROWED_STEPS


def test_held_plain_steps_are_timed_as_one_sample_of_the_plain_arm():
    chooser = ScheduleChooser()
    seconds = {PLAIN: 0.005, POLICY: 0.006, PIPELINED: 0.120}
    rates = {PLAIN: 1600.0, POLICY: 1400.0, PIPELINED: 1133.0}
    made = _run(chooser, 8, SAMPLED, rates, 2 * MEASURE, seconds)
    assert made[-1].arm == PLAIN and made[-1].hold > 0
    before = chooser.rates(8, SAMPLED)[PLAIN][1]
    chooser.credit_held(made[-1].hold, made[-1].hold - 1, (made[-1].hold - 1) * 0.004)
    assert chooser.rates(8, SAMPLED)[PLAIN][1] == before + 1
    assert chooser._keys[(3, SAMPLED, 0)].arms[PLAIN].recent[-1] == (1 / 0.004, 0.004)


def test_a_plain_verdict_borrowed_from_a_shorter_context_yields_to_a_try():
    """Plain steps won at short contexts; at longer ones they are slower
    than the policy's rounds, which did not slow down. The longer context's
    bucket starts from the plain verdict it borrowed; its holds' timing
    moves plain's rate, and the policy's borrowed rate with it (borrowed
    relative to plain), so the first try of the policy overturns it, within
    the holds its share of the try budget affords (half of
    RETRY_TIME_SHARE, for a try of SWITCH_STEPS + 1 steps)."""
    chooser = ScheduleChooser()
    rates = {PLAIN: 1600.0, POLICY: 1400.0, PIPELINED: 1133.0}
    _run(chooser, 8, SAMPLED, rates, 2 * MEASURE, {PLAIN: 0.005, POLICY: 0.006, PIPELINED: 0.120})
    slower = {PLAIN: 0.008, POLICY: 0.006, PIPELINED: 0.120}
    # Holds until the policy's try is due: its try's seconds over its share,
    # in plain steps as the key knew them (5 ms).
    due = (SWITCH_STEPS + 1) * slower[POLICY] / (RETRY_TIME_SHARE / 2) / 0.005 / HOLD_STEPS
    made = _run_holding(chooser, 8, SAMPLED, {**rates, PLAIN: 1000.0}, (math.ceil(due) + 3) * HOLD_STEPS, slower,
                        context=100)
    assert made[0].arm == PLAIN and made[0].reason == "faster"
    tries = [i for i, c in enumerate(made) if c.reason == "retry"]
    # The policy is tried first (the pipeline's steps are too long to be
    # due), and wins; plain, the loser now, is tried in its turn.
    assert tries and made[tries[0]].arm == POLICY and all(made[i].arm != PIPELINED for i in tries)
    assert made[-1] == ScheduleChoice(POLICY, "faster")


def test_a_speculative_arm_carries_its_rate_relative_to_plain_into_a_longer_context():
    """A bucket of twice the rows' length slows every step. What carries
    from one context bucket to the next is an arm's rate relative to plain
    steps: a pipelined arm that lost to plain at the shorter bucket (170
    against 200 tok/s per request) starts the longer one at that ratio of
    plain's rate there (130), not at its own rate (which would beat plain's
    130 and run there), and moves with plain's rate until it has steps of
    its own there."""
    chooser = ScheduleChooser()
    for _ in range(MIN_SAMPLES):
        chooser.observe(16, SAMPLED, PLAIN, 16 * 200.0 * 0.005, 0.005, context=300)
        chooser.observe(16, SAMPLED, POLICY, 16 * 180.0 * 0.006, 0.006, context=300)
        chooser.observe(16, SAMPLED, PIPELINED, 16 * 170.0 * 0.080, 0.080, context=300)
    for _ in range(PAIR_GAP):  # the winner's steps, before the batch crosses into the next bucket
        chooser.observe(16, SAMPLED, PLAIN, 16 * 200.0 * 0.005, 0.005, context=300)
    for _ in range(MIN_SAMPLES):  # plain measured first at the longer bucket
        chooser.observe(16, SAMPLED, PLAIN, 16 * 130.0 * 0.008, 0.008, context=600)
    choice = chooser.choose(16, SAMPLED, context=600)
    assert choice.arm == PLAIN and choice.reason == "faster"
    rates = chooser.rates(16, SAMPLED, 600)
    assert abs(rates[PIPELINED][0] - 170.0 * 130.0 / 200.0) < 1e-6
    for _ in range(RATE_WINDOW):  # plain slows further here: the borrowed rate follows it
        chooser.observe(16, SAMPLED, PLAIN, 16 * 100.0 * 0.010, 0.010, context=600)
    assert abs(chooser.rates(16, SAMPLED, 600)[PIPELINED][0] - 170.0 * 100.0 / 200.0) < 1e-6


def test_a_clear_loser_measured_once_still_seeds_the_next_context_bucket():
    """A wide sampled batch decodes through several context buckets: its
    slow pipelined step is paid once, not once per bucket."""
    chooser = ScheduleChooser()
    seconds = {PLAIN: 0.008, POLICY: 0.009, PIPELINED: 0.150}
    rates = {PLAIN: 2100.0, POLICY: 1900.0, PIPELINED: 900.0}
    _run(chooser, 17, SAMPLED, rates, 2 * MEASURE, seconds)
    assert chooser.rates(17, SAMPLED)[PIPELINED][1] == 1
    first = chooser.choose(17, SAMPLED, context=100)
    assert first.arm == PLAIN and first.reason == "faster"


def test_a_bucket_entered_mid_measurement_borrows_what_its_neighbour_knows():
    """Arms measured at the neighbour are borrowed one by one; only the
    arm measured nowhere is measured at the new bucket."""
    chooser = ScheduleChooser()
    for _ in range(MIN_SAMPLES):
        chooser.observe(8, SAMPLED, PLAIN, 8, 0.005)
        chooser.observe(8, SAMPLED, POLICY, 8, 0.006)
    first = chooser.choose(8, SAMPLED, context=100)
    assert first == ScheduleChoice(PIPELINED, "measure")
    assert chooser.rates(8, SAMPLED, 100)[PLAIN] == (200.0, BORROWED_STEPS)


def _stale_plain_chooser(leader, rate, seconds):
    """Plain measured (at 1000 tokens/s per request, stale: it runs at 1200
    now), then the loser, then ``leader``, none paired with plain."""
    chooser = ScheduleChooser()
    loser, loser_rate, loser_seconds = (POLICY, 800.0, 0.006) if leader == PIPELINED else (PIPELINED, 500.0, 0.1)
    for arm, arm_rate, arm_seconds in ((PLAIN, 1000.0, 0.005), (loser, loser_rate, loser_seconds),
                                       (leader, rate, seconds)):
        for _ in range(MIN_SAMPLES):
            chooser.observe(8, SAMPLED, arm, 8 * arm_rate * arm_seconds, arm_seconds)
    return chooser


def test_a_lead_of_long_steps_waits_for_plain_measured_beside_it():
    """A speculative arm whose step costs PLAIN_DOUBT_STEPS plain ones or
    more wins over plain only once the two were measured side by side
    (MIN_PAIRS pairs): plain's samples at a key may be stale (the burst's
    warm-up left plain slow ones, and 110 ms pipelined steps won on them).
    Plain is measured in one streak after the leader's step, its first
    PLAIN_SWITCH_STEPS no samples; the pairs then decide, here for plain against
    a narrow lead, faster now than its stale samples said. Once per key:
    pairs gone stale later are left to the tries. A short leader's lead
    decides at once."""
    for leader, rate, seconds, waits in ((PIPELINED, 1100.0, 0.100, True), (PIPELINED, 1650.0, 0.100, True),
                                         (POLICY, 1100.0, 0.006, False)):
        chooser = _stale_plain_chooser(leader, rate, seconds)
        if not waits:
            assert chooser.choose(8, SAMPLED) == ScheduleChoice(leader, "faster")
            continue
        made, after = [], leader
        for _ in range(PLAIN_SWITCH_STEPS + MIN_PAIRS):
            made.append(chooser.choose(8, SAMPLED))
            chooser.observe(8, SAMPLED, PLAIN, 8 * 1200.0 / 240, 1 / 240, after=after)
            after = PLAIN
        assert made == [ScheduleChoice(PLAIN, "measure")] * (PLAIN_SWITCH_STEPS + MIN_PAIRS)
        key = chooser._keys[(3, SAMPLED, 0)]
        assert len(key.pairs[(leader, PLAIN)]) == MIN_PAIRS
        # The pairs rate plain at 1200: it wins against 1100, not against 1650.
        assert chooser.choose(8, SAMPLED).arm == (PLAIN if rate < 1200 / (1 - SPECULATION_MARGIN) else leader)
        key.pairs.clear()
        assert chooser.choose(8, SAMPLED, in_flight=leader).reason != "measure"


def test_a_narrow_lead_of_long_steps_waits_for_pairs_however_settled_plain_is():
    """A long arm leading plain by under NARROW_LEAD, rated from a few steps
    of its own against plain's many, wins only once pairs made at one moment
    agree: plain is measured right after its step (the streak ends MIN_PAIRS
    samples on, although plain has PLAIN_DOUBT_SAMPLES), and the pairs,
    which see the pipeline 6% behind, give the key to plain. A wide lead,
    or a narrow one of short steps, decides at once."""
    from vllm_loopspec.speculative.schedule_choice import NARROW_LEAD, PLAIN_DOUBT_SAMPLES

    for leader, rate, seconds, waits in ((PIPELINED, 1070.0, 0.03, True), (PIPELINED, 1000.0 * NARROW_LEAD * 1.02, 0.03, False),
                                         (POLICY, 1070.0, 0.006, False)):
        chooser = ScheduleChooser()
        loser = POLICY if leader == PIPELINED else PIPELINED
        for _ in range(PLAIN_DOUBT_SAMPLES + 4):
            chooser.observe(8, SAMPLED, PLAIN, 8 * 1000.0 * 0.005, 0.005)
        for _ in range(MIN_SAMPLES):
            chooser.observe(8, SAMPLED, loser, 8 * 800.0 * 0.02, 0.02, after=loser)
        for _ in range(MIN_SAMPLES):
            chooser.observe(8, SAMPLED, leader, 8 * rate * seconds, seconds, after=leader)
        if not waits:
            assert chooser.choose(8, SAMPLED, in_flight=leader) == ScheduleChoice(leader, "faster")
            continue
        made, after = [], leader
        for _ in range(PLAIN_SWITCH_STEPS + MIN_PAIRS):
            made.append(chooser.choose(8, SAMPLED, in_flight=after))
            chooser.observe(8, SAMPLED, PLAIN, 8 * 1070.0 / 0.94 * 0.005, 0.005, after=after)
            after = PLAIN
        assert made == [ScheduleChoice(PLAIN, "measure")] * (PLAIN_SWITCH_STEPS + MIN_PAIRS)
        assert len(chooser._keys[(3, SAMPLED, 0)].pairs[(leader, PLAIN)]) == MIN_PAIRS
        assert chooser.choose(8, SAMPLED).arm == PLAIN


def test_a_doubted_lead_runs_the_leader_first_when_its_last_step_is_not_recent():
    """Plain's streak pairs only with a recent step of the leader (PAIR_GAP):
    where the leader's last sample is older, the leader runs first."""
    chooser = ScheduleChooser()
    for arm, rate, seconds in ((PIPELINED, 1650.0, 0.1), (POLICY, 800.0, 0.006), (PLAIN, 1000.0, 0.005)):
        for _ in range(MIN_SAMPLES):
            chooser.observe(8, SAMPLED, arm, 8 * rate * seconds, seconds)
    assert chooser.choose(8, SAMPLED) == ScheduleChoice(PIPELINED, "faster")
    assert chooser.choose(8, SAMPLED, in_flight=PIPELINED) == ScheduleChoice(PLAIN, "measure")


def test_a_plain_streak_that_makes_no_pairs_ends_at_its_bound():
    """Pairs need the leader's step observed just before; should they not be
    made, the streak ends when plain has PLAIN_DOUBT_SAMPLES steps at the
    key, and the rates decide: a wide lead takes the key; a narrow one
    (NARROW_LEAD) leaves it to plain, and its tries make the pairs."""
    from vllm_loopspec.speculative.schedule_choice import PLAIN_DOUBT_SAMPLES

    for rate, after_streak in ((1650.0, PIPELINED), (1100.0, PLAIN)):
        chooser = _stale_plain_chooser(PIPELINED, rate, 0.1)
        chooser._last_sample.clear()  # the leader's last step no longer pairs
        made = []
        while len(made) < 40 and (not made or made[-1].reason == "measure"):
            made.append(chooser.choose(8, SAMPLED, in_flight=PIPELINED if not made else PLAIN))
            chooser.observe(8, SAMPLED, made[-1].arm, 8 * 1000.0 * 0.005, 0.005,
                            after=PIPELINED if len(made) == 1 else PLAIN)
        assert made[:-1] == [ScheduleChoice(PLAIN, "measure")] * (PLAIN_SWITCH_STEPS + PLAIN_DOUBT_SAMPLES - MIN_SAMPLES)
        assert made[-1].arm == after_streak and made[-1].reason == "faster"
    tried, last = [], PLAIN
    # Plain's steps and the policy's tries, until the pipeline's try: a close
    # long loser's, due after its 0.1 s step's share of the try budget
    # (RETRY_TIME_SHARE over the two losers, times CLOSE_LOSER_BOOST).
    due = 0.1 / (RETRY_TIME_SHARE / 2 * CLOSE_LOSER_BOOST) / 0.005
    for _ in range(int(1.2 * due)):
        choice = chooser.choose(8, SAMPLED)
        if choice.arm == PIPELINED:
            tried.append(choice)
            break
        rate, seconds = (1000.0, 0.005) if choice.arm == PLAIN else (800.0, 0.006)
        chooser.observe(8, SAMPLED, choice.arm, 8 * rate * seconds, seconds, after=last)
        last = choice.arm
    assert tried == [ScheduleChoice(PIPELINED, "retry")]


def test_a_long_arm_losing_at_the_adjacent_bucket_is_not_measured_again():
    """A pipelined step of a wide sampled batch costs many plain ones. One
    step of it that lost to plain by more than 10% at the adjacent context
    bucket (not a clear loss, so not measured enough there) is borrowed at
    the new bucket: tries check it, measurements do not repeat. One that lost
    by less is measured again."""
    for pipelined_rate, measured_again in ((1300.0, False), (1500.0, True)):
        chooser = ScheduleChooser()
        for _ in range(MIN_SAMPLES):
            chooser.observe(8, SAMPLED, PLAIN, 8 * 1600.0 * 0.005, 0.005)
            chooser.observe(8, SAMPLED, POLICY, 8 * 1500.0 * 0.006, 0.006)
        chooser.observe(8, SAMPLED, PIPELINED, 8 * pipelined_rate * 0.060, 0.060)
        first = chooser.choose(8, SAMPLED, context=100)
        borrowed = chooser.rates(8, SAMPLED, 100)[PIPELINED]
        if measured_again:
            assert first == ScheduleChoice(PIPELINED, "measure") and borrowed[1] == 0
        else:
            assert first.arm == PLAIN and first.reason == "faster"
            assert borrowed == (pipelined_rate, 1)


def test_an_arm_of_long_steps_is_measured_in_half_the_steps():
    """A pipelined step of a wide batch runs many ticks: two of them say as
    much as four short steps, and cost as much as many."""
    chooser = ScheduleChooser()
    seconds = {PLAIN: 0.005, POLICY: 0.006, PIPELINED: 0.060}
    rates = {PLAIN: 1600.0, POLICY: 1500.0, PIPELINED: 1400.0}  # no clear loss
    made = _run(chooser, 8, SAMPLED, rates, 2 * MEASURE, seconds)
    measured = [c for c in made if c.reason == "measure"]
    assert sum(c.arm == PIPELINED for c in measured) == MIN_SAMPLES // 2
    assert made[-1].arm == PLAIN


def test_a_long_arm_that_lost_at_the_narrower_width_is_measured_once_if_it_loses_again():
    """In a wide sampled batch one pipelined step costs 15-25 plain ones.
    Where the pipeline lost at the next narrower width bucket, one losing
    step at the wider one is its measurement; one that does not lose there
    is measured again (a batch widening does not make speculation win, but
    one step's rate is noisy)."""
    seconds = {PLAIN: 0.005, POLICY: 0.006, PIPELINED: 0.100}
    narrower = {PLAIN: 1600.0, POLICY: 1500.0, PIPELINED: 1350.0}  # a long loser, not a clear one
    for wider_pipelined, measured in ((1300.0, 1), (1550.0, MIN_SAMPLES // 2)):
        chooser = ScheduleChooser()
        _run(chooser, 8, SAMPLED, narrower, 2 * MEASURE, seconds)
        assert chooser.rates(8, SAMPLED)[PIPELINED][1] == MIN_SAMPLES // 2
        made = _run(chooser, 16, SAMPLED, narrower | {PIPELINED: wider_pipelined}, 2 * MEASURE, seconds)
        assert sum(c.arm == PIPELINED and c.reason == "measure" for c in made) == measured
        assert made[-1].arm == PLAIN
    # Not from a wider bucket's loss: a narrower batch may well speculate.
    chooser = ScheduleChooser()
    _run(chooser, 16, SAMPLED, narrower, 2 * MEASURE, seconds)
    made = _run(chooser, 8, SAMPLED, narrower | {PIPELINED: 1300.0}, 2 * MEASURE, seconds)
    assert sum(c.arm == PIPELINED and c.reason == "measure" for c in made) == MIN_SAMPLES // 2


def test_rates_are_per_request_so_a_narrowing_batch_is_not_a_slower_arm():
    """Widths 5 to 8 share a bucket: plain steps of 5 rows (the batch's
    requests finishing) against pipelined steps of 8 compare per request.
    Per step, the pipeline's 1500 tok/s would beat plain's 1250."""
    chooser = ScheduleChooser()
    for _ in range(MIN_SAMPLES):
        chooser.observe(8, SAMPLED, POLICY, 8, 0.006)
        chooser.observe(8, SAMPLED, PIPELINED, 12, 0.008)  # 187.5 tok/s per request
        chooser.observe(5, SAMPLED, PLAIN, 5, 0.004)  # 250 tok/s per request
    assert chooser.rates(6, SAMPLED)[PLAIN][0] == 250.0
    assert chooser.choose(6, SAMPLED).arm == PLAIN


def test_the_steps_after_a_switch_of_arm_are_not_samples_unless_long():
    chooser = ScheduleChooser()
    for _ in range(MIN_SAMPLES):
        chooser.observe(4, SAMPLED, PLAIN, 4, 0.005, after=PLAIN)
    chooser.observe(4, SAMPLED, PLAIN, 4, 0.0055, after=PIPELINED)  # pays the switch
    for _ in range(PLAIN_SWITCH_STEPS - 1):
        chooser.observe(4, SAMPLED, PLAIN, 4, 0.0052, after=PLAIN)  # still paying it
    assert chooser.rates(4, SAMPLED)[PLAIN] == (200.0, MIN_SAMPLES) and chooser.switch_steps == PLAIN_SWITCH_STEPS
    chooser.observe(4, SAMPLED, PLAIN, 4, 0.005, after=PLAIN)  # settled: a sample
    assert chooser.rates(4, SAMPLED)[PLAIN] == (200.0, MIN_SAMPLES + 1)
    chooser.observe(4, SAMPLED, PIPELINED, 60, 0.090, after=PLAIN)  # 18 plain steps long: counts
    assert chooser.rates(4, SAMPLED)[PIPELINED][1] == 1 and chooser.switch_steps == PLAIN_SWITCH_STEPS
    # Another short arm's run settles sooner (SWITCH_STEPS): the policy's.
    for _ in range(MIN_SAMPLES):
        chooser.observe(4, SAMPLED, POLICY, 4, 0.006, after=POLICY)
    for step in range(SWITCH_STEPS):
        chooser.observe(4, SAMPLED, POLICY, 4, 0.0066, after=PLAIN if step == 0 else POLICY)
    assert chooser.rates(4, SAMPLED)[POLICY][1] == MIN_SAMPLES
    chooser.observe(4, SAMPLED, POLICY, 4, 0.006, after=POLICY)
    assert chooser.rates(4, SAMPLED)[POLICY][1] == MIN_SAMPLES + 1
    assert chooser.switch_steps == PLAIN_SWITCH_STEPS + SWITCH_STEPS
    # After a step the chooser did not choose (a prefill): a switch too.
    chooser.observe(4, SAMPLED, PLAIN, 4, 0.0058, after=UNCHOSEN)
    chooser.observe(4, SAMPLED, PIPELINED, 60, 0.090, after=UNCHOSEN)
    assert chooser.rates(4, SAMPLED)[PLAIN][1] == MIN_SAMPLES + 1 and chooser.rates(4, SAMPLED)[PIPELINED][1] == 2


def test_an_untimed_step_counts_in_the_run_its_successors_settle_in():
    """The engine does not time an arm's first step at a width (:meth:`skip`
    tells the chooser it ran): the plain steps after it are still paying the
    switch from the pipelined step before it, and are no samples. Untold,
    the second plain step after the switch looked settled."""
    chooser = ScheduleChooser()
    for _ in range(MIN_SAMPLES):
        chooser.observe(8, SAMPLED, PLAIN, 8, 0.0025, after=PLAIN)
    chooser.observe(8, SAMPLED, PIPELINED, 8 * 17, 0.041, after=PLAIN)
    chooser.skip(PLAIN, after=PIPELINED)  # the first plain step at this width: untimed
    for _ in range(PLAIN_SWITCH_STEPS - 1):
        chooser.observe(8, SAMPLED, PLAIN, 8, 0.0029, after=PLAIN)  # still paying the switch
    assert chooser.rates(8, SAMPLED)[PLAIN] == (400.0, MIN_SAMPLES)
    chooser.observe(8, SAMPLED, PLAIN, 8, 0.0025, after=PLAIN)  # settled: a sample
    assert chooser.rates(8, SAMPLED)[PLAIN] == (400.0, MIN_SAMPLES + 1)
    # A step of another arm in between: the untimed step starts a new run.
    chooser.skip(POLICY, after=PLAIN)
    chooser.observe(8, SAMPLED, POLICY, 8, 0.003, after=POLICY)
    assert chooser.rates(8, SAMPLED)[POLICY] == (0.0, 0)


def test_a_hold_that_began_inside_a_switch_is_no_sample():
    """A hold's steps are timed together (:meth:`credit_held`): where the
    hold began right after a switch, its span carries the settling steps'
    slowness, and is no sample of plain; a hold after settled plain steps is."""
    chooser = ScheduleChooser()
    for _ in range(MIN_SAMPLES):
        chooser.observe(8, SAMPLED, PLAIN, 8, 0.0025, after=PLAIN)
    chooser.choose(8, SAMPLED)
    chooser.observe(8, SAMPLED, PIPELINED, 8 * 17, 0.041, after=PLAIN)
    chooser.observe(8, SAMPLED, PLAIN, 8, 0.0034, after=PIPELINED)  # the chosen step of a hold: no sample
    chooser.credit_held(10, 9, 9 * 0.0027)  # its held steps, the first four still settling
    assert chooser.rates(8, SAMPLED)[PLAIN] == (400.0, MIN_SAMPLES)
    chooser.observe(8, SAMPLED, PLAIN, 8, 0.0025, after=PLAIN)  # settled by now: a sample
    chooser.credit_held(10, 9, 9 * 0.0025)
    assert chooser.rates(8, SAMPLED)[PLAIN] == (400.0, MIN_SAMPLES + 2)


def test_a_hold_s_span_pairs_only_with_samples_a_few_steps_before_its_end():
    """A hold's steps are timed as one sample at the span's end
    (:meth:`credit_held`), many steps after a sample taken before the hold:
    the span's steps count on the pairs' clock (PAIR_GAP), so that it does
    not pair with a pipelined step from before a hold of HOLD_STEPS steps."""
    chooser = ScheduleChooser()
    for _ in range(MIN_SAMPLES):
        chooser.observe(8, SAMPLED, PLAIN, 8, 0.0025, after=PLAIN)
    chooser.choose(8, SAMPLED)
    chooser.observe(8, SAMPLED, PIPELINED, 8 * 17, 0.041, after=PLAIN)  # pairs with plain's last sample
    for step in range(PLAIN_SWITCH_STEPS):  # settling: no samples
        chooser.observe(8, SAMPLED, PLAIN, 8, 0.0030, after=PIPELINED if step == 0 else PLAIN)
    chooser.observe(8, SAMPLED, PLAIN, 8, 0.0025, after=PLAIN)  # settled: pairs with the pipelined step
    pairs = chooser._keys[(3, SAMPLED, 0)].pairs[(PIPELINED, PLAIN)]
    assert len(pairs) == 2
    chooser.credit_held(HOLD_STEPS, HOLD_STEPS - 1, (HOLD_STEPS - 1) * 0.0025)
    assert chooser.rates(8, SAMPLED)[PLAIN][1] == MIN_SAMPLES + 2  # a sample of plain
    assert len(pairs) == 2  # but no pair with the pipelined step before the hold
    chooser.observe(8, SAMPLED, PIPELINED, 8 * 17, 0.041, after=PLAIN)  # one right after the span is
    assert len(pairs) == 3


def test_a_step_after_the_batch_turned_over_pairs_with_no_step_of_the_longer_rows():
    """Rows only grow, so a sample at a shorter context bucket than the
    last one's comes from a new batch: its steps are faster whatever the
    arm, and paired with the old batch's pipelined step it would rate plain
    for the rows' length (``pair_ages_d2_c4_t08_short_cd7d61e_fiftyfourth.txt``,
    plain at bucket 0 against pipelined at bucket 2). Within a batch a step
    one bucket on still pairs with the one before it."""
    bucket_2, bucket_1, bucket_0 = 2 * CONTEXT_UNIT, CONTEXT_UNIT, 0
    chooser = ScheduleChooser()
    for _ in range(MIN_SAMPLES):  # the old batch
        chooser.observe(8, SAMPLED, PLAIN, 8, 0.0030, bucket_2, after=PLAIN)
    chooser.observe(8, SAMPLED, PIPELINED, 8 * 17, 0.049, bucket_2, after=PLAIN)  # its last step, a sample
    assert chooser._keys[(3, SAMPLED, 2)].pairs[(PIPELINED, PLAIN)]
    for step in range(PLAIN_SWITCH_STEPS):  # the new batch's first plain steps: settling, no samples
        chooser.observe(8, SAMPLED, PLAIN, 8, 0.0030, bucket_0, after=PIPELINED if step == 0 else PLAIN)
    chooser.observe(8, SAMPLED, PLAIN, 8, 0.0025, bucket_0, after=PLAIN)  # one sample after the pipelined one
    assert chooser.rates(8, SAMPLED, bucket_0)[PLAIN][1] == 1
    assert not chooser._keys[(3, SAMPLED, 0)].pairs
    chooser.observe(8, SAMPLED, PIPELINED, 8 * 17, 0.041, bucket_1, after=None)  # later in the new batch
    assert len(chooser._keys[(3, SAMPLED, 1)].pairs[(PIPELINED, PLAIN)]) == 1


def test_a_pipeline_level_with_settled_plain_steps_leaves_the_steps_to_plain():
    """Width 4, short prompts, T=0.8 (``arm_rates_forced_short_c4_t08.txt``):
    plain steps take 3.0 ms in a run of them; after a pipelined step, or a
    batch's prefill, the first takes 3.5-3.6 ms, the second 3.15, the third
    3.05. Pipelined steps deliver 2% more than settled plain steps, within the
    margin. Sampled from a run's second step on, plain rated 5% low and
    the pipeline won; from its (SWITCH_STEPS + 1)th (PLAIN_SWITCH_STEPS + 1 now), plain keeps the steps."""
    plain = 0.0030
    extra = [0.00055, 0.00015, 0.00005]
    pipelined_rate = 1.02 / plain
    chooser = ScheduleChooser()
    made = []
    for _trial in range(40):
        previous, since_switch = UNCHOSEN, 0  # each trial's batch starts with its prefill
        for _ in range(40):
            choice = chooser.choose(4, SAMPLED, 300)
            if choice.arm == PIPELINED:
                tokens, step, since_switch = 4 * 17, 17 / pipelined_rate, 0
            else:  # plain, and the policy, which drafts nothing here
                tokens, step = 4, plain + (extra[since_switch] if since_switch < len(extra) else 0.0)
                since_switch += 1
            chooser.observe(4, SAMPLED, choice.arm, tokens, step, 300, after=previous)
            previous = choice.arm
            made.append(choice)
    late = made[400:]
    assert sum(c.arm == PIPELINED for c in late) <= sum(c.reason == "retry" for c in late)
    assert made[-1].arm == PLAIN


def test_a_plain_step_slowed_by_the_switch_does_not_make_a_slower_pipeline_win():
    """As measured (``benchmarks/probes/arm_rates_forced.py``, width 4, long
    prompts, T=0.8): plain steps 4.66 ms, the first after a pipelined step
    5.5 ms; pipelined steps 87 ms for 17 tokens per request. Plain steps
    deliver 215 tok/s per request, the pipeline 195; rated on plain steps
    that follow pipelined ones, plain would look like 182."""
    chooser = ScheduleChooser()
    tokens = {PLAIN: 1.0, POLICY: 1.0, PIPELINED: 17.0}
    seconds = {PLAIN: 0.00466, POLICY: 0.00470, PIPELINED: 0.0872}
    previous, made = None, []
    for _ in range(600):
        choice = chooser.choose(4, SAMPLED, 300)
        step = seconds[choice.arm] + (0.00084 if previous not in (None, choice.arm) and choice.arm != PIPELINED else 0)
        chooser.observe(4, SAMPLED, choice.arm, 4 * tokens[choice.arm], step, 300, after=previous)
        previous = choice.arm
        made.append(choice)
    assert made[-1].arm == PLAIN and sum(c.arm == PLAIN and c.reason == "faster" for c in made) > 500
    assert abs(chooser.rates(4, SAMPLED, 300)[PLAIN][0] - 1 / 0.00466) < 1.0
    # Measured in streaks: each arm's run of measuring steps is unbroken.
    measuring = [c.arm for c in made if c.reason == "measure"]
    assert sum(a != b for a, b in zip(measuring, measuring[1:])) == len(ARMS) - 1


def test_a_long_arm_in_flight_is_not_measured_again_before_it_is_observed():
    """Steps are observed at the next step's start: a second slow pipelined
    step chosen before the first is seen would be paid for nothing when
    the first already shows it losing."""
    chooser = ScheduleChooser()
    for _ in range(MIN_SAMPLES):
        chooser.observe(16, SAMPLED, PLAIN, 16, 0.006, after=PLAIN)
        chooser.observe(16, SAMPLED, POLICY, 16, 0.007, after=POLICY)
    chooser.observe(1, GREEDY, PIPELINED, 17, 0.040, after=PIPELINED)  # long, elsewhere
    assert chooser.choose(16, SAMPLED) == ScheduleChoice(PIPELINED, "measure")
    # The pipelined step is in flight: meanwhile the best measured arm.
    assert chooser.choose(16, SAMPLED, in_flight=PIPELINED) == ScheduleChoice(PLAIN, "measure")
    chooser.observe(16, SAMPLED, PIPELINED, 16 * 17, 0.150, after=POLICY)  # long: counts after the switch
    chooser.observe(16, SAMPLED, PLAIN, 16, 0.006, after=PIPELINED)
    assert chooser.choose(16, SAMPLED) == ScheduleChoice(PLAIN, "faster")  # one step showed the loss


def _run_as_the_engine(chooser, width, mix, step, steps, context=0, previous=None):
    """Choices as the engine makes them: the step that just ran is observed
    after the next is chosen (at the next step's start), and the chooser is
    told its arm. ``step(arm, previous arm)``: its (committed tokens,
    seconds)."""
    made, pending = [], None
    for _ in range(steps):
        in_flight = pending[0] if pending else None
        choice = chooser.choose(width, mix, context, in_flight)
        if pending:
            arm, after, tokens, seconds = pending
            chooser.observe(width, mix, arm, tokens, seconds, context, after=after)
        tokens, seconds = step(choice.arm, previous)
        pending, previous = (choice.arm, previous, tokens, seconds), choice.arm
        made.append(choice)
    return made


def test_two_long_arms_alternating_are_measured_not_dropped_as_switch_steps():
    """Width 4, long prompts, greedy (``benchmarks/probes/auto_trace.py``):
    plain 4.4 ms a step; the policy's rounds 38 ms for 13 tokens a request;
    pipelined steps 62 ms for 17. At a key where plain and the policy are
    measured, the pipeline's steps alternate with the policy's (its step in
    flight is not followed by another). When a step after a switch counted
    only if long against the other arm's step, each dropped the other's as
    a switch step: measuring went on to the end of the batch."""
    chooser = ScheduleChooser()
    steps = {PLAIN: (4, 0.0044), POLICY: (4 * 13, 0.038), PIPELINED: (4 * 17, 0.062)}
    for arm in (PLAIN, POLICY):
        for _ in range(MIN_SAMPLES + 1):
            chooser.observe(4, GREEDY, arm, *steps[arm], 600, after=arm)
    chooser.observe(1, GREEDY, PIPELINED, 17, 0.040, after=PIPELINED)  # long, elsewhere
    made = _run_as_the_engine(chooser, 4, GREEDY, lambda arm, previous: steps[arm], 100, context=600,
                              previous=POLICY)
    # Two pipelined steps (a long arm's half measure), the policy's between them.
    assert sum(c.reason == "measure" for c in made) <= 4, [c.arm[:3] for c in made[:30]]
    assert made[-1] == ScheduleChoice(POLICY, "faster")
    assert abs(chooser.rates(4, GREEDY, 600)[PIPELINED][0] - 17 / 0.062) < 1.0


def test_a_long_step_after_a_switch_counts_at_a_key_new_to_the_other_arm():
    """At a key where plain has no steps yet, a pipelined step after a plain
    one is still long against plain's last step elsewhere: it counts (else
    the pipeline is measured again and again)."""
    chooser = ScheduleChooser()
    chooser.observe(1, GREEDY, PLAIN, 1, 0.004, after=PLAIN)
    chooser.observe(17, SAMPLED, PIPELINED, 17 * 17, 0.150, context=80, after=PLAIN)
    assert chooser.rates(17, SAMPLED, 80)[PIPELINED][1] == 1 and chooser.switch_steps == 0


def test_pairs_of_adjacent_steps_outweigh_windows_measured_at_other_speeds():
    """The machine's speed drifts by tens of percent over seconds; a loser's
    window holds its tries from a slow spell and the winner's its recent
    steps from a fast one. Pairs of steps a few apart see one speed."""
    chooser = ScheduleChooser()

    def steps(arm, rate, seconds, n):
        for _ in range(n):
            chooser.observe(4, GREEDY, arm, 4 * rate * seconds, seconds)

    steps(PIPELINED, 280.0, 0.04, MIN_SAMPLES)  # in a slow spell (1.5x: within PAIRS_AGREE)
    steps(POLICY, 100.0, 0.02, MIN_SAMPLES + 1)
    steps(PLAIN, 300.0, 0.01, 2 * MIN_SAMPLES)  # at full speed
    assert chooser.choose(4, GREEDY).arm == PLAIN  # no pair of pipelined and plain steps yet
    # Tries of the pipeline at full speed, each next to plain steps: their
    # pairs say 1.4x plain though the pipeline's window still holds slow steps.
    for _ in range(3):
        steps(PIPELINED, 420.0, 0.04, 1)
        steps(PLAIN, 300.0, 0.01, 1)
    assert chooser.rates(4, GREEDY)[PIPELINED][0] < 300.0  # by its window, it still loses
    assert chooser.choose(4, GREEDY).arm == PIPELINED


def _pairs_of(chooser, width, mix, first, second, n):
    """``n`` alternating steps of two arms at their rates (tokens/s, seconds): pairs."""
    for _ in range(n):
        for arm, (rate, seconds) in (first, second):
            chooser.observe(width, mix, arm, width * rate * seconds, seconds)


def test_pairs_made_before_the_text_turned_hard_do_not_keep_a_slowed_winner(monkeypatch):
    """Greedy width 1: the policy's rounds ran at 1000 tokens/s on easy text
    and their pairs with the pipeline said 1.4x; the text turns hard and the
    rounds run at 350, under the pipeline's 700. The policy's rate moved 3x
    since the pairs: they are dropped and the rates decide within half a
    window (the pairs kept it "faster" for 30 steps in the twenty-ninth
    session, until a pipelined try was due)."""
    monkeypatch.setattr(schedule_choice, "PAIRS_AGREE", float("inf"))  # this rule alone

    def run(stale):
        monkeypatch.setattr(schedule_choice, "PAIRS_STALE", stale)
        chooser = ScheduleChooser()
        arms = {PLAIN: (400.0, 0.0025), POLICY: (1000.0, 0.017), PIPELINED: (700.0, 0.024)}
        for arm, (rate, seconds) in arms.items():
            _pairs_of(chooser, 1, GREEDY, (arm, (rate, seconds)), (PLAIN, arms[PLAIN]), MIN_SAMPLES)
        _pairs_of(chooser, 1, GREEDY, (POLICY, arms[POLICY]), (PIPELINED, arms[PIPELINED]), MIN_SAMPLES)
        assert chooser.choose(1, GREEDY) == ScheduleChoice(POLICY, "faster")
        hard = {PLAIN: 400.0, POLICY: 350.0, PIPELINED: 700.0}
        return _run(chooser, 1, GREEDY, hard, 40, seconds={PLAIN: 0.0025, POLICY: 0.006, PIPELINED: 0.024})

    made = run(schedule_choice.PAIRS_STALE)
    first = made.index(ScheduleChoice(PIPELINED, "faster"))
    assert first <= RATE_WINDOW // 2 + 1
    assert ScheduleChoice(POLICY, "faster") not in made[first:]
    made = run(float("inf"))
    assert ScheduleChoice(PIPELINED, "faster") not in made[:30]


def test_pairs_are_anchored_on_a_rate_of_the_keys_own_steps(monkeypatch):
    """Greedy width 8, as a long-prompt batch met it after the short
    prompts' cells: every arm borrowed at its first context bucket, then
    one policy step there (slow: the text is not the short prompts') and
    plain steps right after it (three pairs: plain 1.07x the policy). The
    policy's window is still mostly its borrowed steps (390). Anchored on
    it, the pairs rated plain 417 and plain beat the pipeline's 253 (its
    borrowed steps, moved with plain's own); anchored on plain's own rate,
    the policy rates 215 and the pipeline wins
    (``sweep_replay_trace_d2_fortythird.txt``)."""
    monkeypatch.setattr(schedule_choice, "PAIRS_AGREE", float("inf"))  # this rule alone

    def run(anchor_on_own_steps):
        if not anchor_on_own_steps:
            monkeypatch.setattr(schedule_choice, "_rests_on_own_steps", lambda rate: True)
        chooser = ScheduleChooser()
        for arm, rate, seconds in ((PLAIN, 300.0, 0.004), (POLICY, 390.0, 0.02), (PIPELINED, 330.0, 0.06)):
            for _ in range(MIN_SAMPLES):
                chooser.observe(8, GREEDY, arm, 8 * rate * seconds, seconds, context=150)
        chooser.choose(8, GREEDY, context=300)  # the next context bucket borrows every arm
        chooser.observe(8, GREEDY, POLICY, 8 * 215.0 * 0.02, 0.02, context=300)
        for _ in range(MIN_PAIRS):
            chooser.observe(8, GREEDY, PLAIN, 8 * 230.0 * 0.004, 0.004, context=300)
        rates = chooser.rates(8, GREEDY, 300)
        assert rates[POLICY][0] == 390.0 and rates[PLAIN] == (230.0, MIN_PAIRS)
        assert abs(rates[PIPELINED][0] - 330.0 * 230 / 300) < 1e-6
        return chooser.choose(8, GREEDY, context=300)

    assert run(anchor_on_own_steps=True) == ScheduleChoice(PIPELINED, "faster")
    assert run(anchor_on_own_steps=False).arm == PLAIN


def test_pairs_that_disagree_with_an_arms_own_rate_beyond_the_drift_do_not_rate_it(monkeypatch):
    """Greedy width 1, as traced at short c1 (d1): the policy's rounds
    declined on hard text, so its own steps run at plain's 387 tokens/s;
    its pairs with the pipeline (732) mix three made on easy text (1.21x)
    with two made since (0.62x), and their median rated it 886. The
    rating is 2.3x its own rate, past the machine's drift
    (:data:`~vllm_loopspec.speculative.schedule_choice.PAIRS_AGREE`): the own rate
    decides and the pipeline runs (it ran the policy's declined rounds for
    45 steps, ``sweep_replay_trace_d1_c1_fortyfourth.txt``). A pairs rating
    within the drift still decides."""
    def best(pairs_ratio=None, policy_rate=387.0, agree=schedule_choice.PAIRS_AGREE):
        monkeypatch.setattr(schedule_choice, "PAIRS_AGREE", agree)
        chooser = ScheduleChooser()
        for arm, rate, seconds in ((PLAIN, 381.0, 0.0026), (POLICY, policy_rate, 0.0026), (PIPELINED, 732.0, 0.02)):
            for _ in range(RATE_WINDOW):
                chooser.observe(1, GREEDY, arm, rate * seconds, seconds)
        (key,) = chooser._keys.values()
        ratios = [1.21] * 3 + [0.62] * 2 if pairs_ratio is None else [pairs_ratio] * MIN_PAIRS
        key.pairs = {(POLICY, PIPELINED): deque(math.log(r) for r in ratios),
                     (PIPELINED, POLICY): deque(-math.log(r) for r in ratios)}
        return schedule_choice._winner(key)

    assert best() == PIPELINED
    assert best(agree=float("inf")) == POLICY
    # Within the drift the pairs still overrule the own rate: 1.1 of 732
    # (805) against an own 600, which alone loses to the pipeline.
    assert best(pairs_ratio=1.1, policy_rate=600.0) == POLICY
    assert best(pairs_ratio=0.9, policy_rate=600.0) == PIPELINED


def test_steps_that_committed_nothing_leave_the_pairs_alone():
    chooser = ScheduleChooser()
    _pairs_of(chooser, 1, GREEDY, (POLICY, (500.0, 0.01)), (PLAIN, (400.0, 0.003)), MIN_SAMPLES)
    for _ in range(RATE_WINDOW):
        chooser.observe(1, GREEDY, POLICY, 0, 0.01)  # a window of rates of 0
    assert chooser.rates(1, GREEDY)[POLICY][0] == 0.0
    (key,) = chooser._keys.values()
    assert key.pairs.get((POLICY, PLAIN))  # a rate of 0 is no change of workload: the pairs stay


def test_with_several_depths_each_arm_at_each_depth_is_measured_and_the_fastest_taken():
    """``draft_loops`` as a list: the policy's and the pipelined arm at each
    depth are arms of their own; a step runs at the depth whose arm has
    delivered the most."""
    arms = schedule_choice.arms_for_depths([1, 2])
    assert arms == (PLAIN, "policy@1", "policy@2", "pipelined@1", "pipelined@2")
    assert schedule_choice.arms_for_depths([2]) == ARMS
    assert [schedule_choice.arm_kind(a) for a in arms] == [PLAIN, POLICY, POLICY, PIPELINED, PIPELINED]
    assert [schedule_choice.arm_depth(a, 3) for a in arms] == [3, 1, 2, 1, 2]
    chooser = ScheduleChooser(arms)
    rates = {PLAIN: 300.0, "policy@1": 420.0, "policy@2": 520.0, "pipelined@1": 480.0, "pipelined@2": 450.0}
    made = _run(chooser, 4, GREEDY, rates, len(arms) * MIN_SAMPLES)
    assert all(c.reason == "measure" for c in made)
    assert made[0].arm.startswith(POLICY)  # a policy's warm-up first
    assert {arm: sum(c.arm == arm for c in made) for arm in arms} == {arm: MIN_SAMPLES for arm in arms}
    # Four losers share the tries' time (RETRY_TIME_SHARE): each is tried
    # within 36 / RETRY_TIME_SHARE steps here (plain, the one whose try is
    # seven steps, last).
    later = _run(chooser, 4, GREEDY, rates, int(36 / RETRY_TIME_SHARE))
    assert [c.arm for c in later if c.reason == "faster"] == ["policy@2"] * sum(c.reason == "faster" for c in later)
    assert {c.arm for c in later if c.reason == "retry"} == set(arms) - {"policy@2"}
    assert ScheduleChoice("pipelined@2", "faster").pipelined


def _spreading_rounds(lag):
    """A chooser that met width 1 (a row alone at best 500 tokens/s: 2 ms a
    token), then 200 steps at width 16 where the policy's rounds commit the
    most tokens per request but add ``lag`` tokens of lag each; the arms
    chosen there, and the chooser."""
    chooser = ScheduleChooser()
    _run(chooser, 1, GREEDY, {PLAIN: 400.0, POLICY: 450.0, PIPELINED: 500.0}, 3 * MEASURE)
    rates = {PLAIN: 200.0, POLICY: 290.0, PIPELINED: 250.0}
    seconds = {PLAIN: 0.005, POLICY: 0.03, PIPELINED: 0.06}
    made = []
    for _ in range(200):
        arm = chooser.choose(16, GREEDY).arm
        made.append(arm)
        chooser.observe(16, GREEDY, arm, rates[arm] * seconds[arm] * 16, seconds[arm],
                        lag=lag if arm == POLICY else 0.0)
    return made, chooser


def test_a_round_that_spreads_its_batch_is_charged_its_lag_at_one_rows_cost():
    # Without lag the rounds win; each adding 5 tokens of lag, their tokens
    # cost 5 x (2 ms - the step's 0.22 ms a token) more: the pipeline wins.
    made, _ = _spreading_rounds(0.0)
    assert made[-100:].count(POLICY) > 90
    made, chooser = _spreading_rounds(5.0)
    assert made[-100:].count(PIPELINED) > 80 and made[-100:].count(POLICY) < 5  # the rest: plain tries
    per_token = 0.03 / (290.0 * 0.03 * 16)
    charge = 5.0 * (1 / 500.0 - per_token) / 0.03
    assert chooser.rates(16, GREEDY)[POLICY][0] == pytest.approx(290.0 / (1 + charge))
    # Rounds that narrow the spread are credited, up to LAG_CREDIT.
    _, chooser = _spreading_rounds(-1000.0)
    assert chooser.rates(16, GREEDY)[POLICY][0] == pytest.approx(290.0 / (1 - schedule_choice.LAG_CREDIT))
