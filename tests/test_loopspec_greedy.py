"""Greedy loopspec is exact: token for token equal to native decoding, with
every loop doing K+1 rows per round and drafts both accepted and rejected,
for fixed K and for every decision the adaptive policy makes."""

import pytest
from vllm import SamplingParams

from conftest import MAX_BATCHED_TOKENS
from engine_access import observe_loops, model_runner
from prompts import MEDIUM, SHORT, long_prompt

KS = [1, 2, 4, 8]
# The adaptive policy (warm-up K 4, at most 8): plain steps, K from 1 to 8,
# per-request K_i, explored and fitted decisions.
ADAPTIVE = "adaptive"
# "schedule": "auto" at d = 1: the adaptive policy's steps and pipelined
# steps (16 slots, second proposals at loop 2), switching between steps.
AUTO = "auto"
# "auto" with "draft_loops": [1, 2]: each step's arm at either depth.
AUTO_DEPTHS = "auto_depths"


def engine(loopspec_llms, k):
    if k == AUTO:
        return loopspec_llms(4, 1, adaptive=True, schedule="auto")
    if k == AUTO_DEPTHS:
        return loopspec_llms(4, (1, 2), adaptive=True, schedule="auto")
    return loopspec_llms(4, adaptive=True) if k == ADAPTIVE else loopspec_llms(k)
# Budgets that end inside a round for every K above (not 1 + multiples of K+1).
BUDGETS = [7, 13, 30]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    long_a = long_prompt(MAX_BATCHED_TOKENS + 40, tokenizer)  # chunk-prefilled
    long_b = long_prompt(2 * MAX_BATCHED_TOKENS + 9, tokenizer)[::-1]
    extra = ["    def close(self):\n        ", "if __name__ == '__main__':\n", "@property\ndef", "try:\n    import"]
    out = SHORT + MEDIUM + [long_a, long_b] + extra
    assert len(out) >= 16
    return out


@pytest.fixture(scope="module")
def native_reference(native_llm, prompts):
    """Native greedy outputs per (prompt, budget); native == oracle is tested
    in test_native_vs_oracle.py."""
    return native_outputs(native_llm, prompts, BUDGETS)


def native_outputs(native_llm, prompts, budgets) -> dict:
    ref = {}
    for budget in budgets:
        outs = native_llm.generate(prompts, SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True),
                                   use_tqdm=False)
        for p, o in zip(prompts, outs):
            ref[(p, budget)] = list(o.outputs[0].token_ids)
    return ref


@pytest.mark.parametrize("k", KS + [ADAPTIVE, AUTO, AUTO_DEPTHS])
def test_batch_of_8_equals_native(loopspec_llms, prompts, native_reference, k):
    llm = engine(loopspec_llms, k)
    for budget in BUDGETS:
        for start in range(0, len(prompts), 8):
            batch = prompts[start : start + 8]
            outs = llm.generate(batch, SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True),
                                use_tqdm=False)
            for p, o in zip(batch, outs):
                assert list(o.outputs[0].token_ids) == native_reference[(p, budget)], (k, budget, p[:40])


@pytest.mark.parametrize("k", KS + [ADAPTIVE, AUTO, AUTO_DEPTHS])
def test_width_1_equals_native(loopspec_llms, prompts, native_reference, k):
    llm = engine(loopspec_llms, k)
    for p in [prompts[0], prompts[8], prompts[10], prompts[11]]:  # short, medium, two chunked
        for budget in BUDGETS:
            out = llm.generate([p], SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0]
            assert list(out.outputs[0].token_ids) == native_reference[(p, budget)], (k, budget, p[:40])


@pytest.mark.parametrize("k", KS)
def test_drafts_are_both_accepted_and_rejected(loopspec_llms, prompts, k):
    """Otherwise the equality tests above would not exercise both paths."""
    llm = loopspec_llms(k)
    llm.generate(prompts[:8], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = model_runner(llm).drafter.stats
    assert stats.drafted_tokens > 0
    assert 0 < stats.accepted_tokens < stats.drafted_tokens


def test_every_loop_processes_k_plus_1_rows_per_round(loopspec_llms, tokenizer):
    """Reuse count: per round, the shallow loops run 1+K single rows (A, then
    each draft) and the deep loops one batch of K+1 rows: nothing shallow is
    recomputed for a drafted position."""
    k = 4
    llm = loopspec_llms(k)
    model = model_runner(llm).model
    calls: list[tuple[int, int]] = []
    observer = lambda loop, h: calls.append((loop, h.shape[0]))  # noqa: E731
    prompt = SHORT[2]
    n_prompt = len(tokenizer(prompt)["input_ids"])
    stop_observing = observe_loops(llm, observer)
    trace: list[dict] = []
    model_runner(llm).drafter.trace = trace
    try:
        llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        stop_observing()
        model_runner(llm).drafter.trace = None
    d, loops = 2, model.num_loops
    round_sizes = [len(r["tokens"]) for step in trace for r in step.values()]  # K_i + 1 each
    assert round_sizes and max(round_sizes) == k + 1
    per_loop = {u: [rows for loop, rows in calls if loop == u] for u in range(loops)}
    for u in range(loops):
        assert per_loop[u][0] == n_prompt  # prefill: native full-depth step
    spec_calls = {u: per_loop[u][1:] for u in range(loops)}
    for u in range(d):
        # A and every draft: one single-row shallow pass each (plain decode
        # steps without drafts are single rows too).
        assert all(rows == 1 for rows in spec_calls[u])
    for u in range(d, loops):
        assert [rows for rows in spec_calls[u] if rows > 1] == [s for s in round_sizes if s > 1]
    totals = [sum(spec_calls[u]) for u in range(loops)]
    assert totals == [totals[0]] * loops
    assert sum(round_sizes) <= totals[0]


def test_adaptive_decisions_are_varied_and_exact(loopspec_llms, prompts, native_reference):
    """The adaptive rows of the matrix above are not vacuous: over a workload
    at widths 8 and 1 the policy makes plain steps, several K, warm-up
    steps until greedy rounds were measured, then decisions (on costs
    seeded at startup, then on a fit of the engine's own step timings), and
    every output is still native's."""
    llm = engine(loopspec_llms, ADAPTIVE)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for batch in (prompts[:8], prompts[8:16], [prompts[0]], [prompts[9]], [prompts[3]]):
        for p, o in zip(batch, llm.generate(batch, params, use_tqdm=False)):
            assert list(o.outputs[0].token_ids) == native_reference[(p, 30)], p[:40]
    controller = model_runner(llm).drafter.controller
    ticks = {max(r.drafts, default=0) for r in controller.history}
    reasons = {r.reason for r in controller.history}
    assert controller.costs is not None and not controller.seeded, "the cost model was never fitted"
    assert 0 in ticks and len(ticks - {0}) >= 3, ticks
    assert {"warmup", "policy", "explore"} <= reasons, reasons


def test_auto_schedule_switches_between_schedules_and_stays_exact(loopspec_llms, prompts, native_reference):
    """The "auto" rows of the matrix above are not vacuous: over widths 8
    and 1 the engine runs both pipelined steps and the policy's rounds, and
    switches between them from one step to the next."""
    llm = engine(loopspec_llms, AUTO)
    drafter = model_runner(llm).drafter
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for batch in (prompts[:8], prompts[8:16], [prompts[0]], [prompts[9]], [prompts[3]]):
        for p, o in zip(batch, llm.generate(batch, params, use_tqdm=False)):
            assert list(o.outputs[0].token_ids) == native_reference[(p, 30)], p[:40]
    stats = drafter.stats
    assert stats.pipelined_steps > 0 and stats.rounds > stats.pipelined_steps, (stats.pipelined_steps, stats.rounds)
    assert stats.pipelined_second_proposals > 0  # the default second proposal at 2 d
    chosen = {arm for arm, _ in drafter.chooser.decisions}
    assert {"policy", "pipelined"} <= chosen, drafter.chooser.decisions
    assert any(key[0] == 0 for key in drafter.chooser._keys) and any(key[0] == 3 for key in drafter.chooser._keys)


def test_auto_step_chosen_pipelined_runs_plain_when_requests_arrive(loopspec_llms, prompts, native_reference):
    """A pipelined step chosen for one request, which a new request's
    prefill then joins, runs plain (its drafts cut, left out of vLLM's
    acceptance counts): the newcomer's first token does not wait for the
    pipeline. Both outputs stay native's."""
    from vllm_loopspec.speculative.schedule_choice import PIPELINED, ScheduleChoice

    llm = engine(loopspec_llms, AUTO)
    drafter = model_runner(llm).drafter
    chooser, core = drafter.chooser, llm.llm_engine
    choose, arrivals_before = chooser.choose, drafter.stats.skipped["arrivals"]
    chooser.choose = lambda width, mix, context=0, in_flight=None: ScheduleChoice(PIPELINED, "measure")
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    try:
        core.add_request("first", prompts[0], params)
        tokens, drafts_at_arrival = {}, None
        while core.has_unfinished_requests():
            if "second" not in tokens and tokens.get("first", 0) >= 3:
                core.add_request("second", prompts[1], params)
                tokens["second"] = 0
                outs = core.step()
                drafts_at_arrival = drafter.step_drafts
            else:
                outs = core.step()
            for out in outs:
                tokens[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    assert list(out.outputs[0].token_ids) == native_reference[(prompts[int(out.request_id == "second")], 30)]
    finally:
        chooser.choose = choose
    assert drafts_at_arrival == 0
    assert drafter.stats.skipped["arrivals"] == arrivals_before + 1
    assert drafter.stats.pipelined_steps > 0


def test_auto_observes_a_batch_s_last_step_timed_to_its_end(loopspec_llms, prompts, native_reference):
    """A batch's last step (its next step brings new requests) is observed
    by the chooser, timed to its own end plus the recent gaps between steps,
    not to the next batch's first step (the engine idled in between): a
    pipelined step cut short by ``max_tokens`` counts against its arm."""
    import time

    from vllm_loopspec.speculative.schedule_choice import PIPELINED, ScheduleChoice

    llm = engine(loopspec_llms, AUTO)
    drafter = model_runner(llm).drafter
    chooser, core = drafter.chooser, llm.llm_engine
    observed = []

    def observe(width, mix, arm, committed, seconds, *args, **kwargs):
        observed.append((arm, committed, seconds))

    chooser.choose = lambda width, mix, context=0, in_flight=None: ScheduleChoice(PIPELINED, "measure")
    chooser.observe = observe
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    try:
        core.add_request("first", prompts[0], params)
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    assert list(out.outputs[0].token_ids) == native_reference[(prompts[0], 30)]
        during, last_tokens = len(observed), drafter._step_committed
        time.sleep(0.3)  # the engine idles between the batches
        core.add_request("second", prompts[1], params)
        core.step()  # the next batch's first step: the last one is observed now
        assert len(observed) == during + 1, observed
        arm, committed, seconds = observed[-1]
        assert arm == PIPELINED and committed == last_tokens and 0 < seconds < 0.3, observed[-1]
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    assert list(out.outputs[0].token_ids) == native_reference[(prompts[1], 30)]
    finally:
        del chooser.choose, chooser.observe


def test_auto_plain_hold_asks_the_chooser_again_when_the_batch_changes(loopspec_llms, prompts, native_reference):
    """A plain verdict's hold (ScheduleChoice.hold) runs the next steps plain
    without a choice, and credits them to the chooser with their time; a
    request joining ends it, so the next step is chosen for the new batch."""
    from vllm_loopspec.speculative.schedule_choice import PLAIN, ScheduleChoice

    llm = engine(loopspec_llms, AUTO)
    drafter = model_runner(llm).drafter
    chooser, core = drafter.chooser, llm.llm_engine
    calls, credited, step = [], [], 0

    def choose(width, mix, context=0, in_flight=None):
        calls.append((step, width))
        return ScheduleChoice(PLAIN, "faster", hold=5)

    def credit_held(steps, timed=0, seconds=0.0):
        credited.append((steps, timed, seconds))

    chooser.choose, chooser.credit_held = choose, credit_held
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    arrival = None
    try:
        core.add_request("first", prompts[0], params)
        while core.has_unfinished_requests():
            if arrival is None and step == 13:
                core.add_request("second", prompts[1], params)
                arrival = step
            for out in core.step():
                if out.finished:
                    assert list(out.outputs[0].token_ids) == native_reference[(prompts[int(out.request_id == "second")], 30)]
                assert drafter.step_drafts == 0
            step += 1
    finally:
        del chooser.choose, chooser.credit_held
    alone = [s for s, width in calls if s < arrival]
    assert alone and all(b - a == 6 for a, b in zip(alone, alone[1:])), calls
    assert (arrival, 2) in calls, calls  # the step the second request joined: the hold ended there
    held = [steps for steps, _, _ in credited]
    assert sum(held) + len(calls) >= step - 2 and set(held) <= set(range(1, 6))
    # Every held step ran: the steps between the first and the last held
    # start are timed as one plain sample.
    assert all(timed == steps - 1 and (seconds > 0) == (timed > 0) for steps, timed, seconds in credited), credited


def test_each_step_may_speculate_at_another_depth(loopspec_llms, prompts, native_reference):
    """"draft_loops": [1, 2]: the arms of both depths in turn, step after
    step (rounds and pipelined steps at depth 1 and 2, plain steps between):
    the output equals native's, and each depth's policy sees the acceptance
    of its own rounds only."""
    from vllm_loopspec.speculative.schedule_choice import ScheduleChoice

    llm = engine(loopspec_llms, AUTO_DEPTHS)
    drafter = model_runner(llm).drafter
    chooser, arms = drafter.chooser, drafter.chooser.arms
    assert arms == ("plain", "policy@1", "policy@2", "pipelined@1", "pipelined@2")
    turn, ran, observed = [0], [], []
    run_step = drafter.run_step
    counted = {d: c.observe_round for d, c in drafter.controllers.items()}

    def choose(*args, **kwargs):
        turn[0] += 1
        return ScheduleChoice(arms[turn[0] % len(arms)], "measure")

    def recording_run_step(*args, **kwargs):
        ran.append(("pipelined" if drafter._step_pipelined else "policy", drafter.round_draft_loops))
        return run_step(*args, **kwargs)

    def observe_round_of(d):
        def observe_round(*args, **kwargs):
            observed.append((d, ran[-1][1] if ran else None, ran[-1][0] if ran else None))
            return counted[d](*args, **kwargs)
        return observe_round

    def plan(requests, *args, **kwargs):  # rounds of two drafts (a warmed policy may decline them here)
        return [min(2, limit) for _, _, limit in requests], {}

    timed = []  # (policy's depth, depth of the step it was given)
    timed_steps = {d: c.observe_step for d, c in drafter.controllers.items()}

    def observe_step_of(d):
        def observe_step(*args, **kwargs):
            timed.append((d, drafter.round_draft_loops))
            return timed_steps[d](*args, **kwargs)
        return observe_step

    chooser.choose, drafter.run_step = choose, recording_run_step
    for d, controller in drafter.controllers.items():
        controller.observe_round, controller.plan = observe_round_of(d), plan
        controller.observe_step = observe_step_of(d)
    try:
        batch = prompts[:4]
        outs = llm.generate(batch, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        del chooser.choose, drafter.run_step
        for controller in drafter.controllers.values():
            del controller.observe_round, controller.plan, controller.observe_step
    for p, o in zip(batch, outs):
        assert list(o.outputs[0].token_ids) == native_reference[(p, 30)], p[:40]
    assert {(kind, d) for kind, d in ran} == {("policy", 1), ("policy", 2), ("pipelined", 1), ("pipelined", 2)}
    # Each policy counts the rounds it drafted, not pipelined steps.
    assert observed and all(d == depth and kind == "policy" for d, depth, kind in observed), observed
    assert {d for d, _, _ in observed} == {1, 2}
    # Each step's time goes to the policy of its own depth (not to the next
    # step's, which propose chose before the step finished).
    assert timed and all(d == depth for d, depth in timed), timed
    assert {d for d, _ in timed} == {1, 2}


def test_a_policy_step_that_drafts_nothing_is_observed_as_declined(loopspec_llms, prompts, native_reference):
    """A step chosen for the policy arm whose policy drafts nothing is a
    plain step: the chooser observes it as declined (a sample of both the
    policy's arm and plain)."""
    from vllm_loopspec.speculative.adaptive import GREEDY
    from vllm_loopspec.speculative.schedule_choice import POLICY, ScheduleChoice

    llm = engine(loopspec_llms, AUTO)
    drafter = model_runner(llm).drafter
    chooser, controller = drafter.chooser, drafter.controller
    observed, lags = [], []

    def choose(width, mix, context=0, in_flight=None):
        return ScheduleChoice(POLICY, "faster")

    def plan(requests, *args, **kwargs):
        return [0] * len(requests), {}

    def observe(width, mix, arm, committed, seconds, context=0, after=None, declined=False, lag=0.0):
        observed.append((arm, declined, after, committed))
        lags.append(lag)

    chooser.choose = choose
    try:
        for _ in range(8):  # the policy's warm-up (its steps are not observed), unless earlier tests ran it
            if not controller.warming_up(GREEDY):
                break
            llm.generate(prompts[:2], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
        assert not controller.warming_up(GREEDY)
        chooser.observe, controller.plan = observe, plan
        batch = prompts[:2]
        outs = llm.generate(batch, SamplingParams(max_tokens=13, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        del chooser.choose, chooser.observe, controller.plan
    for p, o in zip(batch, outs):
        assert list(o.outputs[0].token_ids) == native_reference[(p, 13)], p[:40]
    assert drafter.step_drafts == 0
    assert len(observed) >= 8, observed
    assert all(arm == POLICY and declined and committed == 2 for arm, declined, _, committed in observed), observed
    assert all(after == POLICY for _, _, after, _ in observed[1:]), observed
    assert lags == [0.0] * len(observed)  # a plain step advances every row alike: no lag to charge


def test_a_batch_none_of_whose_requests_may_draft_is_neither_chosen_nor_measured(loopspec_llms, prompts,
                                                                                native_reference):
    """Requests asking for logprobs decode plainly in every step: a batch of
    only such requests says nothing about speculating at its key, so the
    chooser is not asked and observes nothing, and every decode step counts
    its rows under "logprobs" (fresh-clone CI on 54982d2: a lone logprobs
    request's steps, observed as declined policy steps, taught its key plain
    and were counted as "measured_rate"). The one observation allowed is the
    last step of the batch the engine ran before, which this batch's first
    step observes (fresh-clone CI on 6348c37)."""
    llm = engine(loopspec_llms, AUTO)
    drafter = model_runner(llm).drafter
    chooser = drafter.chooser
    asked, observed = [], []
    before_batch = drafter._choice_step  # (width, mix, context, arm, ...) of the last batch's last step, or None
    chooser.choose = lambda *a, **k: asked.append(a) or pytest.fail("chooser asked")
    chooser.observe = lambda *a, **k: observed.append(a)
    batch, tokens = prompts[:2], 13
    before = dict(drafter.stats.skipped)
    try:
        outs = llm.generate(batch, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1),
                            use_tqdm=False)
    finally:
        del chooser.choose, chooser.observe
    for p, o in zip(batch, outs):
        assert list(o.outputs[0].token_ids) == native_reference[(p, tokens)], p[:40]
    counted = {r: n - before.get(r, 0) for r, n in drafter.stats.skipped.items() if n != before.get(r, 0)}
    # One decision per step after the prefill, for both rows (the last
    # step's decision is for a step that never runs).
    assert counted == {"logprobs": 2 * (tokens - 1)} or counted == {"logprobs": 2 * tokens}, counted
    earlier = [] if before_batch is None else [(before_batch[0], before_batch[1], before_batch[3])]
    assert not asked and [o[:3] for o in observed] in ([], earlier), (observed, before_batch)


def test_a_hold_that_outlives_its_batch_times_no_idle_gap(loopspec_llms, prompts):
    """A batch that finishes inside a plain verdict's hold leaves the hold
    set; the next batch's first step comes after however long the engine
    idled, and must not be timed as a held plain step (it made plain look
    slow where batches end, and the chooser pick speculation there)."""
    import time

    from vllm_loopspec.speculative.schedule_choice import PLAIN, ScheduleChoice

    llm = engine(loopspec_llms, AUTO)
    drafter = model_runner(llm).drafter
    chooser = drafter.chooser
    credited, still_held = [], []

    def credit_held(steps, timed=0, seconds=0.0):
        credited.append((steps, timed, seconds))

    chooser.choose = lambda *a, **k: ScheduleChoice(PLAIN, "faster", hold=1000)
    chooser.credit_held = credit_held
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    try:
        llm.generate([prompts[0]], params, use_tqdm=False)
        still_held.append(drafter._next_held)
        time.sleep(1.5)
        llm.generate([prompts[1]], params, use_tqdm=False)
    finally:
        del chooser.choose, chooser.credit_held
    assert still_held == [True]  # the first batch ended inside the hold
    assert credited and all(timed > 0 for _, timed, _ in credited), credited
    assert max(seconds for _, _, seconds in credited) < 1.0, credited  # 20 plain steps; the 1.5 s idle is not in it


def test_a_step_without_drafts_runs_as_a_native_engines_step(loopspec_llms, prompts, native_reference):
    """A step the scheduler gave no drafts (a prefill, the last token of a
    budget) runs with ``speculative_config`` set aside until its sampling
    ends, so vLLM takes its non-speculative branches (attention metadata
    without spec decode, no placeholder clamp, no drafter dispatch); a step
    with drafts keeps it; after every step it is back, the drafter still
    proposes after a plain step, and the outputs are native's."""
    llm = loopspec_llms(2)
    runner = model_runner(llm)
    config = runner.speculative_config
    steps = []  # (the step had drafts, use_spec_decode, config set aside while building)

    def execute_model(scheduler_output, *args, **kwargs):
        steps.append([bool(scheduler_output.scheduled_spec_decode_tokens), None, None])
        return type(runner).execute_model(runner, scheduler_output, *args, **kwargs)

    def build_attention_metadata(*args, **kwargs):
        if not kwargs.get("for_cudagraph_capture"):
            steps[-1][1:] = kwargs.get("use_spec_decode"), runner.speculative_config is None
        return type(runner)._build_attention_metadata(runner, *args, **kwargs)

    runner.execute_model, runner._build_attention_metadata = execute_model, build_attention_metadata
    try:
        batch = prompts[:4]
        outs = llm.generate(batch, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        del runner.execute_model, runner._build_attention_metadata
    for p, o in zip(batch, outs):
        assert list(o.outputs[0].token_ids) == native_reference[(p, 7)], p[:40]
    assert runner.speculative_config is config
    plain = [s for s in steps if not s[0]]
    drafted = [s for s in steps if s[0]]
    assert plain and drafted, steps
    assert all(s[1:] == [False, True] for s in plain), steps
    assert all(s[1:] == [True, False] for s in drafted), steps
    assert steps[0][0] is False and steps[1][0] is True  # the prefill, then the drafts it proposed
