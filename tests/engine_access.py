"""Reach inside an in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0).

The attribute path itself lives in ``vllm_loopspec.engine_internals``."""

from __future__ import annotations

import pytest
import torch

from vllm_loopspec.engine_internals import engine_core, model_runner, scheduler

__all__ = ["engine_core", "model_runner", "scheduler", "served_model", "read_kv", "free_blocks", "spec_metrics"]

# KV cache layouts this reader knows, by the ISA vLLM's CPU attention backend
# chose for the layer (``cpu_attn._get_attn_isa``). Checked against the
# oracle on x86 ("vec": fp32, head_dim a multiple of 32).
KNOWN_KV_LAYOUTS = ("vec",)


def served_model(llm):
    return model_runner(llm).model


def read_kv(llm, layer_name: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value) of one token slot of one cache layer, each [kv_heads, head_dim].

    vLLM 0.32's CPU backend, in its x86 "vec" layout, stores a block per head
    as keys transposed ([head_dim, block_size]) followed by values
    ([block_size, head_dim]); tests check this reading against the oracle at
    committed positions. Other layouts (ARM "neon", "amx", GPU backends)
    are not decoded here: the calling test is skipped with the reason."""
    attn = model_runner(llm).compilation_config.static_forward_context[layer_name]
    isa = getattr(attn, "isa", None)
    if isa not in KNOWN_KV_LAYOUTS:
        pytest.skip(f"reading KV slots needs vLLM's CPU 'vec' cache layout; this engine's attention "
                    f"uses {isa or type(attn.impl).__name__!r}")
    cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
    blocks, heads, block_size, two_hd = cache.shape
    hd = two_hd // 2
    flat = cache.view(blocks, heads, 2 * block_size * hd)
    block, offset = divmod(slot, block_size)
    keys = flat[block, :, : block_size * hd].view(heads, hd, block_size)[:, :, offset]
    values = flat[block, :, block_size * hd :].view(heads, block_size, hd)[:, offset]
    return keys.clone(), values.clone()


def free_blocks(llm) -> int:
    return scheduler(llm).kv_cache_manager.block_pool.get_num_free_blocks()


def spec_metrics(llm) -> dict:
    """vLLM's spec_decode counters. vLLM reads them from the process-wide
    Prometheus registry, which holds the *newest* in-process engine's
    collectors: call it only on the engine created last (per-engine figures
    are in ``model_runner(llm).loopspec_stats``)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) if hasattr(m, "values") else m.value
    return out
