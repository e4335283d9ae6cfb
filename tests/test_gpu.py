"""GPU checks (``make gpu-check``); every test here skips without CUDA.

On a CUDA host: greedy loopspec equals native decoding in fp32 for K in
{1, 4}, with native CUDA graphs on and off, and so does the pipelined
schedule (K 8, d1 1, with and without second proposals); a loopspec engine asked for
CUDA graphs runs eagerly (its rounds are not yet proven under graphs); a greedy round makes no host synchronisation
(``torch.cuda.set_sync_debug_mode("error")`` while the round runs).
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from conftest import make_llm
from prompts import MEDIUM, SHORT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run make gpu-check on one)"),
]

PARAMS = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (24, 7, 31, 16)]
PROMPTS = [SHORT[0], SHORT[2], MEDIUM[0], SHORT[5]]


def _tokens(llm):
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def native_eager_tokens(tiny_checkpoint):
    return _tokens(make_llm(tiny_checkpoint))


def test_native_cuda_graphs_equal_eager(tiny_checkpoint, native_eager_tokens):
    assert _tokens(make_llm(tiny_checkpoint, enforce_eager=False)) == native_eager_tokens


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_loopspec_equals_native_on_gpu(tiny_checkpoint, native_eager_tokens, k):
    llm = make_llm(tiny_checkpoint, {"method": "loopspec", "num_speculative_tokens": k, "draft_loops": 2, "adaptive": False})
    assert _tokens(llm) == native_eager_tokens


@pytest.mark.parametrize("second", [None, 2])
def test_greedy_pipelined_equals_native_on_gpu(tiny_checkpoint, native_eager_tokens, second):
    spec = {"method": "loopspec", "num_speculative_tokens": 8, "draft_loops": 1, "schedule": "pipelined"}
    if second is not None:
        spec["second_proposal_loop"] = second
    assert _tokens(make_llm(tiny_checkpoint, spec)) == native_eager_tokens


def test_loopspec_runs_eagerly_when_graphs_are_asked_for(tiny_checkpoint, native_eager_tokens):
    llm = make_llm(tiny_checkpoint, {"method": "loopspec"}, enforce_eager=False)
    assert llm.llm_engine.vllm_config.model_config.enforce_eager
    assert _tokens(llm) == native_eager_tokens


def test_greedy_round_makes_no_host_sync(tiny_checkpoint, native_eager_tokens, monkeypatch):
    import vllm_loopspec.speculative.drafter as drafter_module

    original = drafter_module.run_round
    rounds = {"n": 0}

    def guarded(*args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            rounds["n"] += 1

    monkeypatch.setattr(drafter_module, "run_round", guarded)
    llm = make_llm(tiny_checkpoint, {"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2, "adaptive": False})
    assert _tokens(llm) == native_eager_tokens
    assert rounds["n"] > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_async_loopspec_equals_native_on_gpu(tiny_checkpoint, native_eager_tokens, adaptive):
    """Async scheduling on CUDA (CPU runs the same path in test_async_rounds.py)."""
    llm = make_llm(tiny_checkpoint, {"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2,
                                     "adaptive": adaptive}, async_scheduling=True)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    assert _tokens(llm) == native_eager_tokens
