"""loopspec under continuous batching: stops inside accepted runs, requests
joining mid-generation, preemption, cancellation (KV freed), metrics."""

import pytest
from vllm import SamplingParams

from conftest import make_llm
from engine_access import engine_core, free_blocks, model_runner, spec_metrics
from prompts import MEDIUM, SHORT, long_prompt

K = 4


def _native(native_llm, prompt_ids, params):
    out = native_llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text


def _accept_everything(full):
    return lambda req_id, step, token, anchor_pos: full[anchor_pos + step] if anchor_pos + step < len(full) else token


STOP_CASES = 3


@pytest.fixture(scope="module")
def stop_inside_first_round(native_llm, tokenizer):
    """(prompt ids, free-running native output, index of the stop token) for
    the first prompts whose output has a token not seen before among
    drafts 2..K-1 of the first round. Output token 0 comes from prefill;
    round 1 drafts tokens 1..K, so a stop there is strictly inside the run."""
    cases = []
    for prompt in SHORT + MEDIUM:
        prompt_ids = tokenizer(prompt)["input_ids"]
        free_run, _ = _native(native_llm, prompt_ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        inside = [i for i in range(2, K) if free_run[i] not in free_run[:i]]
        if inside:
            cases.append((prompt_ids, free_run, inside[0]))
    assert len(cases) >= STOP_CASES, "too few prompts with a fresh token inside the first round; add prompts"
    return cases[:STOP_CASES]


# Both schedules: a pipelined step hands vLLM a verified chain, and vLLM's
# stop handling and continuous batching must treat it as any round's.
SCHEDULES = ["round", "pipelined"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", range(STOP_CASES))
def test_stop_token_inside_accepted_run_cuts_there(loopspec_llms, native_llm, stop_inside_first_round, case,
                                                   schedule):
    """All drafts are accepted (forced to the target's tokens); a stop token
    that is the 2nd/3rd draft of a round ends the output there, like EOS."""
    llm = loopspec_llms(K, schedule=schedule)
    runner = model_runner(llm)
    prompt_ids, free_run, stop_index = stop_inside_first_round[case]
    full = prompt_ids + free_run
    stop_token = free_run[stop_index]
    params = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_token])
    expected, expected_text = _native(native_llm, prompt_ids, params)
    assert expected == free_run[: stop_index + 1]
    trace = []
    runner.drafter.draft_override = _accept_everything(full)
    runner.drafter.trace = trace
    try:
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
    finally:
        runner.drafter.draft_override = None
        runner.drafter.trace = None
    assert list(out.token_ids) == expected
    assert out.text == expected_text
    assert out.finish_reason == "stop"
    (first_round,) = trace[0].values()
    assert stop_token in first_round["tokens"][1:-1], "the stop token was not inside the accepted run"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stop_string_inside_accepted_run(loopspec_llms, native_llm, tokenizer, schedule):
    llm = loopspec_llms(K, schedule=schedule)
    runner = model_runner(llm)
    prompt_ids = tokenizer(SHORT[1])["input_ids"]
    free_ids, free_text = _native(native_llm, prompt_ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stop = tokenizer.decode(free_ids[2:4]).strip()[:3] or tokenizer.decode(free_ids[2:4])
    params = SamplingParams(max_tokens=30, temperature=0, stop=[stop])
    expected_ids, expected_text = _native(native_llm, prompt_ids, params)
    runner.drafter.draft_override = _accept_everything(prompt_ids + free_ids)
    try:
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
    finally:
        runner.drafter.draft_override = None
    assert out.text == expected_text
    assert list(out.token_ids) == expected_ids
    assert len(expected_ids) < 30


@pytest.mark.parametrize("schedule", SCHEDULES + ["auto"])
def test_requests_joining_mid_generation_equal_native(loopspec_llms, native_llm, tokenizer, schedule):
    """Prefill chunks share steps with speculating requests (pipelined: the
    same ticks; "auto": its arms in turn, forced, since which arm the chooser
    picks depends on the machine's timings)."""
    if schedule == "auto":
        llm = loopspec_llms(K, 1, adaptive=True, schedule="auto")
    else:
        llm = loopspec_llms(K, schedule=schedule)
    drafter = model_runner(llm).drafter
    if schedule == "auto":
        from vllm_loopspec.speculative.schedule_choice import ARMS, ScheduleChoice

        turn = iter(range(10**6))
        drafter.chooser.choose = lambda width, mix, context=0, in_flight=None: ScheduleChoice(ARMS[next(turn) % 3], "measure")
    try:
        _join_mid_generation(llm, native_llm, tokenizer)
    finally:
        if drafter.chooser is not None:
            drafter.chooser.__dict__.pop("choose", None)


def _join_mid_generation(llm, native_llm, tokenizer):
    drafter = model_runner(llm).drafter
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    arrivals = {0: [SHORT[0], SHORT[1]], 2: [long_prompt(300, tokenizer)], 5: [MEDIUM[0], SHORT[4]]}
    expected = {}
    for step_prompts in arrivals.values():
        for p in step_prompts:
            expected[p] = list(native_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
    engine = llm.llm_engine
    rounds_before, pipelined_before = drafter.stats.rounds, drafter.stats.pipelined_steps
    got, step, rid_to_prompt = {}, 0, {}
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, p in enumerate(arrivals.get(step, [])):
            rid = f"join-{step}-{i}"
            rid_to_prompt[rid] = p
            engine.add_request(rid, p, params)
        for out in engine.step():
            if out.finished:
                got[rid_to_prompt[out.request_id]] = list(out.outputs[0].token_ids)
        step += 1
    assert got == expected
    assert drafter.stats.rounds + drafter.stats.pipelined_steps > rounds_before + pipelined_before


def test_cancelled_requests_free_their_kv(loopspec_llms, tokenizer):
    check_cancellation_frees_kv(loopspec_llms(K), tokenizer)


def check_cancellation_frees_kv(llm, tokenizer, prefix: str = "cancel") -> None:
    """Requests cancelled while prefilling and while speculating free every
    KV block they held."""
    engine = llm.llm_engine
    before = free_blocks(llm)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompts = SHORT[:4] + [long_prompt(260, tokenizer), MEDIUM[1]]
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}-{i}", p, params)
    for _ in range(4):
        engine.step()
    assert free_blocks(llm) < before
    engine.abort_request([f"{prefix}-0", f"{prefix}-2", f"{prefix}-4"])
    for _ in range(3):
        engine.step()
    engine.abort_request([f"{prefix}-5"])
    while engine.has_unfinished_requests():
        engine.step()
    assert free_blocks(llm) == before
    assert not engine_core(llm).scheduler.requests


def test_preemption_by_recompute_keeps_output_exact(tiny_checkpoint, native_llm, tokenizer):
    """A KV pool of 6 blocks (768 tokens) for 5 requests of ~250 tokens forces
    vLLM to preempt and recompute; loopspec output must stay native."""
    check_preemption_keeps_output_exact(tiny_checkpoint, native_llm, tokenizer)


def check_preemption_keeps_output_exact(tiny_checkpoint, native_llm, tokenizer, speculative: dict | None = None,
                                        **engine_overrides) -> None:
    spec = {"method": "loopspec", "num_speculative_tokens": K, "draft_loops": 2, "adaptive": False,
            **(speculative or {})}
    llm = make_llm(tiny_checkpoint, spec, num_gpu_blocks_override=6, max_model_len=512, **engine_overrides)
    prompts = [long_prompt(120 + 10 * i, tokenizer) + SHORT[i] for i in range(5)]
    params = SamplingParams(max_tokens=110, temperature=0, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [list(o.outputs[0].token_ids) for o in native_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    sched_stats = engine_core(llm).scheduler
    assert sched_stats.kv_cache_manager.block_pool.num_gpu_blocks == 6
    assert any(m.name == "vllm:num_preemptions" and m.value > 0 for m in llm.get_metrics()), \
        "the workload did not preempt"
    assert not sched_stats.requests
    assert free_blocks(llm) == sched_stats.kv_cache_manager.block_pool.num_gpu_blocks - 1  # all but the null block


def test_spec_decode_metrics_match_rounds(tiny_checkpoint, tokenizer):
    """vLLM's spec_decode counters (read right after creating this engine:
    they are the newest engine's in this process) agree with loopspec's own:
    every output token comes from prefill, an accepted draft, a round's
    correction/bonus token, or a step without drafts."""
    llm = make_llm(tiny_checkpoint, {"method": "loopspec", "num_speculative_tokens": 3, "draft_loops": 1, "adaptive": False})
    params = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)
    outs = llm.generate(SHORT, params, use_tqdm=False)
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = model_runner(llm).drafter.stats
    m = spec_metrics(llm)
    assert m["vllm:spec_decode_num_drafts"] == stats.speculating_rows
    assert m["vllm:spec_decode_num_draft_tokens"] == stats.drafted_tokens
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    assert total == len(SHORT) + stats.speculating_rows + accepted + sum(stats.skipped.values())
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == accepted and len(per_pos) == 3
    assert stats.accepted_tokens == accepted
    assert stats.accepted_per_pos == list(per_pos)
    assert sum(stats.drafted_per_pos) == stats.drafted_tokens


def test_unverifiable_sampler_features_are_decoded_plainly(loopspec_llms, native_llm):
    """vLLM's rejection sampler cannot apply logit_bias or min_p to the target
    (vLLM refuses them with any other speculative method): loopspec serves
    them without drafts, beside requests that speculate. Greedy ones equal
    native; a min_p request samples only tokens min_p allows; the engine
    counts them by reason."""
    llm = loopspec_llms(K)
    stats = model_runner(llm).drafter.stats
    before = dict(stats.skipped)
    rounds = stats.rounds
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10, 11, 12]}]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for biased in (SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={5: 3.0, 17: -100.0}),
                   SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, min_p=0.3)):
        got = llm.generate(prompts, [biased, plain], use_tqdm=False)
        want = native_llm.generate(prompts, [biased, plain], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
    assert stats.skipped["logit_bias"] - before.get("logit_bias", 0) > 0
    assert stats.rounds > rounds  # the plain neighbour speculated meanwhile
    sampled = SamplingParams(max_tokens=16, temperature=1.0, min_p=0.9, seed=3, ignore_eos=True)
    out = llm.generate(prompts[:1], sampled, use_tqdm=False)[0].outputs[0]
    # min_p=0.9 keeps only tokens within 90% of the top probability: with
    # the tiny model's flat distributions that is (almost always) the argmax.
    ref = native_llm.generate(prompts[:1], sampled, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == list(ref.token_ids)
    # (Greedy requests carry no min_p: vLLM drops it; sampled ones skip.)
    assert stats.skipped["min_p"] - before.get("min_p", 0) > 0


def test_k_shrinks_at_the_context_limit(loopspec_llms, native_llm, tokenizer):
    """A request that runs into max_model_len (1024) ends exactly like native
    decoding; rounds near the limit draft fewer tokens instead of failing."""
    llm = loopspec_llms(8)
    ids = tokenizer(long_prompt(1000, tokenizer))["input_ids"][:1010]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    want = native_llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    trace = []
    model_runner(llm).drafter.trace = trace
    try:
        got = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    finally:
        model_runner(llm).drafter.trace = None
    assert list(got.token_ids) == list(want.token_ids)
    assert len(ids) + len(got.token_ids) <= 1024
    last_positions = [r["positions"][-1] for step in trace for r in step.values()]
    assert last_positions and max(last_positions) <= 1022  # never a slot past the context
