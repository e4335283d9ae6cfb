"""The adaptive policy without an engine: decisions on synthetic
measurements (issue 13)."""

import numpy as np
import pytest

from vllm_loopspec.speculative.adaptive import (EXPLORE_EVERY, GREEDY, SAMPLED, SKIP_LOW_ACCEPTANCE, SKIP_WIDTH_CAP,
                                                AdaptiveController)
from vllm_loopspec.speculative.policy import (Candidate, StepCosts, decide, expected_tokens, fit_linear,
                                              later_rates, rearm_width, seeded_costs, shape_medians, width_cap)

# A CPU-like engine: a step costs mostly its fixed overhead; a draft tick a
# fraction of it; rows are cheap until the batch is wide.
CPU_LIKE = StepCosts(plain=(0.005, 0.0002), spec=(0.006, 0.0012, 0.0002, 0.0002))
HIGH = (0.9,) * 8
LOW = (0.2,) * 8


def ks(decision):
    return list(decision.drafts)


def test_expected_tokens_is_one_plus_the_acceptance_chain():
    assert expected_tokens((0.5, 0.5, 0.5), 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens((1.0, 0.0, 1.0), 3) == pytest.approx(2.0)


def test_higher_acceptance_drafts_more():
    high = decide([Candidate(HIGH, 8)], CPU_LIKE, 8)
    mid = decide([Candidate((0.6,) * 8, 8)], CPU_LIKE, 8)
    assert max(ks(high)) > max(ks(mid)) > 0
    assert high.rate > high.plain_rate


def test_expensive_draft_ticks_draft_less():
    cheap = decide([Candidate(HIGH, 8)], CPU_LIKE, 8)
    dear = decide([Candidate(HIGH, 8)], StepCosts(CPU_LIKE.plain, (0.006, 0.003, 0.0002, 0.0002)), 8)
    assert 0 < max(ks(dear)) < max(ks(cheap))


def test_decision_respects_each_request_limit_and_the_bound():
    d = decide([Candidate(HIGH, 8), Candidate(HIGH, 2), Candidate(HIGH, 0)], CPU_LIKE, 5)
    assert ks(d)[1] <= 2 and ks(d)[2] == 0 and max(ks(d)) <= 5


def test_worthless_row_gets_no_drafts_beside_good_ones():
    d = decide([Candidate(HIGH, 8)] * 3 + [Candidate((0.01,) * 8, 8)], CPU_LIKE, 8)
    assert all(k > 0 for k in ks(d)[:3]) and ks(d)[3] == 0


# Costs as this machine's fit at width 16 (d=2): a draft tick dear, a row
# cheap beside it.
WIDE = StepCosts(plain=(0.0055, 0.00055), spec=(0.0024, 0.0041, 0.00027, 0.0))


def test_a_row_that_would_be_left_behind_keeps_its_drafts():
    """Trimmed at the step's rate, three mediocre rows among thirteen good
    ones would decode one token a step while the others commit several, and
    finish alone in narrow plain steps; priced at that later rate they draft.
    Rows that finish first anyway are trimmed as before."""
    batch = [Candidate((0.97,) * 8, 8)] * 13 + [Candidate((0.6,) * 8, 8)] * 3
    myopic = decide(batch, WIDE, 8)
    assert all(ks(myopic)[:13]) and ks(myopic)[13:] == [0, 0, 0]
    behind = later_rates(batch, [160] * 16, WIDE)
    assert np.allclose(behind, 1 / WIDE.plain_step(1))
    assert all(ks(decide(batch, WIDE, 8, later_rates=behind)))
    ahead = later_rates(batch, [160] * 13 + [10] * 3, WIDE)
    assert np.isinf(ahead[13:]).all() and np.isfinite(ahead[:13]).all()
    assert ks(decide(batch, WIDE, 8, later_rates=ahead)) == ks(myopic)


def test_later_rates_of_a_lone_request_leave_the_step_rate():
    assert np.isinf(later_rates([Candidate(HIGH, 8)], [100], WIDE)).all()


def test_zero_acceptance_batch_decodes_plainly():
    d = decide([Candidate((0.0,) * 8, 8)] * 4, CPU_LIKE, 8)
    assert d.plain and d.rate == d.plain_rate


def test_width_cap_is_where_plain_wins():
    cap = width_cap(CPU_LIKE, (0.7,) * 8, 8, 256)
    assert cap is not None and cap > 1
    assert not decide([Candidate((0.7,) * 8, 8)] * (cap - 1), CPU_LIKE, 8).plain
    assert decide([Candidate((0.7,) * 8, 8)] * cap, CPU_LIKE, 8).plain
    assert width_cap(CPU_LIKE, (0.0,) * 8, 8, 256) == 1
    assert 1 <= rearm_width(cap) < cap
    assert rearm_width(1) == 0


def test_fit_recovers_costs_despite_outliers():
    rng = np.random.default_rng(0)
    true = np.array([0.006, 0.0012, 0.0002, 0.0002])
    rows = []
    for _ in range(400):  # the shapes an engine sees: a few K at a few widths
        k, b = rng.choice([1, 2, 4, 8]), rng.choice([1, 4, 8])
        tokens = b * (1 + k)
        seconds = true @ [1, k, k * b, tokens] * rng.normal(1.0, 0.02)
        if rng.random() < 0.05:
            seconds *= 20  # another process took the cores
        rows.append((k, b, tokens, seconds))
    shapes, medians, counts = shape_medians(np.array(rows))
    x = np.column_stack([np.ones(len(shapes)), shapes[:, 0], shapes[:, 0] * shapes[:, 1], shapes[:, 2]])
    coef = fit_linear(x, medians, counts)
    assert np.allclose(coef, true, rtol=0.25, atol=2e-5), coef


def test_fit_never_returns_negative_costs():
    x = np.column_stack([np.ones(6), np.arange(6.0)])
    assert (fit_linear(x, 0.01 - 0.001 * np.arange(6.0)) >= 0).all()


# -- the controller, fed a synthetic engine ---------------------------------------

def drive(controller, requests, costs, acceptance, steps, rng, observe=None, accepted=None, gap=0.0,
          remaining=None):
    """Run ``steps`` engine steps: the controller decides, the synthetic
    engine reports the step's cost and each round's accepted drafts (drawn
    with ``acceptance[req_id]``, or ``accepted(req_id, k)``); ``observe``
    adds keywords to each step's report; ``remaining``: each request's
    tokens still to commit, given to the controller (and not counted down:
    the batch stays as it is). Returns (drafts, skipped, reason) per step."""
    history = []
    for _ in range(steps):
        drafts, skipped = controller.plan(requests, remaining=remaining)
        ticks = max(drafts, default=0)
        tokens = len(requests) + sum(drafts)
        seconds = (costs.plain_step(tokens) if ticks == 0
                   else costs.spec_step(ticks, sum(1 for k in drafts if k), tokens))
        rounds = []
        for (req_id, sampled, _), k in zip(requests, drafts):
            if k:
                if accepted is not None:
                    n = accepted(req_id, k)
                else:
                    n = 0
                    while n < k and rng.random() < acceptance[req_id]:
                        n += 1
                rounds.append((req_id, sampled, k, n))
        report = dict(width=len(requests), committed=len(requests) + sum(r[3] for r in rounds))
        controller.observe_step(ticks, sum(1 for k in drafts if k), tokens, seconds,
                                **(report | (observe(drafts) if observe else {})))
        controller.observe_gap(gap)
        for r in rounds:
            controller.observe_round(*r)
        history.append((drafts, skipped, controller.history[-1].reason))
    return history


def test_controller_learns_costs_and_follows_the_policy():
    """At one width the fit cannot tell a draft tick from a drafting row or a
    verified token (they move together), but it predicts every step it has
    seen, and the policy it drives picks the K the true costs would."""
    rng = np.random.default_rng(1)
    c = AdaptiveController(max_k=8, start_k=4)
    history = drive(c, [("a", False, 8)], CPU_LIKE, {"a": 0.9}, 200, rng)
    assert c.costs is not None
    for k in range(1, 9):
        assert c.costs.spec_step(k, 1, 1 + k) == pytest.approx(CPU_LIKE.spec_step(k, 1, 1 + k), rel=0.05)
    assert c.costs.plain_step(1) == pytest.approx(CPU_LIKE.plain_step(1), rel=0.05)
    policy = [max(d) for d, _, reason in history if reason in ("policy", "measured_rate")]
    assert len(policy) > 100

    def true_rate(k):
        return expected_tokens((0.9,) * 8, k) / CPU_LIKE.spec_step(k, 1, 1 + k)

    best = max(true_rate(k) for k in range(1, 9))
    chosen = [true_rate(k) if k else 1 / CPU_LIKE.plain_step(1) for k in policy[-50:]]
    assert np.median(chosen) >= 0.95 * best


def test_width_cap_turns_speculation_off_and_rearms_lower():
    """Wide batches of mediocre requests: the policy picks plain steps, the
    controller disarms at that width (plain steps, counted as width_cap, one
    probe round in 16), holds while the batch narrows a little, re-arms
    when it narrows to the re-arm width."""
    rng = np.random.default_rng(2)
    costs = CPU_LIKE
    c = AdaptiveController(max_k=8, start_k=4)
    wide = [(f"w{i}", False, 8) for i in range(16)]
    assert decide([Candidate((0.8,) * 8, 8)] * 16, costs, 8).plain
    assert not decide([Candidate((0.8,) * 8, 8)] * 2, costs, 8).plain
    drive(c, wide, costs, {r: 0.8 for r, _, _ in wide}, 200, rng)
    assert not c.armed and c.cap == 16
    history = drive(c, wide[:13], costs, {r: 0.8 for r, _, _ in wide}, 32, rng)
    assert not c.armed  # 13 > rearm_width(16) == 12
    plain = [not any(d) for d, _, _ in history]
    assert sum(plain) >= 30 and all(s == {SKIP_WIDTH_CAP: 13} for d, s, _ in history if not any(d))
    # Two new requests that accept well: re-armed, they speculate.
    narrow = [("n0", False, 8), ("n1", False, 8)]
    history = drive(c, narrow, costs, {"n0": 0.9, "n1": 0.9}, 40, rng)
    assert c.armed and sum(any(d) for d, _, _ in history[-20:]) >= 16


def test_low_acceptance_request_is_paused_then_reprobed():
    rng = np.random.default_rng(3)
    dear_rows = CPU_LIKE
    c = AdaptiveController(max_k=8, start_k=4)
    reqs = [("good1", False, 8), ("good2", False, 8), ("bad", False, 8)]
    history = drive(c, reqs, dear_rows, {"good1": 0.95, "good2": 0.95, "bad": 0.0}, 300, rng)
    bad = [d[2] for d, _, _ in history[-150:]]
    good = [d[0] for d, _, _ in history[-150:]]
    assert sum(k > 0 for k in good) > 100
    assert 0 < sum(k > 0 for k in bad) < 15  # re-probes only, with one draft
    assert all(k in (0, 1) for k in bad)
    assert sum(s.get(SKIP_LOW_ACCEPTANCE, 0) for _, s, _ in history[-150:]) > 100


def test_requests_that_would_trail_the_batch_draft_and_are_not_paused():
    """Three mediocre requests among thirteen good ones, all with the same
    tokens to go: told what remains, the controller keeps their drafts (left
    plain they would finish alone, long after the others) instead of pausing
    them as it does without it."""
    requests = [(f"g{i}", False, 8) for i in range(13)] + [(f"m{i}", False, 8) for i in range(3)]
    acceptance = {r: 0.97 for r, _, _ in requests[:13]} | {r: 0.6 for r, _, _ in requests[13:]}
    told = drive(AdaptiveController(max_k=8, start_k=4), requests, WIDE, acceptance, 300,
                 np.random.default_rng(5), remaining=[160] * 16)
    blind = drive(AdaptiveController(max_k=8, start_k=4), requests, WIDE, acceptance, 300,
                  np.random.default_rng(5))

    def mediocre_drafting(history):
        return sum(all(d[13:]) for d, _, _ in history[-150:] if any(d[:13]))

    def paused(history):
        return sum(s.get(SKIP_LOW_ACCEPTANCE, 0) for _, s, _ in history[-150:])

    assert mediocre_drafting(told) > 120 and paused(told) < 30
    assert mediocre_drafting(blind) < 30 and paused(blind) > 200


def test_a_pause_after_drafting_again_starts_short():
    """A request paused, re-probed and drafting on its own merits again
    starts its next pause at the first back-off, not a doubled one."""
    from vllm_loopspec.speculative.adaptive import PROBE_BACKOFF

    c = AdaptiveController(max_k=8, start_k=4)
    state = c._request("a", False)
    c._pause(state)
    c._pause(state)
    assert state.backoff == 4 * PROBE_BACKOFF[0]
    drive(c, [("a", False, 8), ("b", False, 8)], CPU_LIKE, {"a": 0.95, "b": 0.95}, 120, np.random.default_rng(6))
    assert state.backoff == PROBE_BACKOFF[0]


def test_pinned_start_k_is_used_until_costs_are_fitted():
    c = AdaptiveController(max_k=8, start_k=3)
    drafts = [c.plan([("a", False, 8)])[0][0] for _ in range(8)]
    assert c.costs is None and set(drafts) == {0, 1, 3, 8}


def test_seeded_costs_price_steps_from_the_timed_pieces():
    """A plain step of n tokens: R loops and lm_head over n rows; a round of
    K ticks over B drafting rows and n tokens: the same for its tokens, plus
    per tick d loops and lm_head over the B rows."""
    tick, logits, loops, d = (1e-3, 2e-5), (1e-4, 1e-5), 4, 2
    costs = seeded_costs(tick, logits, loops, d)
    loop = lambda n: tick[0] + tick[1] * n  # noqa: E731
    head = lambda n: logits[0] + logits[1] * n  # noqa: E731
    assert costs.plain_step(8) == pytest.approx(loops * loop(8) + head(8))
    k, rows, tokens = 4, 8, 8 * 5
    assert costs.spec_step(k, rows, tokens) == pytest.approx(loops * loop(tokens) + head(tokens)
                                                             + k * (d * loop(rows) + head(rows)))
    assert costs.context == (0.0, 0.0)
    assert seeded_costs((-1e-4, 2e-5), (1e-4, -1e-6), loops, d).plain[0] >= 0  # a fit's noise is no negative cost


def test_a_seeded_controller_decides_from_its_first_step_and_a_fit_replaces_the_seed():
    """Seeded at startup, the policy decides the first step itself (no
    warm-up cycling K: high acceptance drafts a long round); the fit of the
    engine's own timings replaces the seed once rounds of three draft
    counts were timed, and the factors measured against the seed are
    re-expressed against the fit (the seed left out half of every step)."""
    rng = np.random.default_rng(0)
    c = AdaptiveController(max_k=8, start_k=4)
    seed = StepCosts(plain=tuple(x / 2 for x in CPU_LIKE.plain), spec=tuple(x / 2 for x in CPU_LIKE.spec))
    c.seed(seed)
    assert c.seeded and c.costs is seed
    c._engine_acceptance[False].values[:] = 0.9  # an engine that has seen rounds accept
    c._engine_acceptance[False].seen[:] = 64
    history = drive(c, [("a", False, 8)], CPU_LIKE, {"a": 0.9}, 12, rng)
    assert history[0][2] == "policy" and max(history[0][0]) >= 4
    assert "warmup" not in {reason for _, _, reason in history}
    assert c.seeded  # rounds of one or two lengths: the seed prices the others
    factors = c.time_factors((0, GREEDY))
    assert factors[max(history[-1][0])] == pytest.approx(2.0, rel=0.1)
    # Rounds of other lengths, and plain steps: the fit replaces the seed.
    for k in (1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 0, 0, 0):
        for _ in range(2):
            seconds = CPU_LIKE.spec_step(k, 1, 1 + k) if k else CPU_LIKE.plain_step(1)
            c.observe_step(k, 1 if k else 0, 1 + k, seconds, width=1, committed=1)
            c.observe_gap(0.0)
    c.plan([("a", False, 8)])
    assert not c.seeded and c.costs is not seed
    assert c.costs.spec_step(4, 1, 5) == pytest.approx(CPU_LIKE.spec_step(4, 1, 5), rel=0.1)
    measured = c.measured_factors(1)
    assert measured and all(f == pytest.approx(1.0, rel=0.1) for f in measured.values()), measured


def test_a_seeded_controller_warms_up_until_the_batch_mode_has_rounds():
    """With costs seeded but no rounds of a sampling mode yet (its estimate
    is the prior), a batch with requests of that mode warms up (cycling K,
    plain every fourth step, the chooser told so) until the mode has
    MODE_PROBE_ROUNDS rounds engine-wide; then the policy decides. A greedy
    batch's rounds do not end a sampled batch's warm-up."""
    from vllm_loopspec.speculative.adaptive import MIXED, MODE_PROBE_ROUNDS

    c = AdaptiveController(max_k=8, start_k=3)
    c.seed(CPU_LIKE)
    assert c.warming_up(GREEDY) and c.warming_up(SAMPLED) and c.warming_up(MIXED)
    history = drive(c, [(f"g{i}", False, 8) for i in range(4)], CPU_LIKE, {f"g{i}": 0.9 for i in range(4)},
                    3 * MODE_PROBE_ROUNDS // 4, np.random.default_rng(0))
    reasons = [reason for _, _, reason in history]
    warm = reasons.index("policy") if "policy" in reasons else len(reasons)
    assert warm >= MODE_PROBE_ROUNDS // 4 and set(reasons[:warm]) == {"warmup"}
    assert {max(d) for d, _, _ in history[:warm]} == {0, 1, 3, 8}
    assert "policy" in reasons[warm:]
    assert not c.warming_up(GREEDY) and c.warming_up(SAMPLED) and c.warming_up(MIXED)
    assert c.plan([("s", True, 8)]) and c.history[-1].reason == "warmup"


def test_the_seed_takes_the_host_work_of_measured_plain_steps():
    """Plain steps measured 2 ms dearer than the seed says (host work it
    cannot time at startup): both intercepts of the seed rise by 2 ms, and
    the factor measured against the old seed is re-expressed."""
    c = AdaptiveController(max_k=8, start_k=4)
    seed = StepCosts(plain=(0.003, 0.0002), spec=(0.003, 0.001, 0.0002, 0.0002))
    c.seed(seed)
    for _ in range(8):
        c.observe_step(0, 0, 1, seed.plain_step(1) + 0.002, width=1, committed=1)
        c.observe_gap(0.0)
    c.plan([("a", False, 8)])
    assert c.seeded
    assert c.costs.plain[0] == pytest.approx(0.005) and c.costs.spec[0] == pytest.approx(0.005)
    assert c.costs.spec[1:] == seed.spec[1:]
    assert c.measured_factors(1)[0] == pytest.approx(1.0, rel=0.01)


def test_an_unseeded_controller_keeps_the_warm_up():
    c = AdaptiveController(max_k=8, start_k=4)
    c.plan([("a", False, 8)])
    assert c.costs is None and not c.seeded and c.history[-1].reason == "warmup"


class TrueCosts:
    """What steps really cost, where the policy's model is made to differ:
    a plain step and a round of ``k`` ticks cost the model's time times
    ``plain`` and ``spec(k)``."""

    def __init__(self, model: StepCosts, plain: float = 1.0, spec=lambda k: 1.0) -> None:
        self.model, self.plain, self.spec = model, plain, spec

    def plain_step(self, tokens, context=0):
        return self.plain * self.model.plain_step(tokens, context)

    def spec_step(self, ticks, rows, tokens, context=0):
        return self.spec(ticks) * self.model.spec_step(ticks, rows, tokens, context)


def drive_with_wrong_model(controller, requests, model, truth, acceptance, steps, seed=0):
    """:func:`drive` with the controller's cost model pinned to ``model``
    (no refit) while steps cost what ``truth`` says: a fit that is off in
    a way only the measured step times reveal."""
    controller.costs = model
    controller._refit = lambda: None
    return drive(controller, requests, truth, acceptance, steps, np.random.default_rng(seed))


def test_measured_time_turns_a_losing_speculation_plain():
    """The model believes rounds cost what CPU_LIKE says; they cost three
    times that. The measured factors make the steps plain (counted as
    measured_rate), and the width cap follows."""
    from vllm_loopspec.speculative.adaptive import SKIP_MEASURED

    c = AdaptiveController(max_k=8, start_k=4)
    reqs = [(f"r{i}", False, 8) for i in range(4)]
    acceptance = {r: 0.9 for r, _, _ in reqs}
    assert not decide([Candidate((0.9,) * 8, 8)] * 4, CPU_LIKE, 8, margin=0.25).plain
    history = drive_with_wrong_model(c, reqs, CPU_LIKE, TrueCosts(CPU_LIKE, spec=lambda k: 3.0), acceptance, 300)
    factors = c.measured_factors(4)
    assert factors[0] == pytest.approx(1.0, rel=0.05) and all(f == pytest.approx(3.0, rel=0.05)
                                                              for k, f in factors.items() if k)
    assert any(reason == SKIP_MEASURED for _, _, reason in history)
    late = history[-100:]
    assert sum(not any(d) for d, _, _ in late) / len(late) > 0.9  # probes only
    assert not c.armed and c.cap == 4


def test_measured_time_keeps_a_paying_speculation():
    c = AdaptiveController(max_k=8, start_k=4)
    reqs = [(f"r{i}", False, 8) for i in range(4)]
    history = drive_with_wrong_model(c, reqs, CPU_LIKE, TrueCosts(CPU_LIKE), {r: 0.9 for r, _, _ in reqs}, 300)
    assert all(f == pytest.approx(1.0, rel=0.01) for f in c.measured_factors(4).values())
    assert c.armed and sum(any(d) for d, _, _ in history[-100:]) > 80


def test_factors_are_kept_per_width_bucket_and_sampling_mix():
    from vllm_loopspec.speculative.adaptive import width_bucket

    assert [width_bucket(w) for w in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    c = AdaptiveController(max_k=8, start_k=4)
    reqs = [(f"r{i}", False, 8) for i in range(4)]
    drive_with_wrong_model(c, reqs, CPU_LIKE, TrueCosts(CPU_LIKE, spec=lambda k: 3.0), {r: 0.8 for r, _, _ in reqs},
                           300)
    assert c.measured_factors(3) and not c.measured_factors(8)  # 8 is another bucket, unmeasured
    assert not c.measured_factors(4, SAMPLED)


def test_a_gap_that_may_hold_idle_time_is_not_a_step_cost():
    """Between two generate calls the engine idles; that gap (reported as
    None: the next step admits new requests) must not reach the cost model,
    or rare plain steps would look seconds long."""
    rng = np.random.default_rng(4)
    c = AdaptiveController(max_k=8, start_k=4)
    requests = [("a", False, 8)]
    for _ in range(40):
        drive(c, requests, CPU_LIKE, {"a": 0.9}, 5, rng)
        c.observe_step(0, 0, 1, CPU_LIKE.plain_step(1))  # the call's last step is plain...
        c.observe_gap(None)  # ...and the engine then waits for the next call
    assert c.costs is not None
    assert c.costs.plain_step(1) == pytest.approx(CPU_LIKE.plain_step(1), rel=0.1)


def test_measured_time_caps_the_drafts_where_longer_rounds_cost_more():
    """Rounds of more than one tick cost 2.5 times what the model says (a
    cost its linear form cannot hold): one-draft rounds become the choice."""
    c = AdaptiveController(max_k=8, start_k=4)
    reqs = [(f"r{i}", False, 8) for i in range(4)]
    truth = TrueCosts(CPU_LIKE, spec=lambda k: 1.0 if k == 1 else 2.5)
    history = drive_with_wrong_model(c, reqs, CPU_LIKE, truth, {r: 0.95 for r, _, _ in reqs}, 400)
    assert c.measured_factors(4)[2] == pytest.approx(2.5)
    late = [max(d) for d, _, reason in history[-100:] if reason != "explore"]
    assert sum(k == 1 for k in late) > 0.9 * len(late), late


def test_measured_time_turns_on_speculation_the_model_thought_too_dear():
    """The model prices rounds at three times their cost: it would decode
    plainly, but the one-draft rounds measured at a new width correct it and
    the engine speculates."""
    dear = StepCosts(CPU_LIKE.plain, tuple(3 * x for x in CPU_LIKE.spec))
    reqs = [(f"r{i}", False, 8) for i in range(4)]
    assert decide([Candidate((0.9,) * 8, 8)] * 4, dear, 8).plain
    c = AdaptiveController(max_k=8, start_k=4)
    history = drive_with_wrong_model(c, reqs, dear, TrueCosts(dear, spec=lambda k: 1 / 3), {r: 0.9 for r, _, _ in reqs},
                                     400)
    assert c.armed
    assert sum(any(d) for d, _, _ in history[-100:]) > 80


def test_width_cap_probes_back_off_while_they_confirm_the_cap():
    rng = np.random.default_rng(5)
    c = AdaptiveController(max_k=8, start_k=4)
    wide = [(f"w{i}", False, 8) for i in range(16)]
    drive(c, wide, CPU_LIKE, {r: 0.8 for r, _, _ in wide}, 200, rng)
    assert not c.armed
    history = drive(c, wide, CPU_LIKE, {r: 0.8 for r, _, _ in wide}, 500, rng)
    rounds = [i for i, (d, _, _) in enumerate(history) if any(d)]
    assert 1 <= len(rounds) <= 5, rounds  # probes 16, 32, 64, 128, 256 steps apart at most


def test_fit_separates_context_from_the_intercept():
    """Steps of the same widths over short and long contexts: the fitted
    plain cost of a short-context step is its own, not the average."""
    truth = StepCosts(plain=CPU_LIKE.plain, spec=CPU_LIKE.spec, context=(2e-6, 3e-6))
    c = AdaptiveController(max_k=8, start_k=4)
    rng = np.random.default_rng(6)
    for step in range(400):
        width = int(rng.integers(1, 9))
        context = width * int(rng.choice([40, 500]))
        ticks = int(rng.integers(0, 5)) if step % 3 else 0
        tokens = width * (1 + ticks)
        seconds = (truth.plain_step(width, context) if ticks == 0
                   else truth.spec_step(ticks, width, tokens, context))
        c.observe_step(ticks, width if ticks else 0, width if ticks == 0 else tokens, seconds, context=context)
        c.observe_gap(0.0)
    c.plan([("a", False, 8)])  # the controller refits when it decides
    assert c.costs is not None
    for width, context in ((4, 160), (4, 2000)):
        assert c.costs.plain_step(width, context) == pytest.approx(truth.plain_step(width, context), rel=0.1)
        assert c.costs.spec_step(2, width, 3 * width, context) == pytest.approx(
            truth.spec_step(2, width, 3 * width, context), rel=0.1)


def test_acceptance_calibration_scales_estimates_to_what_rounds_accept():
    """Drafts tested where their estimates said 0.9 but half were accepted:
    the calibration ratio is 0.56 at the tested positions and, for a
    position tested too rarely, that of the nearest shallower one. The
    policy decides with calibrated estimates: a request whose own estimate
    says 0.9 is not drafted for when rounds really accept a third of that."""
    from vllm_loopspec.speculative.adaptive import CALIBRATION_MIN_DRAFTS, _Calibration

    cal = _Calibration.empty(4)
    for _ in range(int(CALIBRATION_MIN_DRAFTS) - 2):
        cal.update(np.full(3, 0.9), np.array([1.0, 1.0, 1.0]))
    for i in range(800):
        cal.update(np.full(2, 0.9), np.array([i % 2, (i + 1) % 2], dtype=np.float64))
    ratios = cal.ratios()
    assert ratios[:2] == pytest.approx([0.5 / 0.9] * 2, rel=0.05)
    assert ratios[2] == ratios[1] and ratios[3] == ratios[1]  # too rarely tested / never

    def decision(calibrated: bool):
        c = AdaptiveController(max_k=8, start_k=4)
        c.costs = CPU_LIKE
        c._refit = lambda: None
        c._engine_acceptance[False].seen[:] = 64  # rounds measured: no mode probe
        state = c._request("a", False)
        state.acceptance.values[:] = 0.9
        state.acceptance.seen[:] = 10
        if calibrated:
            for _ in range(200):
                c._calibration[False].update(np.full(8, 0.9), np.full(8, 0.3))
        return c.plan([("a", False, 8)])[0]

    assert decision(False)[0] > 0 and decision(True) == [0]


def test_calibration_leaves_estimates_that_hold_alone():
    c = AdaptiveController(max_k=8, start_k=4)
    reqs = [(f"r{i}", False, 8) for i in range(2)]
    drive(c, reqs, CPU_LIKE, {r: 0.8 for r, _, _ in reqs}, 800, np.random.default_rng(9))
    ratios = c._calibration[False].ratios()
    assert np.allclose(ratios[:3], 1.0, atol=0.1), ratios


def test_a_new_width_that_neighbours_price_plain_is_not_explored_with_rounds():
    """Rounds were measured to lose at widths 9-16 (3x dearer than the
    model says); a batch that grows to 17 is priced with those factors and
    decodes plainly from its first step, without exploration rounds."""
    c = AdaptiveController(max_k=8, start_k=4)
    wide = [(f"w{i}", False, 8) for i in range(12)]
    truth = TrueCosts(CPU_LIKE, spec=lambda k: 3.0)
    drive_with_wrong_model(c, wide, CPU_LIKE, truth, {r: 0.8 for r, _, _ in wide}, 300)
    assert not c.armed
    grown = wide + [(f"n{i}", True, 8) for i in range(5)]
    c.armed, c.cap = True, None  # as if the batch had narrowed and re-armed in between
    c._engine_acceptance[True].seen[:] = 64  # sampled rounds seen before: no warm-up for the mode
    history = drive(c, grown, truth, {r: 0.8 for r, _, _ in grown}, 40, np.random.default_rng(10))
    assert sum(any(d) for d, _, _ in history) <= 2, [d for d, _, _ in history if any(d)]


def test_a_round_within_the_margin_of_the_plain_step_is_not_chosen():
    """Where a round is expected to beat the plain step by less than the
    margin, the plain step is chosen; a clear gain still speculates."""
    close = [Candidate((0.8,) * 8, 8)] * 4
    gain = decide(close, CPU_LIKE, 8)
    assert not gain.plain and 1.0 < gain.rate / gain.plain_rate < 1.2
    assert decide(close, CPU_LIKE, 8, margin=0.2).plain
    assert not decide([Candidate(HIGH, 8)] * 4, CPU_LIKE, 8, margin=0.2).plain


def test_under_the_width_cap_steps_are_held_plain_without_a_decision():
    """holds_plain: the engine's fast path under the cap (no policy work);
    each held step counts as a width_cap step, a probe step is left to
    plan(), and a batch narrowed to the re-arm width re-arms."""
    c = AdaptiveController(max_k=8, start_k=4)
    c.armed, c.cap, c.cap_mix, c._next_probe = False, 16, GREEDY, 5
    held = [c.holds_plain(16, GREEDY) for _ in range(6)]
    assert held == [True, True, True, True, False, False]
    assert [r.reason for r in c.history] == ["width_cap"] * 4
    assert not c.holds_plain(12, GREEDY) and c.armed  # rearm_width(16) == 12


def test_the_width_cap_holds_a_lone_request_and_belongs_to_its_sampling_mix():
    """A cap of 1 (even a lone request decodes plainly: sampled requests on
    a machine where rounds cost several plain steps) holds until a probe,
    with no decision per step; a batch of the other mix re-arms at once."""
    assert rearm_width(1) == 0 and rearm_width(2) == 1
    c = AdaptiveController(max_k=8, start_k=4)
    c.armed, c.cap, c.cap_mix, c._next_probe = False, 1, SAMPLED, 100
    assert all(c.holds_plain(1, SAMPLED) for _ in range(50))
    assert not c.holds_plain(1, GREEDY) and c.armed and c.cap is None


def test_a_request_unlike_the_engine_average_is_learned_in_a_few_rounds():
    """The engine-wide estimate says drafts are poor (0.2 everywhere, from
    thousands of rounds); a new request that repeats itself accepts every
    draft. Its start weighs only a few rounds, and exploration from a plain
    decision tries the model's best round (not one draft, which would never
    test positions >= 2), so the lone request ends up drafting long rounds."""
    from vllm_loopspec.speculative.adaptive import PRIOR_ROUNDS

    c = AdaptiveController(max_k=8, start_k=4)
    c._engine_acceptance[False].values[:] = 0.2
    c._engine_acceptance[False].seen[:] = 5000
    state = c._request("warm", False)
    assert (state.acceptance.seen == PRIOR_ROUNDS[False]).all()
    history = drive_with_wrong_model(c, [("easy", False, 8)], CPU_LIKE, TrueCosts(CPU_LIKE), {"easy": 1.0}, 300)
    late = [max(d) for d, _, _ in history[-100:]]
    assert sum(k >= 4 for k in late) > 80, late


def test_a_sampled_request_starts_from_its_mode_estimate_at_the_weight_of_many_rounds():
    """Sampled acceptance varies by draw more than by request: a new sampled
    request's start weighs PRIOR_ROUNDS[True] rounds, a greedy one's one
    round; so two lucky sampled rounds leave it near the engine's estimate."""
    from vllm_loopspec.speculative.adaptive import PRIOR_ROUNDS

    assert PRIOR_ROUNDS[True] > PRIOR_ROUNDS[False]
    c = AdaptiveController(max_k=8, start_k=4)
    for mode in (False, True):
        c._engine_acceptance[mode].values[:] = 0.5
        c._engine_acceptance[mode].seen[:] = 5000
    greedy, sampled = c._request("g", False), c._request("s", True)
    for req_id, mode in (("g", False), ("s", True)):
        for _ in range(2):
            c.observe_round(req_id, mode, 2, 2)
    assert greedy.acceptance.read()[0] > 0.8
    assert sampled.acceptance.read()[0] < 0.6


def test_a_run_of_plain_decisions_for_the_same_requests_decides_one_step_in_a_few(monkeypatch):
    """Once plain decisions run for the same requests (no round, so no
    estimate moves) and the cap is refused, the controller decides on one
    step in PLAIN_RECHECK_EVERY; a new request makes it decide at once."""
    import vllm_loopspec.speculative.adaptive as adaptive

    c = AdaptiveController(max_k=8, start_k=4)
    c.costs, c._refit = CPU_LIKE, (lambda: None)
    c._engine_acceptance[False].values[:] = 0.9  # a typical batch would speculate: no cap
    c._engine_acceptance[False].seen[:] = 5000
    state = c._request("low", False)
    state.acceptance.values[:] = 0.0
    state.acceptance.own[:] = 8  # measured by rounds of its own (a barely measured one is re-probed)
    calls = []
    real = adaptive.decide
    monkeypatch.setattr(adaptive, "decide", lambda *a, **k: calls.append(1) or real(*a, **k))
    steps = [c.plan([("low", False, 8)]) for _ in range(64)]
    assert all(not any(d) for d, _ in steps) and c.armed
    assert len(calls) < 56, len(calls)  # deciding on every step: at least 64
    assert steps[-1][1] and sum(steps[-1][1].values()) == 1  # still counted by reason
    before = len(calls)
    c.plan([("low", False, 8), ("new", False, 8)])
    assert len(calls) > before


def test_a_lone_greedy_request_drafting_nothing_sets_no_width_cap():
    """Plain steps for a lone greedy request whose drafts all fail, with the
    engine's greedy estimate dragged down by it: no cap at width 1 (the
    next greedy request may accept everything), and its plain steps are
    cheap runs (few full decisions)."""
    c = AdaptiveController(max_k=8, start_k=4)
    c._engine_acceptance[False].values[:] = 0.05  # as many such rounds leave it
    c._engine_acceptance[False].seen[:] = 5000
    history = drive(c, [("lone", False, 8)], CPU_LIKE, {"lone": 0.0}, 400, np.random.default_rng(3))
    assert c.armed and c.cap is None
    assert sum(not any(d) for d, _, _ in history[-100:]) > 90


def test_a_lone_greedy_request_whose_first_round_missed_is_re_probed_with_the_starting_k():
    """Alone in the batch, a greedy request whose first round was rejected
    at once (the first tokens of a generation are the hardest to draft)
    reads as half its prior and decodes plainly; it is paused and
    re-probed with the starting K after the back-off, so that a request
    that accepts everything afterwards drafts again. One that keeps missing
    is no longer probed once its estimate rests on THIN_EVIDENCE_ROUNDS
    rounds of its own."""
    from vllm_loopspec.speculative.adaptive import PROBE_BACKOFF, THIN_EVIDENCE_ROUNDS

    c = AdaptiveController(max_k=8, start_k=4)
    c.costs, c._refit = CPU_LIKE, (lambda: None)
    c._engine_acceptance[False].values[:] = 0.75
    c._engine_acceptance[False].seen[:] = 5000
    c.plan([("r", False, 8)])
    c.observe_round("r", False, 4, 0)  # its first round: rejected at the first draft
    steps = [c.plan([("r", False, 8)])[0] for _ in range(PROBE_BACKOFF[0] + 2)]
    assert not any(steps[0])
    assert [4] in steps  # re-probed with the starting K
    probe = steps.index([4])
    assert all(d == [0] for d in steps[:probe])
    c.observe_round("r", False, 4, 4)  # it accepts everything from now on
    later = []
    for _ in range(100):
        drafts, _ = c.plan([("r", False, 8)])
        later.append(drafts[0])
        if drafts[0]:
            c.observe_round("r", False, drafts[0], drafts[0])
    # Drafting on its own merits (a plain step now and then: exploration).
    assert sum(k >= 4 for k in later[-40:]) >= 32, later

    # A request that misses every probe: probed while its evidence is thin only.
    c.plan([("miss", False, 8)])
    probes = 0
    for _ in range(2000):
        drafts, _ = c.plan([("miss", False, 8)])
        if drafts[0]:
            probes += 1
            c.observe_round("miss", False, drafts[0], 0)
    assert c._requests["miss"].acceptance.own[0] >= THIN_EVIDENCE_ROUNDS
    assert probes < 40  # then exploration only, one step in many
