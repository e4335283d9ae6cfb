"""The policy replay's pieces (``benchmarks/probes/policy_sim.py`` and
``greedy_acceptance_traces.py``): a round's outcome read from a trace, and
a trial's steps under fixed K and under the real controller."""
import random
import sys
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parents[1] / "benchmarks" / "probes"
sys.path.insert(0, str(PROBES))

import greedy_acceptance_traces as traces  # noqa: E402
import policy_sim  # noqa: E402

from vllm_loopspec.speculative.adaptive import AdaptiveController  # noqa: E402
from vllm_loopspec.speculative.policy import StepCosts  # noqa: E402

COSTS = StepCosts(plain=(0.005, 0.0001), spec=(0.007, 0.0013, 0.0, 0.00025))


def test_runs_count_the_drafts_a_round_would_accept():
    # Depth-d argmax agrees with the committed token at these positions.
    assert traces.runs_of([True, True, False, True, False, False]) == [2, 1, 0, 1, 0, 0]
    assert traces.runs_of([True] * 40)[0] == traces.MAX_RUN


def _trial(runs, new_tokens):
    return policy_sim.Trial([{"runs": {"2": runs}, "prompt_tokens": 10}], 2, new_tokens, "t")


@pytest.mark.parametrize("k, steps", [(0, 20), (1, 10), (4, 4), (8, 3)])
def test_fixed_k_commits_accepted_drafts_plus_one_per_step(k, steps):
    trial = _trial([32] * 20, 20)
    seen = []

    def choose(live, limits, t):
        seen.append(list(t))
        return [min(k, lim) for lim in limits]

    trial.run(choose, COSTS, random.Random(0), 0.0, 16)
    assert len(seen) == steps


def test_a_rejected_draft_commits_the_bonus_token_only():
    # Every other position agrees: a one-draft round commits 2 where it
    # starts on an agreeing position, 1 where it does not.
    trial = _trial([0, 1, 0, 1, 0, 1, 0, 1], 8)
    starts = []

    def choose(live, limits, t):
        starts.append(t[0])
        return [min(1, lim) for lim in limits]

    trial.run(choose, COSTS, random.Random(0), 0.0, 16)
    assert starts == [0, 1, 3, 5, 7]


def test_the_controller_drafts_deep_for_a_request_that_accepts_everything():
    controller = AdaptiveController(max_k=8, start_k=4)
    drafts = []
    for n in range(6):
        trial = _trial([32] * 128, 128)
        trial.ids = [f"r{n}"]

        def policy(live, limits, t, trial=trial):
            out, _ = controller.plan([(trial.ids[0], False, limits[0])], context=10 + t[0])
            drafts.append((n, limits[0], out[0]))
            return list(out)

        trial.run(policy, COSTS, random.Random(n), 0.0, 8, controller)
    # After warm-up, the last request's rounds draft all the budget allows
    # (an exploration step may try a neighbour).
    last = [k for n, limit, k in drafts if n == 5 and limit == 8]
    assert len(last) >= 10 and sum(k >= 7 for k in last) >= 0.8 * len(last), drafts
