"""The chooser's drain factor (:mod:`vllm_loopspec.speculative.batch_drain`),
without an engine."""

import pytest

from vllm_loopspec.speculative.batch_drain import PRIOR_STEPS, DrainPaces, drain_factor


def test_rows_that_keep_pace_drain_at_the_steps_rate():
    assert drain_factor([16, 16, 16, 16], [128, 40, 7, 90]) == pytest.approx(1.0)
    assert drain_factor([1, 1, 1], [5, 5, 5]) == pytest.approx(1.0)


def test_a_lagging_row_with_work_left_lowers_the_rate():
    # Seven rows commit 16 a round, one commits 5, all with 128 tokens left:
    # proportional-cost drain time is sum(R_i / e_i), the harmonic mean.
    factor = drain_factor([16] * 7 + [5], [128] * 8)
    harmonic = 8 / (7 / 16 + 1 / 5)
    assert factor == pytest.approx(harmonic / ((7 * 16 + 5) / 8))
    assert factor < 0.9


def test_a_lagging_row_about_to_finish_does_not():
    lagging_done = drain_factor([16] * 7 + [5], [128] * 7 + [1])
    lagging_with_work = drain_factor([16] * 7 + [5], [128] * 8)
    assert lagging_done > 0.99 > lagging_with_work


def test_one_row_or_nothing_left_is_neutral():
    assert drain_factor([3], [100]) == 1.0
    assert drain_factor([3, 9], [0, 0]) == 1.0


def test_paces_are_lasting_not_one_steps_draw():
    paces = DrainPaces()
    rows = ["a", "b", "c", "d"]
    # Each row in turn has one unlucky round; over the rounds they keep pace.
    factors = []
    for step in range(12):
        committed = [2 if i == step % 4 else 12 for i in range(4)]
        factors.append(paces.rate_factor("policy", rows, committed, [100] * 4))
    per_step = drain_factor([2, 12, 12, 12], [100] * 4)
    assert factors[-1] > 0.9 > per_step
    # One row that lags round after round lowers the rate more and more.
    slow = DrainPaces()
    trend = [slow.rate_factor("policy", rows, [2, 12, 12, 12], [100] * 4) for _ in range(12)]
    assert trend[0] > trend[-1] and trend[-1] < 0.75


def test_a_new_request_starts_at_the_steps_mean():
    paces = DrainPaces()
    factor = paces.rate_factor("policy", ["a", "b"], [1, 9], [50, 50])
    # Each pace is (own + PRIOR_STEPS * mean) / (1 + PRIOR_STEPS).
    mean = 5
    a, b = ((1 + PRIOR_STEPS * mean) / (1 + PRIOR_STEPS), (9 + PRIOR_STEPS * mean) / (1 + PRIOR_STEPS))
    assert factor == pytest.approx(drain_factor([a, b], [50, 50]))


def test_arms_are_paced_apart_and_finished_requests_forgotten():
    paces = DrainPaces()
    for _ in range(6):
        paces.rate_factor("policy", ["a", "b"], [1, 9], [50, 50])
    assert paces.rate_factor("pipelined", ["a", "b"], [5, 5], [50, 50]) == pytest.approx(1.0)
    paces.forget(["b"])
    # "a" is new again: its pace is the step's mean; "b" keeps its nine-token rounds.
    b = (6 * 9 + 5 + PRIOR_STEPS * 5) / (7 + PRIOR_STEPS)
    assert paces.rate_factor("policy", ["a", "b"], [5, 5], [50, 50]) == pytest.approx(drain_factor([5, b], [50, 50]))


def _drafter_with(requests):
    """A drafter with only what ``_drain_rated`` reads: the runner's requests."""
    from types import SimpleNamespace

    from vllm_loopspec.speculative.drafter import LoopSpecDrafter

    drafter = LoopSpecDrafter.__new__(LoopSpecDrafter)
    drafter.drain = DrainPaces()
    drafter.runner = SimpleNamespace(requests=requests, model_config=SimpleNamespace(max_model_len=1024))
    return drafter


def test_the_drafter_rates_a_lagging_round_below_its_tokens_and_a_plain_step_at_them():
    from types import SimpleNamespace

    params = SimpleNamespace(max_tokens=128)
    requests = {r: SimpleNamespace(prompt_token_ids=[0] * 8, output_token_ids=[0] * 10, sampling_params=params)
                for r in "abcd"}
    drafter = _drafter_with(requests)
    for _ in range(6):
        rated = drafter._drain_rated("policy", list("abcd"), [17, 17, 17, 2])
    assert rated < 0.8 * 53
    assert drafter._drain_rated("plain", list("abcd"), [17, 17, 17, 2]) == 53
    # Async: a step is counted one step late, when a request that finished
    # in it is gone from the runner; it has no tokens left, so only the
    # others' paces count.
    del requests["d"]
    assert drafter._drain_rated("policy", list("abcd"), [17, 17, 17, 2]) > 53
