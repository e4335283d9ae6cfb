"""The one place that spells out the path into an in-process vLLM 0.32 engine.

Tests and benchmarks reach the scheduler and the model runner of an
``LLM`` created with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in the
calling process, one worker). vLLM has no public API for this, so the chain
of private attributes lives here only, and a vLLM upgrade that moves it
breaks one function instead of every caller.
"""

from __future__ import annotations


def engine_core(llm):
    """The ``EngineCore`` of an in-process ``vllm.LLM``."""
    return llm.llm_engine.engine_core.engine_core


def scheduler(llm):
    return engine_core(llm).scheduler


def model_runner(llm):
    """The (single) worker's model runner: a ``LoopSpec*ModelRunner`` for
    loopspec engines, vLLM's own runner otherwise."""
    return engine_core(llm).model_executor.driver_worker.worker.model_runner
