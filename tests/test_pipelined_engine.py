"""The pipelined step (issue 12, RFC §7) in vLLM's engine: greedy output
equals native, every in-flight token's state (pruned ones included) equals
a serial full-depth pass over its chain, forced rejection at every stage
commits the right tokens and KV, sampled output keeps the target
distribution, and cancellation and preemption free every KV block.

The schedule itself (no engine) is checked first: tick counts at full
acceptance, one token per request per loop group, and that a token at loop
``u`` only ever runs after every earlier slot of its request has written
its loop-``u`` KV since its own last restart."""

import math

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from conftest import make_llm
from engine_access import engine_core, model_runner, skip_unless_kv_readable
from prompts import SHORT
from test_loopspec_greedy import BUDGETS, native_outputs
from test_loopspec_sampling import build_v16, check_target_marginals
from test_loopspec_serving import check_cancellation_frees_kv, check_preemption_keeps_output_exact
from test_loopspec_state import _run_steps, check_kv_equals_oracle, native_continuation
from vllm_loopspec.speculative.pipeline import PipelineSchedule
from vllm_loopspec.speculative.plan import StepLayout
from vllm_loopspec.speculative.planes import plane_offsets, stack_loop_planes

# (K, d1, d2): every draft depth, K from 1 to 8, second proposals at both depths d1 = 1 allows.
PIPELINES = [(1, 2, None), (4, 1, None), (8, 2, None), (4, 3, None), (4, 1, 2), (8, 1, 3)]
ATOL = 1e-4


def pipelined(loopspec_llms, k, d, d2=None):
    return loopspec_llms(k, d, schedule="pipelined", second_proposal_loop=d2)


# -- the schedule, without an engine ---------------------------------------------

def _layout(rows):
    """``rows``: per request, (non-draft tokens, K_i, tokens before the step)."""
    query = np.array([n + k for n, k, _ in rows])
    start = np.concatenate([[0], np.cumsum(query)])
    return StepLayout(query_start=start, num_drafts=np.array([k for _, k, _ in rows]),
                      seq_lens=np.array([c for _, _, c in rows]) + query)


def _drive(schedule, truth, wrong_first=frozenset(), right_second=True):
    """Run ``schedule`` with ``truth[row][slot]`` the target's token for
    ``slot`` (1-based), first proposals wrong at ``(row, slot)`` in
    ``wrong_first``, second proposals (if any) right or all wrong; checks
    the KV invariant of every pass."""
    ran = {(r, j): set() for r in schedule.spec_rows for j in range(schedule.num_drafts[r] + 1)}
    while not schedule.done:
        for pass_ in schedule.passes():
            for loop, entries in pass_.groups:
                assert len({e.row for e in entries}) == len(entries), "two tokens of a request in one group"
                for e in entries:
                    if e.row not in schedule.num_drafts:
                        continue
                    j = e.start - schedule.anchor[e.row] if e.count == 1 and e.start > schedule.anchor[e.row] else 0
                    for earlier in range(j):
                        assert loop in ran[(e.row, earlier)], f"slot {j} at loop {loop} before slot {earlier}"
                    ran[(e.row, j)].add(loop)
        propose, refine, verify = schedule.finish_tick()
        for r, j in propose:
            token = truth[r][j + 1]
            schedule.proposed(r, j, token + 1000 if (r, j + 1) in wrong_first else token)
        for group, keep, wrong in ((refine, schedule.refined, 0 if right_second else 2000), (verify, schedule.verified, 0)):
            for r, j in group:
                if not keep(r, j, truth[r][j + 1] + wrong):
                    for k in range(j + 1, schedule.num_drafts[r] + 1):
                        ran[(r, k)] = set()  # restarted or pruned: its loops run again
    return schedule.drafts()


def test_stacked_planes_address_every_plane_in_one_view():
    """Planes a whole number of blocks apart in one buffer (as vLLM lays
    out its caches) become one view per layer; other layouts are refused."""
    blocks, loops, layers = 4, 3, 2
    buffer = torch.arange(loops * layers * blocks * 6, dtype=torch.float32).view(layers, loops, blocks, 1, 2, 3)
    planes = {(u, i): buffer[i, u] for u in range(loops) for i in range(layers)}
    stacked = stack_loop_planes(planes, lambda u, i: (u, i), layers, loops, block_size=2)
    assert stacked.block_offset == (0, blocks, 2 * blocks)
    for i in range(layers):
        for u in range(loops):
            for b in range(blocks):
                view = stacked.caches[i][stacked.block_offset[u] + b]
                assert view.data_ptr() == planes[(u, i)][b].data_ptr() and torch.equal(view, planes[(u, i)][b])
    # Planes in separate allocations, or layers laid out differently: refused.
    assert stack_loop_planes({k: v.clone() for k, v in planes.items()}, lambda u, i: (u, i), layers, loops, 2) is None
    swapped = dict(planes)
    swapped[(0, 1)], swapped[(1, 1)] = planes[(1, 1)], planes[(0, 1)]
    assert stack_loop_planes(swapped, lambda u, i: (u, i), layers, loops, 2) is None
    assert plane_offsets([buffer[0, 0], buffer[0, 1][:, :, :, :2]]) is None  # other shape


def test_pipelined_engines_run_every_pass_in_one_attention_call(loopspec_llms):
    """The test engines' caches allow stacking, so every multi-group pass of
    the tests above took the merged call (an engine with a KV connector, or
    off the CPU backend, keeps one call per group)."""
    drafter = model_runner(pipelined(loopspec_llms, 4, 1)).drafter
    planes = drafter.stacked_planes()
    assert planes is not None
    assert len(planes.caches) == drafter.model.config.num_hidden_layers
    assert len(set(planes.block_offset)) == drafter.num_loops


def test_one_attention_call_per_group_equals_native(loopspec_llms, prompts, native_reference, monkeypatch):
    """Where the planes cannot be stacked (a KV connector, a GPU backend,
    ``VLLM_LOOPSPEC_MERGED_PLANES=0``) each loop group is its own call with
    its own metadata (shared by a set of tokens across loops): still exact."""
    import vllm_loopspec.models.ouro as ouro

    llm = pipelined(loopspec_llms, 4, 1)
    drafter = model_runner(llm).drafter
    merged_calls = []
    merged_attention = ouro._merged_attention
    monkeypatch.setattr(ouro, "_merged_attention", lambda *a: merged_calls.append(1) or merged_attention(*a))
    planes, drafter._planes = drafter._planes, (None,)
    try:
        ticks_before = drafter.stats.pipelined_ticks
        params = SamplingParams(max_tokens=BUDGETS[-1], temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        drafter._planes = planes
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == native_reference[(p, BUDGETS[-1])], p[:40]
    assert drafter.stats.pipelined_ticks > ticks_before and not merged_calls


def test_vllm_runs_lm_head_only_where_the_step_did_not_verify(loopspec_llms, prompts, native_reference,
                                                              monkeypatch):
    """A pipelined step computes the loop-R logits of every slot with a
    successor to verify it; vLLM's sampler gets those rows from the step and
    runs ``lm_head`` over the rest only (bonus positions, rows without
    drafts). The logits it gets equal an ``lm_head`` over every row, and the
    output stays native's."""
    llm = pipelined(loopspec_llms, 4, 1)
    model = model_runner(llm).drafter.model
    processor, compute_logits = model.logits_processor, model.compute_logits
    computed, steps = [0], []

    def counting(lm_head, hidden, *args, **kwargs):
        computed[0] += hidden.shape[0]
        return type(processor).forward(processor, lm_head, hidden, *args, **kwargs)

    def checked(hidden):
        precomputed = model.precomputed_logits
        if precomputed is None:
            return compute_logits(hidden)
        every_row = type(processor).forward(processor, model.lm_head, hidden)
        before = computed[0]
        out = compute_logits(hidden)
        steps.append((hidden.shape[0], computed[0] - before, precomputed.missing.numel(),
                      float((out - every_row).abs().max())))
        return out

    monkeypatch.setattr(processor, "forward", counting)
    monkeypatch.setattr(model, "compute_logits", checked)
    params = SamplingParams(max_tokens=BUDGETS[-1], temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == native_reference[(p, BUDGETS[-1])], p[:40]
    assert steps, "no pipelined step handed its logits over"
    for rows, ran, missing, error in steps:
        assert ran == missing < rows
        assert error < ATOL
    # every speculating row's K drafts came from the step: lm_head ran over about 1 row in K + 1
    assert sum(ran for _, ran, _, _ in steps) * 2 < sum(rows for rows, _, _, _ in steps)


@pytest.mark.parametrize("d1", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_full_acceptance_takes_k_plus_fill_ticks(k, d1):
    loops = 4
    layout = _layout([(1, k, 10), (5, 0, 0), (1, k, 30)])  # a prefill chunk between two speculating rows
    schedule = PipelineSchedule(layout, loops, d1)
    truth = {r: list(range(100 * r, 100 * r + k + 1)) for r in (0, 2)}
    drafts = _drive(schedule, truth)
    assert drafts == truth[0][1:] + truth[2][1:]
    assert schedule.counts.ticks == k + math.ceil(loops / d1)
    assert schedule.counts.restarts == 0
    assert schedule.counts.first_accepted == [2] * k


@pytest.mark.parametrize("d1", [1, 2, 3])
@pytest.mark.parametrize("wrong", [1, 2, 4, 6])
def test_a_wrong_proposal_restarts_its_slot_and_prunes_the_rest(wrong, d1):
    k, loops = 6, 4
    schedule = PipelineSchedule(_layout([(1, k, 10), (1, k, 12)]), loops, d1)
    truth = {0: list(range(k + 1)), 1: list(range(50, 51 + k))}
    drafts = _drive(schedule, truth, wrong_first={(0, wrong)})
    assert drafts == truth[0][1:] + truth[1][1:]
    assert schedule.counts.restarts == 1
    first = schedule.counts.first_accepted
    assert first[wrong - 1] == 1  # row 1's; row 0's first proposal there was replaced
    # The restart costs the slot's refill: ceil(R / d1) - 1 more ticks than full acceptance.
    assert schedule.counts.ticks == k + math.ceil(loops / d1) + math.ceil(loops / d1) - 1


@pytest.mark.parametrize("d2", [2, 3])
@pytest.mark.parametrize("wrong", [1, 3, 6])
def test_a_second_proposal_replaces_a_wrong_first_one_earlier(wrong, d2):
    """d1 = 1: a right second proposal restarts the slot when its
    predecessor reaches d2, (d2 - d1) ticks after it started instead of
    R - d1; wrong second proposals are replaced at verification."""
    k, loops = 6, 4
    truth = {0: list(range(k + 1))}
    schedule = PipelineSchedule(_layout([(1, k, 10)]), loops, 1, second_proposal_loop=d2)
    assert _drive(schedule, truth, wrong_first={(0, wrong)}) == truth[0][1:]
    assert (schedule.counts.refined, schedule.counts.restarts, schedule.counts.second_accepted) == (1, 0, 1)
    assert schedule.counts.ticks == k + loops + (d2 - 1)
    wrong_second = PipelineSchedule(_layout([(1, k, 10)]), loops, 1, second_proposal_loop=d2)
    assert _drive(wrong_second, truth, wrong_first={(0, wrong)}, right_second=False) == truth[0][1:]
    # Every second proposal wrong: each replaces its (right or wrong) first one and is itself replaced
    # (a slot restarted at verification refines its new successor again).
    counts = wrong_second.counts
    assert (counts.restarts, counts.second_accepted) == (k, 0) and counts.refined >= k


def test_second_proposal_loop_must_be_a_deeper_multiple_of_draft_loops():
    layout = _layout([(1, 2, 3)])
    for d1, d2 in ((1, 1), (1, 4), (2, 3)):
        with pytest.raises(ValueError, match="multiple of draft_loops"):
            PipelineSchedule(layout, 4, d1, second_proposal_loop=d2)


def test_every_proposal_wrong_still_commits_the_targets():
    k, loops = 5, 4
    schedule = PipelineSchedule(_layout([(1, k, 3)]), loops, 1)
    truth = {0: list(range(k + 1))}
    assert _drive(schedule, truth, wrong_first={(0, j) for j in range(1, k + 1)}) == truth[0][1:]
    assert schedule.counts.restarts == k
    assert schedule.counts.first_accepted == [0] * k


# -- the sampled decider, without an engine -------------------------------------

def _probabilities(*values):
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


# A shallow q1, a deeper q2 and the target p over 6 tokens, far apart (token
# 5 impossible under q1, token 0 under p: the residual and zero-mass paths run).
Q1, Q2, P = (_probabilities(5, 3, 1, 1, 2, 0), _probabilities(1, 4, 2, 1, 1, 1), _probabilities(0, 1, 2, 3, 1, 5))
DECIDER_DRAWS = 6000


def _decide_chain(second: bool, seed: int | None):
    """One slot's life in a decider: proposed from ``Q1``, refined against
    ``Q2`` if ``second``, verified against ``P``; the logits are the logs
    (``process`` is a softmax). Returns (first proposal, refined, decided)."""
    from vllm_loopspec.speculative.pipeline import SampledDecider

    generators = {} if seed is None else {0: torch.Generator().manual_seed(seed)}
    decider = SampledDecider(lambda logits, rows: logits.softmax(dim=-1), {0: True, 1: False}, generators)
    # Row 1 is greedy and rides along in every call: it takes the argmax.
    greedy = torch.tensor([0.0, 0, 9, 0, 0, 0])
    first, greedy_first = decider.decide(torch.stack([Q1.log(), greedy]), [(0, 0), (1, 0)], [], [], [])
    refined = first
    if second:
        (refined,) = decider.decide(Q2.log()[None], [], [(0, 0)], [], [first])
    decided, greedy_decided = decider.decide(torch.stack([P.log(), greedy]), [], [], [(0, 0), (1, 0)],
                                             [refined, greedy_first])
    assert greedy_first == greedy_decided == 2
    assert torch.allclose(decider.target[(0, 0)], P) and not decider.proposal_q
    return first, refined, decided


@pytest.mark.parametrize("second", [False, True], ids=["first_only", "second_proposal"])
def test_the_sampled_decider_decides_tokens_that_follow_the_target(second):
    """Proposals follow q1, refined successors q2 and decided ones p
    (chi-square), and a seeded row replays exactly."""
    from collections import Counter

    from test_loopspec_sampling import CHI2_999, chi_square

    torch.manual_seed(0)
    chains = [_decide_chain(second, None) for _ in range(DECIDER_DRAWS)]
    for position, want in ((0, Q1), (1, Q2 if second else Q1), (2, P)):
        stat, dof = chi_square(Counter(c[position] for c in chains), want, DECIDER_DRAWS)
        assert stat < CHI2_999[dof], (position, stat)
    assert any(c[2] != c[1] for c in chains) and any(c[2] == c[1] for c in chains)  # kept and replaced both ran
    assert [_decide_chain(second, 7) for _ in range(3)] == [_decide_chain(second, 7) for _ in range(3)]


def test_a_rejection_with_no_residual_mass_draws_from_the_target():
    """Where p <= q everywhere (p = q up to rounding) the residual
    max(p - q, 0) has no mass; a rejection there (possible only through
    rounding, forced here through the uniforms) draws from p itself, never
    a token p cannot produce."""
    from vllm_loopspec.speculative.pipeline import SampledDecider

    q = torch.tensor([0.2, 0.3, 0.5, 0.0, 0.0, 0.0])
    p = q.clone()
    p[2] -= 1e-3  # p(c) < q(c) at the proposal c = 2, equal elsewhere: no residual mass
    decider = SampledDecider(lambda distributions, rows: distributions, {0: True}, {})
    uniforms = iter([(0.7, 0.0), (0.3, 0.9999)])  # propose c = 2; reject it (0.9999 q(c) > p(c))
    decider._uniforms = lambda rows, device: torch.tensor([next(uniforms)], dtype=torch.float64)
    (first,) = decider.decide(q[None], [(0, 0)], [], [], [])
    (decided,) = decider.decide(p[None], [], [], [(0, 0)], [first])
    assert first == 2
    assert decided == 1  # p's inverse CDF at 0.3 (an empty residual's would give the last, impossible, token)


# -- in the engine ---------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(tokenizer):
    from conftest import MAX_BATCHED_TOKENS
    from prompts import MEDIUM, long_prompt

    long_a = long_prompt(MAX_BATCHED_TOKENS + 40, tokenizer)  # chunk-prefilled
    long_b = long_prompt(2 * MAX_BATCHED_TOKENS + 9, tokenizer)[::-1]
    return SHORT[:5] + MEDIUM[:1] + [long_a, long_b]


@pytest.fixture(scope="module")
def native_reference(native_llm, prompts):
    return native_outputs(native_llm, prompts, BUDGETS)


@pytest.mark.parametrize("k,d,d2", PIPELINES)
def test_pipelined_greedy_equals_native(loopspec_llms, prompts, native_reference, k, d, d2):
    """Width 8 (a batch with two chunk-prefilled prompts) and width 1, for
    budgets that end mid-pipeline."""
    llm = pipelined(loopspec_llms, k, d, d2)
    stats = model_runner(llm).drafter.stats
    restarts_before, second_before = stats.pipelined_restarts, stats.pipelined_second_proposals
    for budget in BUDGETS:
        params = SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert list(o.outputs[0].token_ids) == native_reference[(p, budget)], (k, d, budget, p[:40])
        for p in (prompts[0], prompts[6]):
            out = llm.generate([p], params, use_tqdm=False)[0]
            assert list(out.outputs[0].token_ids) == native_reference[(p, budget)], (k, d, budget, "width 1")
    assert stats.pipelined_ticks > 0
    if k > 1:  # otherwise the equality above would not exercise restarts
        assert stats.pipelined_restarts > restarts_before
    if d2 is not None:
        assert stats.pipelined_second_proposals > second_before


def test_in_flight_states_equal_serial_oracle(loopspec_llms, oracle, tokenizer):
    """Every state every pipelined token had, at every loop, equals a
    full-depth pass over its chain, including tokens later pruned or
    replaced, and so do the logits it proposed (loop 1, d1 = 1) and
    verified (loop R) with. KV: test_forced_rejection_at_every_stage."""
    llm = pipelined(loopspec_llms, 4, 1)
    skip_unless_kv_readable(llm)
    drafter = model_runner(llm).drafter
    model = model_runner(llm).model
    trace: list[dict] = []
    drafter.pipeline_trace = trace
    try:
        ids = tokenizer(SHORT[5])["input_ids"]
        _run_steps(llm, ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), lambda: None)
    finally:
        drafter.pipeline_trace = None
    assert trace
    prompt_len = len(ids)
    # Each record's chain starts at A, position - len(chain) + 1; the prefix
    # before A is the prompt plus what was committed before that step.
    committed = ids + list(llm.generate([{"prompt_token_ids": ids}],
                                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                        use_tqdm=False)[0].outputs[0].token_ids)
    pruned_or_replaced = 0
    cache: dict[tuple, object] = {}
    for rec in trace:
        a_pos = rec["position"] - len(rec["chain"]) + 1
        assert a_pos >= prompt_len - 1
        seq = tuple(committed[:a_pos] + rec["chain"])
        if seq not in cache:
            cache[seq] = oracle.trace(torch.tensor(seq))
        ref = cache[seq]
        want = ref.hidden[rec["loop"]][0, rec["position"]]
        torch.testing.assert_close(rec["state"], want, atol=ATOL, rtol=0)
        if rec["loop"] in (0, model.num_loops - 1):  # the depths whose logits propose and verify
            with torch.no_grad():
                torch.testing.assert_close(model.compute_logits(rec["state"][None]).float()[0],
                                           oracle.lm_head(want).float(), atol=1e-3, rtol=1e-4)
        if list(seq) != committed[: len(seq)]:
            pruned_or_replaced += 1
    assert pruned_or_replaced > 0, "no pruned or replaced token was checked"


def forcing_wrong_first_proposal(full, vocab, wrong_slot):
    """First proposals equal the committed sequence except at ``wrong_slot``."""
    def override(req_id, slot, token, anchor_pos):
        target = full[anchor_pos + slot]
        return (target + 1) % vocab if slot == wrong_slot else target

    return override


@pytest.mark.parametrize("wrong_slot", [1, 2, 3, 4])
def test_forced_rejection_at_every_stage(loopspec_llms, native_llm, oracle, tokenizer, wrong_slot):
    """A wrong first proposal at slot ``wrong_slot`` of every step is
    replaced inside the step: vLLM accepts the whole chain (frontier
    ``A + 1 + K``), the output is native's, and the KV of every position
    at every loop is the committed sequence's (stale entries of the wrong
    proposal and of its pruned successors were overwritten)."""
    k = 4
    llm = pipelined(loopspec_llms, k, 2)
    runner = model_runner(llm)
    sched = engine_core(llm).scheduler
    vocab = runner.model.config.vocab_size
    prompt_ids, native, params = native_continuation(native_llm, tokenizer, 23)
    full = prompt_ids + native
    drafter = runner.drafter
    trace: list[dict] = []
    frontiers, slot_of = [], {}
    restarts_before = drafter.stats.pipelined_restarts
    seen = [0]

    def on_step():
        req = next(iter(sched.requests.values()), None)
        new = len(trace) > seen[0] and trace[-1]
        seen[0] = len(trace)
        if new:
            (rnd,) = trace[-1].values()
            slot_of.update(zip(rnd["positions"], rnd["slots"]))
            if req is not None:
                frontiers.append((req.num_computed_tokens, rnd["positions"][0] + len(rnd["tokens"])))

    loops = drafter.num_loops
    rows_before = _rows_per_loop(drafter.stats.rows_per_loop, loops)
    masked_before = _rows_per_loop(drafter.stats.masked_rows_per_loop, loops)
    drafter.draft_override = forcing_wrong_first_proposal(full, vocab, wrong_slot)
    drafter.trace = trace
    try:
        out = _run_steps(llm, prompt_ids, params, on_step)
    finally:
        drafter.draft_override = drafter.trace = None
    assert out == native
    assert frontiers and all(got == want for got, want in frontiers)
    steps_with_slot = sum(1 for rnd in trace for r in rnd.values() if len(r["tokens"]) > wrong_slot)
    assert drafter.stats.pipelined_restarts - restarts_before == steps_with_slot > 0
    # Rows per loop, exactly: every forwarded token ([A, c_1..c_K] of each
    # step) passes each loop once; each wrong first proposal also ran loops
    # [0, d1) before its predecessor reached R (d1 = 2 = R - d1) and was
    # replaced; the successor it had proposed in that tick was pruned before
    # it ran. Nothing is masked in a pipelined step.
    forwarded = sum(len(r["tokens"]) for rnd in trace for r in rnd.values())
    d1 = drafter.draft_loops
    rows = [a - b for a, b in zip(_rows_per_loop(drafter.stats.rows_per_loop, loops), rows_before)]
    assert rows == [forwarded + (steps_with_slot if u < d1 else 0) for u in range(loops)]
    assert _rows_per_loop(drafter.stats.masked_rows_per_loop, loops) == masked_before
    skip_unless_kv_readable(llm)
    check_kv_equals_oracle(llm, oracle, full, slot_of)


def _rows_per_loop(counts: list[int], loops: int) -> list[int]:
    return (list(counts) + [0] * loops)[:loops]


def test_pipelined_cancellation_frees_kv(loopspec_llms, tokenizer):
    check_cancellation_frees_kv(pipelined(loopspec_llms, 4, 1), tokenizer, prefix="pipelined-cancel")


def test_pipelined_preemption_keeps_output_exact(tiny_checkpoint, native_llm, tokenizer):
    check_preemption_keeps_output_exact(tiny_checkpoint, native_llm, tokenizer,
                                        speculative={"schedule": "pipelined", "draft_loops": 1})


# -- sampled -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def v16_pipelined(tmp_path_factory):
    """The 16-token checkpoint, pipelined engines without and with a second
    proposal at loop 2 (d1 = 1)."""
    path, oracle = build_v16(tmp_path_factory.mktemp("v16p"))
    engines = {}

    def get(d2):
        if d2 not in engines:
            engines[d2] = make_llm(path, {"method": "loopspec", "num_speculative_tokens": 2, "draft_loops": 1,
                                          "schedule": "pipelined", "second_proposal_loop": d2},
                                   skip_tokenizer_init=True, max_num_seqs=256, max_num_batched_tokens=2048)
        return engines[d2]

    return get, oracle


@pytest.mark.parametrize("d2", [None, 2], ids=["first_only", "second_at_2"])
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.8, top_k=6, top_p=0.9)],
                         ids=["temperature", "top_k_top_p"])
def test_pipelined_sampling_recovers_target_distribution(v16_pipelined, setting, d2):
    get, oracle = v16_pipelined
    llm = get(d2)
    stats = model_runner(llm).drafter.stats
    restarts_before, second_before = stats.pipelined_restarts, stats.pipelined_second_proposals
    check_target_marginals(llm, oracle, setting, power_check=True)
    assert stats.pipelined_restarts > restarts_before, "no proposal was replaced: the residual path is untested"
    if d2 is not None:
        assert stats.pipelined_second_proposals > second_before, "no second proposal replaced a first one"


@pytest.mark.parametrize("schedule", ["pipelined", "auto"])
def test_pipelined_under_async_scheduling_equals_native(tiny_checkpoint, prompts, native_reference, schedule):
    """vLLM's async scheduler (placeholder drafts trimmed per row, lengths
    corrected on the device) with pipelined steps, and with "auto" switching
    between them and the policy's (its rates observed one step late): still
    native's tokens."""
    spec = {"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 1, "schedule": schedule}
    llm = make_llm(tiny_checkpoint, spec, async_scheduling=True)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling, "async scheduling did not stay on"
    for budget in BUDGETS:
        outs = llm.generate(prompts, SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert list(o.outputs[0].token_ids) == native_reference[(p, budget)], (budget, p[:40])
    drafter = model_runner(llm).drafter
    assert drafter.stats.pipelined_ticks > 0
    if schedule == "auto":
        # Rates were observed (one step late), for more than one arm.
        observed = {arm for key in drafter.chooser._keys.values() for arm, r in key.arms.items() if r.samples}
        assert len(observed) >= 2, drafter.chooser.decisions
