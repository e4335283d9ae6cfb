"""Shared fixtures: one tiny checkpoint, one oracle and one in-process vLLM
engine for the whole session (an engine start costs seconds to a minute on
CPU, so tests share them)."""

from __future__ import annotations

import os

# Before vLLM is imported anywhere: run the engine core in this process so
# tests can reach the model and the KV cache, and keep the CPU KV pool small.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Spinning OpenMP waits make small ops crawl when the oracle and the engine
# share the two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# loopspec engines get the drafter with test hooks (draft override, trace,
# profile; vllm_loopspec/speculative/debug.py).
os.environ["VLLM_LOOPSPEC_DEBUG"] = "1"

import pytest

from vllm_loopspec import register

register()

# Engine shape shared by the tests: chunked prefill in 128-token pieces.
MAX_MODEL_LEN = 1024
MAX_BATCHED_TOKENS = 128


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from vllm_loopspec.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def oracle(tiny_checkpoint):
    from vllm_loopspec.reference import OuroReference

    return OuroReference.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


# Every in-process engine stays alive until the session ends: shutting one
# down tears down vLLM's process-global parallel state, which breaks every
# other engine still in use in this process.
_ENGINES: list = []


@pytest.fixture(scope="session", autouse=True)
def _keep_engines_until_session_end():
    yield
    _ENGINES.clear()


@pytest.fixture(scope="session")
def native_llm(tiny_checkpoint):
    """vLLM engine on the tiny checkpoint, fp32, no speculation."""
    return make_llm(tiny_checkpoint)


def make_llm(checkpoint, speculative_config=None, **overrides):
    """An in-process engine with the tests' shape. 64 KV blocks (8192 token
    slots) keep the many engines of a session small."""
    from vllm import LLM

    kwargs = dict(
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=16,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        num_gpu_blocks_override=64,
    )
    import torch

    if torch.cuda.is_available():
        # CUDA's KV blocks hold 16 tokens (CPU's 128): 64 would not hold one
        # max_model_len request.
        kwargs["num_gpu_blocks_override"] = 512
        # vLLM's memory profile asserts that free memory did not grow while it
        # ran; garbage of an earlier engine freed mid-profile can trip it.
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    kwargs.update(overrides)
    llm = LLM(str(checkpoint), speculative_config=speculative_config, **kwargs)
    _ENGINES.append(llm)
    return llm


@pytest.fixture(scope="session")
def loopspec_llms(tiny_checkpoint):
    """loopspec engines on the tiny checkpoint, built on first use and shared:
    ``loopspec_llms(K, d=2)`` drafts K tokens every round (``"adaptive":
    false``; a tuple of depths: ``"draft_loops"`` as a list); ``loopspec_llms(K, d, adaptive=True)`` runs the adaptive policy
    (K for its warm-up, at most 8); ``schedule="pipelined"`` the pipelined
    step (RFC §7), with ``second_proposal_loop`` its second proposals."""
    engines = {}

    def get(k: int, d: int = 2, adaptive: bool = False, schedule: str = "round",
            second_proposal_loop: int | None = None):
        key = (k, d, adaptive, schedule, second_proposal_loop)
        if key not in engines:
            spec = {"method": "loopspec", "num_speculative_tokens": k,
                    "draft_loops": list(d) if isinstance(d, tuple) else d, "adaptive": adaptive,
                    "schedule": schedule}
            if second_proposal_loop is not None:
                spec["second_proposal_loop"] = second_proposal_loop
            engines[key] = make_llm(tiny_checkpoint, spec)
        return engines[key]

    yield get
    engines.clear()


@pytest.fixture(scope="session")
def loopspec_server(tiny_checkpoint, tmp_path_factory):
    """``vllm serve`` of the tiny checkpoint with the bare-word
    ``--speculative-config loopspec``, shared by the server tests (its log
    is at ``.log``)."""
    from vllm_loopspec.server_process import VllmServer

    log = tmp_path_factory.mktemp("loopspec-server") / "serve.log"
    with VllmServer(tiny_checkpoint, "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                    "--gpu-memory-utilization", "0.5", "--speculative-config", "loopspec",
                    log_path=log) as srv:
        srv.log = log
        yield srv
