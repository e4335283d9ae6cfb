"""Patch 5 (``patches.fix_top_k_only_on_empty_batch``): vLLM's top-k-only
mask must accept a step with no target rows, which every speculative step
without drafts produces on CPU."""

import pytest
import torch
from vllm import SamplingParams

from vllm_loopspec import patches


def test_vllm_top_k_only_still_crashes_on_an_empty_batch():
    """The upstream bug the patch works around; when this fails, vLLM fixed
    it and patch 5 can go."""
    from vllm.v1.sample.ops import topk_topp_sampler

    original = getattr(topk_topp_sampler.apply_top_k_only, "_loopspec_original",
                       topk_topp_sampler.apply_top_k_only)
    with pytest.raises(RuntimeError, match="numel"):
        original(torch.empty(0, 16), torch.empty(0, dtype=torch.int32))


def test_patched_top_k_only_passes_an_empty_batch_and_masks_others():
    from vllm.v1.sample.ops import topk_topp_sampler

    patches.fix_top_k_only_on_empty_batch()
    empty = torch.empty(0, 16)
    out = topk_topp_sampler.apply_top_k_top_p_pytorch(empty, torch.empty(0, dtype=torch.int32), None,
                                                       allow_cpu_sync=True)
    assert out.shape == (0, 16)
    logits = torch.arange(16, dtype=torch.float32).repeat(2, 1)
    masked = topk_topp_sampler.apply_top_k_top_p_pytorch(logits.clone(), torch.tensor([3, 16], dtype=torch.int32),
                                                         None, allow_cpu_sync=True)
    assert torch.isfinite(masked[0]).sum() == 3 and masked[0, -3:].tolist() == [13.0, 14.0, 15.0]
    assert torch.isfinite(masked[1]).all()


def test_top_k_without_top_p_is_served_by_loopspec(loopspec_llms, tokenizer):
    """The request that used to kill the engine (issue 10), then a greedy one."""
    llm = loopspec_llms(4)
    ids = tokenizer("def foo(x):")["input_ids"]
    for seed in (None, 7):
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=seed, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 30
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_seeded_request_in_a_chunked_prefill_is_served_and_replays(native_llm, loopspec_llms, tiny_checkpoint,
                                                                    tokenizer):
    """Patch 6 (``patches.keep_seeded_streams_on_discard``): a seeded sampled
    request whose prompt is prefilled in several steps (the test engines'
    budget is 128 tokens) used to kill a CPU engine when vLLM rewound its
    generator. It is served, and its output is the same as on an engine
    that prefills it in one step (the request's stream is untouched by the
    discarded draws)."""
    from conftest import make_llm
    from prompts import long_prompt

    ids = tokenizer(long_prompt(300, tokenizer))["input_ids"]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    spec = {"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2, "adaptive": False}
    pairs = [(native_llm, make_llm(tiny_checkpoint, max_num_batched_tokens=1024)),
             (loopspec_llms(4), make_llm(tiny_checkpoint, spec, max_num_batched_tokens=1024))]
    for chunked, one_step in pairs:
        got, want = (list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids)
                     for llm in (chunked, one_step))
        assert got == want


def test_a_loopspec_runner_skips_the_hybrid_models_accepted_count_sync(loopspec_llms):
    """Patch 16: vLLM's ``_prepare_inputs`` waits on ``num_accepted_tokens_event``
    and copies accepted counts every step of a speculative engine; only
    hybrid models write them. Ouro is not hybrid: the loopspec runner has no
    event, and its steps (greedy output is checked against native in
    test_loopspec_greedy.py with the patch in place) fill the counts with 1
    as a non-speculative runner does."""
    from vllm_loopspec.engine_internals import model_runner

    runner = model_runner(loopspec_llms(4))
    assert not runner.model_config.is_hybrid
    assert runner.num_spec_tokens > 0  # a speculative runner, for which vLLM creates the event
    assert runner.num_accepted_tokens_event is None
