"""``"schedule": "auto"``'s chooser on synthetic measurements (no engine)."""

from vllm_loopspec.speculative.adaptive import GREEDY, SAMPLED
from vllm_loopspec.speculative.schedule_choice import MIN_SAMPLES, RETRY_BACKOFF, ScheduleChooser


def _run(chooser, width, mix, rates, steps, tokens=10):
    """``steps`` decisions at one key, each observed at its arm's rate
    (tokens per second, by pipelined?); the choices made."""
    made = []
    for _ in range(steps):
        choice = chooser.choose(width, mix)
        made.append(choice)
        chooser.observe(width, mix, choice.pipelined, tokens, tokens / rates[choice.pipelined])
    return made


def test_measures_both_arms_then_takes_the_faster():
    chooser = ScheduleChooser()
    made = _run(chooser, 1, GREEDY, {True: 500.0, False: 300.0}, 2 * MIN_SAMPLES)
    assert all(c.reason == "measure" for c in made)
    assert sum(c.pipelined for c in made) == MIN_SAMPLES
    later = _run(chooser, 1, GREEDY, {True: 500.0, False: 300.0}, 8)
    assert all(c.pipelined and c.reason == "faster" for c in later)
    rates = chooser.rates(1, GREEDY)
    assert abs(rates[True][0] - 500.0) < 1e-6 and abs(rates[False][0] - 300.0) < 1e-6


def test_the_pipeline_must_beat_the_policy_by_the_margin():
    chooser = ScheduleChooser()
    _run(chooser, 8, SAMPLED, {True: 1010.0, False: 1000.0}, 2 * MIN_SAMPLES)
    later = _run(chooser, 8, SAMPLED, {True: 1010.0, False: 1000.0}, 8)
    assert not any(c.pipelined for c in later)


def test_widths_and_mixes_are_measured_apart():
    chooser = ScheduleChooser()
    _run(chooser, 1, GREEDY, {True: 500.0, False: 300.0}, 2 * MIN_SAMPLES)
    _run(chooser, 16, SAMPLED, {True: 800.0, False: 1000.0}, 2 * MIN_SAMPLES)
    assert all(c.pipelined for c in _run(chooser, 1, GREEDY, {True: 500.0, False: 300.0}, 4))
    assert not any(c.pipelined for c in _run(chooser, 16, SAMPLED, {True: 800.0, False: 1000.0}, 4))
    # A width of a new bucket starts with its neighbour's winner.
    first = chooser.choose(2, GREEDY)
    assert first.pipelined and first.reason == "measure"


def test_the_loser_is_retried_less_and_less_often_and_can_win_back():
    chooser = ScheduleChooser()
    rates = {True: 300.0, False: 500.0}
    made = _run(chooser, 4, GREEDY, rates, 2 * MIN_SAMPLES + 200)
    retries = [i for i, c in enumerate(made) if c.reason == "retry"]
    assert retries and all(made[i].pipelined for i in retries)
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > RETRY_BACKOFF[0]
    # The machine changes: the pipeline becomes the faster arm; retries find it.
    rates = {True: 900.0, False: 500.0}
    made = _run(chooser, 4, GREEDY, rates, 600)
    assert made[-1].pipelined and made[-1].reason == "faster"


def test_no_rate_without_time():
    chooser = ScheduleChooser()
    chooser.observe(1, GREEDY, True, 5, 0.0)
    assert chooser.rates(1, GREEDY) == {}
