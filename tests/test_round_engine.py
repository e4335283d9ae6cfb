"""The round engine: ticks planned once per step and run without the host.

* A mixed step (a prefill chunk beside speculating rows with different
  ``K_i``) leaves, at every loop and layer, the serial oracle's KV at every
  position a round touched (drafts the target later rejects included).
* Masked rows (a row with ``K_i < K_max`` in draft tick ``j > K_i``) write
  no KV: a round changes exactly the slots of the tokens it forwards.
* A greedy round reads nothing back to the host between its first and its
  last tick.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from vllm import SamplingParams

import vllm_loopspec.speculative.drafter as drafter_module
from engine_access import kv_by_slot, model_runner, read_kv, skip_unless_kv_readable
from prompts import MEDIUM, SHORT, long_prompt
from vllm_loopspec.models.ouro import kv_layer_name

K = 4
ATOL = 1e-4


def _mixed_workload(llm, tokenizer, on_step):
    """Two requests speculate (one so near its token budget that its K_i is
    below the other's from its first round), and a long prompt arrives with
    their first round and is prefilled in 128-token chunks beside them."""
    engine = llm.llm_engine
    engine.add_request("long-budget", {"prompt_token_ids": tokenizer(SHORT[0])["input_ids"]},
                       SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.add_request("short-budget", {"prompt_token_ids": tokenizer(MEDIUM[1])["input_ids"]},
                       SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    step = 0
    while engine.has_unfinished_requests():
        if step == 1:
            engine.add_request("late-prefill", long_prompt(300, tokenizer),
                               SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        engine.step()
        on_step()
        step += 1


@contextlib.contextmanager
def _around_execute(llm, before, after):
    """Run ``before(plan)`` / ``after(plan, state)`` around each round's
    execution (an instance-level wrapper of the drafter's ``execute``)."""
    drafter = model_runner(llm).drafter
    original = drafter.execute

    def execute(plan, chooser, input_ids, positions):
        state = before(plan)
        out = original(plan, chooser, input_ids, positions)
        after(plan, state)
        return out

    drafter.execute = execute
    try:
        yield
    finally:
        del drafter.execute


def _assert_kv_equals_oracle(llm, oracle, rnd: dict, loops: int, n_layers: int) -> None:
    """At every loop and layer, the KV of each position a traced round
    (``drafter.trace``) touched equals the serial oracle's over its sequence."""
    ref = oracle.trace(torch.tensor(rnd["prefix"] + rnd["tokens"]))
    for u in range(loops):
        for i in range(n_layers):
            k_ref, v_ref = ref.kv[u][i]
            for pos, slot in zip(rnd["positions"], rnd["slots"]):
                k, v = read_kv(llm, kv_layer_name(u, i, n_layers), slot)
                torch.testing.assert_close(k, k_ref[0, :, pos], atol=ATOL, rtol=0)
                torch.testing.assert_close(v, v_ref[0, :, pos], atol=ATOL, rtol=0)


def test_mixed_step_kv_equals_serial_oracle(loopspec_llms, oracle, tokenizer):
    llm = loopspec_llms(K)
    skip_unless_kv_readable(llm)
    runner = model_runner(llm)
    n_layers, loops = runner.model.config.num_hidden_layers, runner.model.num_loops
    trace: list[dict] = []
    mixed_steps = {"checked": 0}
    layouts = []

    def before(plan):
        layouts.append(plan.layout)

    def check_step():
        if not trace or not layouts:
            return
        rounds, layout = trace.pop(), layouts.pop()
        query_lens = (layout.query_start[1:] - layout.query_start[:-1]).tolist()
        has_prefill_chunk = any(k == 0 and q > 1 for k, q in zip(layout.num_drafts.tolist(), query_lens))
        ks = {len(r["tokens"]) - 1 for r in rounds.values()}
        if not (has_prefill_chunk and len(ks) > 1):
            return
        mixed_steps["checked"] += 1
        for rnd in rounds.values():
            _assert_kv_equals_oracle(llm, oracle, rnd, loops, n_layers)

    runner.drafter.trace = trace
    try:
        with _around_execute(llm, before, lambda plan, state: None):
            _mixed_workload(llm, tokenizer, check_step)
    finally:
        runner.drafter.trace = None
    assert mixed_steps["checked"] >= 1, "no step mixed a prefill chunk with rows of different K_i"


def test_a_rounds_draft_depth_may_change_every_step(loopspec_llms, native_llm, oracle, tokenizer):
    """Rounds at draft depths 1, 3, 2, 1, ... in turn (the engine's d is 2):
    at every loop and layer the KV of every position each round touched
    equals the serial oracle's, every scheduled token passes every loop
    once, masked draft rows fall in each round's own shallow loops, and the
    greedy output equals native's. A draft depth is the step's choice alone."""
    llm = loopspec_llms(K)
    skip_unless_kv_readable(llm)
    runner = model_runner(llm)
    drafter = runner.drafter
    n_layers, loops = runner.model.config.num_hidden_layers, runner.model.num_loops
    depths = [1, 3, 2]
    ran, trace = [], []

    def before(plan):
        drafter.round_draft_loops = depths[len(ran) % len(depths)]
        ran.append(drafter.round_draft_loops)

    def check_round():
        for rnd in (trace.pop() if trace else {}).values():
            _assert_kv_equals_oracle(llm, oracle, rnd, loops, n_layers)

    stats = drafter.stats
    rows0, masked0 = list(stats.rows_per_loop), list(stats.masked_rows_per_loop)
    prompts = [SHORT[1], SHORT[3], MEDIUM[1]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (19, 12, 27)]
    drafter.trace = trace
    try:
        with _around_execute(llm, before, lambda plan, state: None):
            _mixed_workload(llm, tokenizer, check_round)
            got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        drafter.trace = None
        drafter.round_draft_loops = drafter.draft_loops
    want = [list(o.outputs[0].token_ids) for o in native_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert set(ran) == set(depths), ran
    rows = [a - b for a, b in zip(stats.rows_per_loop, rows0 + [0] * loops)]
    masked = [a - b for a, b in zip(stats.masked_rows_per_loop, masked0 + [0] * loops)]
    assert len(set(rows)) == 1 and rows[0] > 0, rows
    # Loops 0..2 draft in some round (d = 3 among them), the last loop never.
    assert all(m > 0 for m in masked[:3]) and masked[3] == 0, masked


@contextlib.contextmanager
def _row_buckets(llm, buckets):
    """Pad draft ticks to these row counts (as CUDA graph capture will)."""
    drafter = model_runner(llm).drafter
    drafter.row_buckets = buckets
    try:
        yield
    finally:
        drafter.row_buckets = None


@pytest.mark.parametrize("buckets", [None, [4, 8]], ids=["unpadded", "padded"])
def test_masked_rows_write_no_kv(loopspec_llms, tokenizer, buckets):
    """Snapshot every cache layer before and after each round: the slots
    whose KV changed are exactly the slots of the tokens the round forwards
    (every non-draft token and every real draft); masked draft-tick rows
    and padding rows (pad slot) change nothing."""
    llm = loopspec_llms(K)
    skip_unless_kv_readable(llm)
    runner = model_runner(llm)
    n_layers, loops = runner.model.config.num_hidden_layers, runner.model.num_loops
    names = [kv_layer_name(u, i, n_layers) for u in range(loops) for i in range(n_layers)]
    seen = {"masked_rounds": 0}

    def before(plan):
        return {name: kv_by_slot(llm, name) for name in names}

    def after(plan, snapshot):
        common = runner._loopspec_common
        n = plan.layout.num_tokens
        forwarded = set(common.slot_mapping[:n].tolist())
        if not plan.drafts_valid.all():
            seen["masked_rounds"] += 1
        for name in names:
            k0, v0 = snapshot[name]
            k1, v1 = kv_by_slot(llm, name)
            changed = ((k0 != k1).flatten(1).any(1) | (v0 != v1).flatten(1).any(1)).nonzero().flatten().tolist()
            assert set(changed) <= forwarded, f"{name}: slots outside the step changed: {set(changed) - forwarded}"

    stats = runner.drafter.stats
    rows0, masked0 = list(stats.rows_per_loop), list(stats.masked_rows_per_loop)
    with _around_execute(llm, before, after), _row_buckets(llm, buckets):
        _mixed_workload(llm, tokenizer, lambda: None)
    assert seen["masked_rounds"] >= 1, "no round had masked rows"
    # Every scheduled token passes every loop once; masked rows are counted apart.
    rows = [a - b for a, b in zip(stats.rows_per_loop, rows0 + [0] * loops)]
    masked = [a - b for a, b in zip(stats.masked_rows_per_loop, masked0 + [0] * loops)]
    d = runner.drafter.draft_loops
    assert len(set(rows)) == 1 and rows[0] > 0, rows
    assert all(m > 0 for m in masked[:d]) and not any(masked[d:]), masked


def test_padded_draft_ticks_equal_native(loopspec_llms, native_llm):
    """Greedy output with draft ticks padded to buckets equals native; the
    padding rows belong to no request."""
    llm = loopspec_llms(K)
    prompts = [SHORT[1], SHORT[3], SHORT[4], MEDIUM[1], SHORT[6]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (19, 5, 12, 27, 3)]
    sizes = []
    with _row_buckets(llm, [4, 8, 16]), \
            _around_execute(llm, lambda plan: sizes.append(plan.num_spec_rows), lambda plan, state: None):
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [list(o.outputs[0].token_ids) for o in native_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert sizes and set(sizes) <= {4, 8, 16}


def test_the_row_count_warm_up_writes_no_kv(loopspec_llms, native_llm):
    """The startup warm-up (:meth:`~vllm_loopspec.speculative.drafter.LoopSpecDrafter.warm_up_row_counts`:
    one loop of the stack and ``lm_head`` over every row count, without
    attention metadata) run again on a serving engine changes no slot of
    any cache layer, and greedy output after it still equals native."""
    llm = loopspec_llms(K)
    skip_unless_kv_readable(llm)
    runner = model_runner(llm)
    n_layers, loops = runner.model.config.num_hidden_layers, runner.model.num_loops
    names = [kv_layer_name(u, i, n_layers) for u in range(loops) for i in range(n_layers)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm.generate([SHORT[2]], params, use_tqdm=False)  # some KV worth keeping
    before = {name: kv_by_slot(llm, name) for name in names}
    assert runner.drafter.warm_up_row_counts(24) > 0
    for name in names:
        for was, now in zip(before[name], kv_by_slot(llm, name)):
            assert torch.equal(was, now), f"{name}: the warm-up wrote KV"
    got = llm.generate([SHORT[5]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == list(native_llm.generate([SHORT[5]], params, use_tqdm=False)[0].outputs[0].token_ids)


@contextlib.contextmanager
def _host_reads_forbidden():
    """Make every way of reading a tensor back to the host raise."""
    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host read inside a round: Tensor.{name}")
        return raise_

    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    for name in names:
        setattr(torch.Tensor, name, forbidden(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def test_greedy_round_reads_nothing_back_to_the_host(loopspec_llms, native_llm, tokenizer, monkeypatch):
    llm = loopspec_llms(K)
    rounds = {"n": 0}
    original = drafter_module.run_round

    def guarded(*args, **kwargs):
        with _host_reads_forbidden():
            out = original(*args, **kwargs)
        rounds["n"] += 1
        return out

    monkeypatch.setattr(drafter_module, "run_round", guarded)
    prompts = [SHORT[0], SHORT[2], MEDIUM[0]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (17, 6, 23)]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [list(o.outputs[0].token_ids) for o in native_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert rounds["n"] > 3


def test_host_read_guard_catches_reads():
    """The guard above can fail: a round that read a tensor would raise."""
    with _host_reads_forbidden():
        with pytest.raises(AssertionError, match="host read"):
            torch.ones(2).sum().item()
        with pytest.raises(AssertionError, match="host read"):
            bool(torch.ones(1) > 0)
