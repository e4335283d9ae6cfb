"""loopspec under vLLM's async scheduler (issue 15, patch 14).

vLLM schedules step t+1 before step t's tokens are back: every decoding row
gets the same placeholder drafts, the runner assumes them accepted and
corrects ``num_computed_tokens`` on the device from the counts the runner
hands over after sampling. The CPU runner runs vLLM's async path (its
``cpu/shm.py`` turns CUDA streams and events into no-ops); in-process engines
run it step by step, which exercises every piece of the bookkeeping but
overlaps nothing in time (docs/async-scheduling.md).
"""

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from vllm import SamplingParams

from conftest import MAX_BATCHED_TOKENS, make_llm
from engine_access import drafter_hooks, engine_core, model_runner, skip_unless_kv_readable
from prompts import MEDIUM, SHORT, long_prompt
from test_loopspec_greedy import native_outputs
from test_loopspec_serving import check_cancellation_frees_kv, check_preemption_keeps_output_exact
from test_loopspec_state import check_kv_equals_oracle, forcing_rejection, native_continuation
from vllm_loopspec.speculative.runner import LoopSpecRunnerMixin, committed_per_row

BUDGETS = [7, 13, 30]  # end inside a round for every K below
KS = [1, 4]


# -- the bookkeeping, without an engine -------------------------------------------

def test_committed_counts_and_newest_token_per_row():
    sampled = torch.tensor([[5, 6, -1], [7, -1, -1], [8, 9, 10], [3, -1, -1]])
    discard = torch.tensor([False, False, False, True])  # a partial prefill chunk
    counts, newest = committed_per_row(sampled, discard)
    assert counts.tolist() == [2, 1, 3, 0]
    assert newest.tolist() == [6, 7, 10, 0]


@dataclass
class _Schedule:
    """The fields of vLLM's SchedulerOutput the trim reads and writes."""

    scheduled_spec_decode_tokens: dict
    num_scheduled_tokens: dict
    total_num_scheduled_tokens: int
    other: list = field(default_factory=list)
    num_invalid_spec_tokens: dict | None = None


def test_placeholders_are_trimmed_to_each_rows_chosen_drafts():
    class Runner:
        _trim_to_chosen_drafts = LoopSpecRunnerMixin._trim_to_chosen_drafts

    runner = Runner()
    runner.drafter = type("D", (), {"next_drafts": {"a": 4, "b": 1, "c": 0}})()
    spec = {"a": [-1] * 4, "b": [-1] * 4, "c": [-1] * 4, "d": [-1] * 4}
    original = _Schedule(spec, {"a": 5, "b": 5, "c": 5, "d": 5, "p": 128}, 148)
    trimmed = runner._trim_to_chosen_drafts(original, runner.drafter.next_drafts)
    assert trimmed.scheduled_spec_decode_tokens == {"a": [-1] * 4, "b": [-1]}  # c chose 0, d unknown: none
    assert trimmed.num_scheduled_tokens == {"a": 5, "b": 2, "c": 1, "d": 1, "p": 128}
    assert trimmed.total_num_scheduled_tokens == 148 - 3 - 4 - 4
    assert runner._loopspec_scheduled_drafts == {"a": 4, "b": 4, "c": 4, "d": 4}
    # The scheduler's own object is untouched (in-process it is still its own).
    assert original.num_scheduled_tokens["b"] == 5 and len(original.scheduled_spec_decode_tokens) == 4
    assert original.num_invalid_spec_tokens is None  # placeholders cut count as rejected


def test_a_step_run_plain_instead_leaves_its_cut_slots_out_of_vllms_acceptance_counts():
    """"auto": a speculative step that arrivals joined runs plain; the cut
    slots were never drafted, and enter the scheduler's own object's
    num_invalid_spec_tokens (read by Scheduler.update_from_output)."""
    class Runner:
        _trim_to_chosen_drafts = LoopSpecRunnerMixin._trim_to_chosen_drafts

    original = _Schedule({"a": [-1] * 16, "b": [-1] * 3}, {"a": 17, "b": 4, "new": 40}, 61)
    trimmed = Runner()._trim_to_chosen_drafts(original, {}, not_drafted=True)
    assert trimmed.scheduled_spec_decode_tokens == {}
    assert trimmed.num_scheduled_tokens == {"a": 1, "b": 1, "new": 40} and trimmed.total_num_scheduled_tokens == 42
    assert original.num_invalid_spec_tokens == {"a": 16, "b": 3}
    assert original.num_scheduled_tokens["a"] == 17  # the scheduler rolls the slots back as rejected


# -- end to end, in-process async engines -----------------------------------------

@pytest.fixture(scope="module")
def async_llms(tiny_checkpoint):
    engines = {}

    def get(k, adaptive=False, schedule=None, **overrides):
        key = (k, adaptive, schedule, tuple(sorted(overrides.items())))
        if key not in engines:
            spec = {"method": "loopspec", "num_speculative_tokens": k, "draft_loops": 2, "adaptive": adaptive}
            spec |= {"schedule": schedule} if schedule else {}
            engines[key] = make_llm(tiny_checkpoint, spec, async_scheduling=True, **overrides)
            config = engines[key].llm_engine.vllm_config
            assert config.scheduler_config.async_scheduling, "async scheduling did not stay on"
            assert type(engine_core(engines[key]).scheduler).__name__ == "AsyncScheduler"
            assert model_runner(engines[key]).use_async_spec_decode
        return engines[key]

    yield get
    engines.clear()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    long_a = long_prompt(MAX_BATCHED_TOKENS + 40, tokenizer)  # chunk-prefilled
    return SHORT[:6] + MEDIUM[:1] + [long_a]


@pytest.fixture(scope="module")
def native_reference(native_llm, prompts):
    return native_outputs(native_llm, prompts, BUDGETS)


def _engine(async_llms, k):
    return async_llms(4, adaptive=True) if k == "adaptive" else async_llms(k)


@pytest.mark.parametrize("k", KS + ["adaptive"])
@pytest.mark.parametrize("width", [1, 8])
def test_greedy_async_equals_native(async_llms, prompts, native_reference, k, width):
    llm = _engine(async_llms, k)
    stats = model_runner(llm).drafter.stats
    rounds = stats.rounds
    for budget in BUDGETS:
        params = SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True)
        for start in range(0, len(prompts), width):
            batch = prompts[start:start + width]
            outs = llm.generate(batch, params, use_tqdm=False)
            for p, o in zip(batch, outs):
                assert list(o.outputs[0].token_ids) == native_reference[(p, budget)], (k, width, budget)
    assert stats.rounds > rounds, "no round ran under async scheduling"


def test_async_drafts_are_accepted_rejected_and_counted(async_llms, prompts):
    """Acceptance reaches loopspec's counters one step late, as it reaches
    the adaptive policy."""
    llm = async_llms(4)
    stats = model_runner(llm).drafter.stats
    before = (stats.drafted_tokens, stats.accepted_tokens)
    llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    drafted, accepted = stats.drafted_tokens - before[0], stats.accepted_tokens - before[1]
    assert drafted > 0 and 0 < accepted < drafted


def test_async_penalties_equal_native(async_llms, native_llm, prompts):
    """Penalties read the round's drafts (spec_token_ids): the placeholders
    vLLM's async path proposes must not overwrite them."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5)
    got = async_llms(4).generate(prompts[:4], params, use_tqdm=False)
    want = native_llm.generate(prompts[:4], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]


def test_async_unverifiable_requests_decode_plainly_beside_speculating_ones(async_llms, native_llm):
    """The scheduler gives every row K placeholders; a min_p or logit_bias
    request is trimmed to none (it decodes one token per step, exact)."""
    llm = async_llms(4)
    stats = model_runner(llm).drafter.stats
    before = dict(stats.skipped)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10, 11, 12]}]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    biased = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={5: 3.0, 17: -100.0})
    got = llm.generate(prompts, [biased, plain], use_tqdm=False)
    want = native_llm.generate(prompts, [biased, plain], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
    assert stats.skipped["logit_bias"] - before.get("logit_bias", 0) > 0


K = 4


@pytest.mark.parametrize("reject_at", list(range(K + 1)))
def test_async_forced_rejection_commits_right_tokens_and_kv_frontier(async_llms, native_llm, oracle, tokenizer,
                                                                     reject_at):
    """Drafts 1..reject_at are the target's, draft reject_at+1 is wrong. Under
    async the scheduler has already assumed every draft accepted when a round
    rejects: the next round must start right after the last accepted token
    (the corrected frontier), and the KV of every position a round wrote must
    end as the oracle's over the committed sequence."""
    llm = async_llms(K)
    runner = model_runner(llm)
    vocab = runner.model.config.vocab_size
    prompt_ids, native, params = native_continuation(native_llm, tokenizer, 26)
    full = prompt_ids + native

    trace: list[dict] = []
    with drafter_hooks(llm, forcing_rejection(full, vocab, reject_at), trace):
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == native
    rounds = [next(iter(r.values())) for r in trace if r]
    assert len(rounds) >= 2, "too few speculative rounds ran"
    for this, following in zip(rounds, rounds[1:]):
        accepted = min(reject_at, len(this["tokens"]) - 1)
        assert following["positions"][0] == this["positions"][0] + 1 + accepted
    skip_unless_kv_readable(llm)
    slot_of = {}
    for rnd in rounds:
        slot_of.update(zip(rnd["positions"], rnd["slots"]))
    check_kv_equals_oracle(llm, oracle, full, slot_of)


def test_async_cancelled_requests_free_their_kv(async_llms, tokenizer):
    check_cancellation_frees_kv(async_llms(K), tokenizer, prefix="async-cancel")


def test_async_preemption_by_recompute_keeps_output_exact(tiny_checkpoint, native_llm, tokenizer):
    check_preemption_keeps_output_exact(tiny_checkpoint, native_llm, tokenizer, async_scheduling=True)


@pytest.mark.parametrize("setting", ["temperature", "top_k_top_p"])
def test_async_sampled_loopspec_recovers_target_distribution(v16_async, setting):
    """The chi-square test of test_loopspec_sampling.py, under async."""
    from test_loopspec_sampling import SETTINGS, check_target_marginals

    (_, oracle), llm = v16_async
    check_target_marginals(llm, oracle, SETTINGS[setting])


@pytest.fixture(scope="module")
def v16_async(tmp_path_factory):
    from test_loopspec_sampling import build_v16

    v16 = build_v16(tmp_path_factory.mktemp("v16-async"))
    llm = make_llm(v16[0], {"method": "loopspec", "num_speculative_tokens": 2, "draft_loops": 1, "adaptive": False},
                   skip_tokenizer_init=True, max_num_seqs=256, max_num_batched_tokens=2048, async_scheduling=True)
    return v16, llm


def test_async_rounds_draft_what_the_policy_chose_not_what_was_scheduled(async_llms, prompts, native_reference,
                                                                        monkeypatch):
    """The async scheduler gives every decoding row the engine's maximum K
    (8 for the adaptive policy); rounds must draft each row's own K_i (here
    the policy is pinned to 2) and stay exact."""
    llm = async_llms(4, adaptive=True, schedule="round")
    controller = model_runner(llm).drafter.controller
    monkeypatch.setattr(controller, "plan", lambda requests, other_tokens=0, context=0, remaining=None: (
        [min(2, limit) for _, _, limit in requests], {}))
    trace: list[dict] = []
    with drafter_hooks(llm, trace=trace):
        outs = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [native_reference[(p, 30)] for p in prompts]
    drafted = Counter(len(r["tokens"]) - 1 for rnd in trace for r in rnd.values())
    assert model_runner(llm).num_spec_tokens == 8
    assert drafted[2] > 0 and max(drafted) == 2, drafted


def test_async_min_p_request_never_drafts_and_stays_exact(async_llms, native_llm):
    """A sampled min_p request cannot be verified by vLLM's rejection sampler:
    its placeholders are trimmed away every step while its neighbour drafts."""
    llm = async_llms(4)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10, 11, 12]}]
    params = [SamplingParams(max_tokens=16, temperature=1.0, min_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)]
    trace: list[dict] = []
    with drafter_hooks(llm, trace=trace):
        got = llm.generate(prompts, params, use_tqdm=False)
    want = native_llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
    # (The engine's request ids carry a suffix after the caller's.)
    speculated = Counter(req_id.rsplit("-", 1)[0] for rnd in trace for req_id in rnd)
    min_p_id, plain_id = got[0].request_id, got[1].request_id
    assert speculated[plain_id] > 0 and speculated[min_p_id] == 0, speculated
