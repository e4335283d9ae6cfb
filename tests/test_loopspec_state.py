"""loopspec's reused state equals a serial full-depth oracle, rejections
commit the right tokens and KV frontier, and stale slots get overwritten."""

import pytest
import torch
from vllm import SamplingParams

from engine_access import observe_loops, engine_core, model_runner, read_kv, skip_unless_kv_readable
from prompts import SHORT

K = 4
D = 2
ATOL = 1e-4  # fp32; states and KV are O(1)


def _layer_name(loop, layer, num_layers):
    return f"model.layers.{loop * num_layers + layer}.self_attn.attn"


def _run_steps(llm, prompt_ids, params, on_step):
    """Drive the engine one step at a time with a single request."""
    engine = llm.llm_engine
    engine.add_request("r0", {"prompt_token_ids": prompt_ids}, params)
    final = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        on_step()
        for o in outs:
            if o.finished:
                final = list(o.outputs[0].token_ids)
    return final


def test_reused_states_kv_and_logits_equal_serial_oracle(loopspec_llms, oracle, tokenizer):
    llm = loopspec_llms(K)
    skip_unless_kv_readable(llm)
    runner = model_runner(llm)
    model = runner.model
    n_layers, loops = model.config.num_hidden_layers, model.num_loops
    calls: list[tuple[int, torch.Tensor]] = []
    trace: list[dict] = []
    checked = {"rounds": 0, "rejected_positions": 0}

    def check_step():
        step_calls = list(calls)
        calls.clear()
        if not trace or not trace[-1]:
            trace.clear()
            return
        (rnd,) = trace.pop().values()  # the single request (internal id)
        seq = torch.tensor(rnd["prefix"] + rnd["tokens"])
        pos = torch.tensor(rnd["positions"])
        assert pos.tolist() == list(range(len(rnd["prefix"]), len(seq)))
        ref = oracle.trace(seq)
        for u in range(loops):
            got = torch.cat([h for loop, h in step_calls if loop == u])
            torch.testing.assert_close(got, ref.hidden[u][0, pos], atol=ATOL, rtol=0, msg=f"loop {u} states")
            for i in range(n_layers):
                k_ref, v_ref = ref.kv[u][i]
                for j, slot in enumerate(rnd["slots"]):
                    k, v = read_kv(llm, _layer_name(u, i, n_layers), slot)
                    torch.testing.assert_close(k, k_ref[0, :, pos[j]], atol=ATOL, rtol=0)
                    torch.testing.assert_close(v, v_ref[0, :, pos[j]], atol=ATOL, rtol=0)
        deep = [h for loop, h in step_calls if loop == loops - 1][0]
        shallow = torch.cat([h for loop, h in step_calls if loop == D - 1])
        with torch.no_grad():
            torch.testing.assert_close(model.compute_logits(deep).float(),
                                       oracle.lm_head(ref.hidden[-1][0, pos]).float(), atol=1e-3, rtol=1e-4)
            torch.testing.assert_close(model.compute_logits(shallow).float(),
                                       oracle.lm_head(ref.hidden[D - 1][0, pos]).float(), atol=1e-3, rtol=1e-4)
        # Positions whose draft the target rejects are checked too.
        target = oracle.lm_head(ref.hidden[-1][0, pos]).argmax(-1)
        drafts = torch.tensor(rnd["tokens"][1:])
        mismatch = (drafts != target[:-1]).nonzero()
        if len(mismatch):
            checked["rejected_positions"] += len(drafts) - int(mismatch[0])
        checked["rounds"] += 1

    observer = lambda loop, h: calls.append((loop, h.detach().clone()))  # noqa: E731
    stop_observing = observe_loops(llm, observer)
    runner.drafter.trace = trace
    try:
        ids = tokenizer(SHORT[5])["input_ids"]
        _run_steps(llm, ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), check_step)
    finally:
        stop_observing()
        runner.drafter.trace = None
    assert checked["rounds"] >= 4
    assert checked["rejected_positions"] > 0


def native_continuation(native_llm, tokenizer, max_tokens: int) -> tuple[list[int], list[int], SamplingParams]:
    """The forced-rejection tests' request (SHORT[3], greedy): its prompt
    ids, native's output for it and the sampling params."""
    prompt_ids = tokenizer(SHORT[3])["input_ids"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    native = list(native_llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
                  .outputs[0].token_ids)
    return prompt_ids, native, params


def forcing_rejection(full: list[int], vocab: int, reject_at: int):
    """A draft override: drafts 1..reject_at are the committed sequence's
    (``full``) tokens, draft reject_at+1 is wrong, later ones are left."""
    def override(req_id, step, token, anchor_pos):
        target = full[anchor_pos + step]
        if step - 1 < reject_at:
            return target
        if step - 1 == reject_at:
            return (target + 1) % vocab
        return token

    return override


@pytest.mark.parametrize("reject_at", list(range(K + 1)))
def test_forced_rejection_commits_right_tokens_and_kv_frontier(loopspec_llms, native_llm, oracle, tokenizer,
                                                               reject_at):
    """Drafts 1..reject_at are the target's tokens, draft reject_at+1 is wrong
    (reject_at == K: all accepted, bonus emitted). Every round must emit
    reject_at+1 tokens, leave KV valid exactly through the last accepted
    draft, and the final KV over the whole output must be the oracle's (stale
    slots of rejected drafts were overwritten)."""
    llm = loopspec_llms(K)
    runner = model_runner(llm)
    sched = engine_core(llm).scheduler
    vocab = runner.model.config.vocab_size
    prompt_ids, native, params = native_continuation(native_llm, tokenizer, 26)
    full = prompt_ids + native

    override = forcing_rejection(full, vocab, reject_at)
    trace: list[dict] = []
    frontiers = []
    slot_of = {}

    seen = [0]

    def on_step():
        req = next(iter(sched.requests.values()), None)
        new_round = len(trace) > seen[0] and trace[-1]
        seen[0] = len(trace)
        if new_round:
            (rnd,) = trace[-1].values()
            for p, s in zip(rnd["positions"], rnd["slots"]):
                slot_of[p] = s
            k_i = len(rnd["tokens"]) - 1
            accepted = min(reject_at, k_i)
            if req is not None:
                frontiers.append((req.num_computed_tokens, rnd["positions"][0] + 1 + accepted))

    runner.drafter.draft_override = override
    runner.drafter.trace = trace
    try:
        out = _run_steps(llm, prompt_ids, params, on_step)
    finally:
        runner.drafter.draft_override = None
        runner.drafter.trace = None
    assert out == native
    assert frontiers, "no speculative round ran"
    for got, want in frontiers:
        assert got == want
    skip_unless_kv_readable(llm)  # tokens and frontiers hold; the KV check needs the x86 layout
    # KV of every position a round touched equals the oracle's over the
    # committed sequence (rejected drafts' slots were rewritten later).
    check_kv_equals_oracle(llm, oracle, full, slot_of)


def check_kv_equals_oracle(llm, oracle, full: list[int], slot_of: dict[int, int]) -> None:
    """Every loop's and layer's KV at each position ``p`` of ``slot_of``
    (position -> slot) equals the oracle's over the committed sequence
    ``full`` (its final token is never forwarded, so is not checked)."""
    model = model_runner(llm).model
    n_layers = model.config.num_hidden_layers
    ref = oracle.trace(torch.tensor(full[: max(slot_of) + 1]))
    for p, slot in slot_of.items():
        if p >= len(full) - 1:
            continue
        for u in range(model.num_loops):
            for i in range(n_layers):
                k, v = read_kv(llm, _layer_name(u, i, n_layers), slot)
                k_ref, v_ref = ref.kv[u][i]
                torch.testing.assert_close(k, k_ref[0, :, p], atol=ATOL, rtol=0)
                torch.testing.assert_close(v, v_ref[0, :, p], atol=ATOL, rtol=0)
