"""vLLM's native decoding of Ouro equals the plain-PyTorch oracle, fp32."""

import pytest
import torch
from vllm import SamplingParams

from conftest import MAX_BATCHED_TOKENS
from engine_access import observe_loops, served_model
from prompts import MEDIUM, SHORT, long_prompt

NEW_TOKENS = 24


def greedy(n=NEW_TOKENS):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def oracle_tokens(oracle, prompt_ids, n=NEW_TOKENS):
    return oracle.greedy_generate(prompt_ids, n)


def test_batch_of_mixed_lengths_matches_oracle(native_llm, oracle, tokenizer):
    prompts = SHORT + MEDIUM
    assert len(prompts) >= 8
    outs = native_llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tokenizer(prompt)["input_ids"]
        assert list(out.outputs[0].token_ids) == oracle_tokens(oracle, ids), prompt


def test_chunked_prefill_prompt_matches_oracle(native_llm, oracle, tokenizer):
    prompt = long_prompt(3 * MAX_BATCHED_TOKENS + 17, tokenizer)
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > 3 * MAX_BATCHED_TOKENS  # prefilled in >= 4 chunks
    out = native_llm.generate([prompt], greedy(16), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == oracle_tokens(oracle, ids, 16)


def test_requests_arriving_mid_generation_match_oracle(native_llm, oracle, tokenizer):
    """Requests join a running batch (and a long one is chunk-prefilled
    alongside decodes); every request still equals the oracle."""
    engine = native_llm.llm_engine
    arrivals = {0: [SHORT[0], SHORT[1]], 3: [MEDIUM[0]], 7: [SHORT[2], long_prompt(200, tokenizer)]}
    expected, finished = {}, {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, prompt in enumerate(arrivals.get(step, [])):
            rid = f"mid-{step}-{i}"
            engine.add_request(rid, prompt, greedy(12))
            expected[rid] = oracle_tokens(oracle, tokenizer(prompt)["input_ids"], 12)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    assert finished == expected


def test_every_loop_logits_match_oracle(native_llm, oracle, tokenizer):
    """Exit logits of each loop 1..R over all prompt positions.

    Tolerance: fp32, max |diff| <= 2e-4 * (1 + |logit|) elementwise; the logits
    have standard deviation ~3, so this is ~1e-4 relative."""
    model = served_model(native_llm)
    captured: list[tuple[int, torch.Tensor]] = []
    observer = lambda loop, h: captured.append((loop, h.detach().clone()))  # noqa: E731
    prompt = MEDIUM[1]
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) < MAX_BATCHED_TOKENS  # one prefill forward
    stop_observing = observe_loops(native_llm, observer)
    try:
        native_llm.generate([prompt], greedy(1), use_tqdm=False)
    finally:
        stop_observing()
    prefill = [(loop, h) for loop, h in captured if h.shape[0] >= len(ids)]
    assert [loop for loop, _ in prefill] == list(range(model.num_loops))
    expected = oracle.loop_logits(torch.tensor(ids))
    for loop, h in prefill:
        with torch.no_grad():
            got = model.compute_logits(h[: len(ids)]).float()
        want = expected[loop][0]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=f"loop {loop + 1}")
    # The loops really differ: a reuse bug that returned the same state for
    # every loop would not pass this.
    assert not torch.allclose(expected[0][0], expected[-1][0], atol=1e-2)


@pytest.mark.slow
def test_compiled_native_engine_matches_oracle(tiny_checkpoint, oracle, tokenizer):
    """vLLM's default mode on CPU compiles the model's forward
    (``support_torch_compile`` on ``OuroModel``): same greedy tokens,
    including a chunk-prefilled prompt."""
    from conftest import make_llm

    llm = make_llm(tiny_checkpoint, enforce_eager=False)
    assert llm.llm_engine.vllm_config.compilation_config.mode != 0
    prompts = SHORT[:4] + [long_prompt(2 * MAX_BATCHED_TOKENS + 5, tokenizer)]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tokenizer(prompt)["input_ids"]
        assert list(out.outputs[0].token_ids) == oracle_tokens(oracle, ids), prompt
