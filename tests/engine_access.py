"""Reach inside an in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""

from __future__ import annotations


def engine_core(llm):
    return llm.llm_engine.engine_core.engine_core


def model_runner(llm):
    return engine_core(llm).model_executor.driver_worker.worker.model_runner


def served_model(llm):
    return model_runner(llm).model
