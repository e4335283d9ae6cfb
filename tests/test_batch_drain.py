"""The lag a step adds to its batch (:mod:`vllm_loopspec.speculative.batch_drain`)
and what the drafter hands the chooser, without an engine."""

import pytest

from vllm_loopspec.speculative.batch_drain import lag_growth


def test_rows_that_keep_pace_add_no_lag():
    assert lag_growth([16, 16, 16, 16], [112, 40, 7, 90]) == pytest.approx(0.0)
    assert lag_growth([1, 1, 1], [5, 5, 5]) == pytest.approx(0.0)


def test_a_row_that_falls_behind_the_one_with_most_left_adds_its_shortfall():
    # Equal work left before (128 each); seven commit 16, the eighth 5.
    # Spread after: 123 - (7 * 112 + 123) / 8; before: 0.
    assert lag_growth([16] * 7 + [5], [112] * 7 + [123]) == pytest.approx(123 - (7 * 112 + 123) / 8)


def test_a_lagging_row_that_catches_up_takes_lag_back():
    # Before: 100 and 60 left (spread 20); the lagging row commits 16, the other 2.
    assert lag_growth([16, 2], [84, 58]) == pytest.approx((84 - 71) - (100 - 80))
    assert lag_growth([16, 2], [84, 58]) < 0


def test_equal_commits_add_none_as_a_row_finishes_and_a_row_pulling_ahead_adds_lag():
    assert lag_growth([3, 3, 3, 3], [97, 97, 97, 0]) == pytest.approx(0.0)
    # One row racing ahead leaves the others to a narrower batch later, as
    # one falling behind does: before 17/100/100/100 left, after 0/97/97/97.
    assert lag_growth([17, 3, 3, 3], [0, 97, 97, 97]) == pytest.approx((97 - 72.75) - (100 - 79.25))


def test_one_row_is_neutral():
    assert lag_growth([3], [100]) == 0.0


def _drafter_with(requests):
    """A drafter with only what ``_lag_added`` reads: the runner's requests."""
    from types import SimpleNamespace

    from vllm_loopspec.speculative.drafter import LoopSpecDrafter

    drafter = LoopSpecDrafter.__new__(LoopSpecDrafter)
    drafter.runner = SimpleNamespace(requests=requests, model_config=SimpleNamespace(max_model_len=1024))
    return drafter


def test_the_drafter_hands_a_rounds_lag_to_the_chooser_and_none_for_a_plain_step():
    from types import SimpleNamespace

    params = SimpleNamespace(max_tokens=128)
    # After a round: three rows committed 17 (27 tokens out), one 2 (12 out).
    requests = {r: SimpleNamespace(prompt_token_ids=[0] * 8, output_token_ids=[0] * (12 if r == "d" else 27),
                                   sampling_params=params) for r in "abcd"}
    drafter = _drafter_with(requests)
    lag = drafter._lag_added("policy", list("abcd"), [17, 17, 17, 2])
    assert lag == pytest.approx(lag_growth([17, 17, 17, 2], [101, 101, 101, 116]))
    assert lag == pytest.approx(116 - (3 * 101 + 116) / 4)
    assert drafter._lag_added("plain", list("abcd"), [17, 17, 17, 2]) == 0.0
    # A row that committed nothing (a partial prefill chunk) is left out.
    assert drafter._lag_added("policy", list("abc"), [17, 17, 17]) == pytest.approx(0.0)
    assert drafter._lag_added("policy", list("abcd"), [17, 17, 17, 0]) == pytest.approx(0.0)
    # Async: a step is counted one step late, when a request that finished
    # in it is gone from the runner: it has nothing left.
    del requests["a"]
    assert drafter._lag_added("policy", list("abcd"), [17, 17, 17, 2]) == pytest.approx(
        lag_growth([17, 17, 17, 2], [0, 101, 101, 116]))
