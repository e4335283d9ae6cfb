"""Reach inside an in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0).

The attribute path itself lives in ``vllm_loopspec.engine_internals``."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from vllm_loopspec.engine_internals import engine_core, model_runner, scheduler

__all__ = ["engine_core", "model_runner", "scheduler", "served_model", "kv_unreadable_reason",
           "skip_unless_kv_readable", "read_kv", "kv_by_slot", "free_blocks", "spec_metrics", "observe_loops",
           "drafter_hooks", "until"]

# KV cache layouts this reader knows, by the ISA vLLM's CPU attention backend
# chose for the layer (``cpu_attn._get_attn_isa``). Checked against the
# oracle on x86 ("vec": fp32, head_dim a multiple of 32).
KNOWN_KV_LAYOUTS = ("vec",)


def served_model(llm):
    return model_runner(llm).model


def _kv_layout(llm, layer_name: str) -> str:
    attn = model_runner(llm).compilation_config.static_forward_context[layer_name]
    return getattr(attn, "isa", None) or type(attn.impl).__name__


def kv_unreadable_reason(llm) -> str | None:
    """Why :func:`read_kv` cannot decode this engine's KV layout, or None."""
    layer = next(iter(model_runner(llm).compilation_config.static_forward_context))
    layout = _kv_layout(llm, layer)
    if layout in KNOWN_KV_LAYOUTS:
        return None
    return f"reading KV slots needs vLLM's CPU 'vec' cache layout (x86); this engine's attention uses {layout!r}"


def skip_unless_kv_readable(llm) -> None:
    """Skip the calling test, with the reason, where :func:`read_kv` cannot
    decode the engine's KV layout. Call it before any request is in flight."""
    reason = kv_unreadable_reason(llm)
    if reason:
        pytest.skip(reason)


def _vec_cache(llm, layer_name: str):
    """(keys [blocks, heads, head_dim, block_size], values [blocks, heads,
    block_size, head_dim]) views of one cache layer in vLLM 0.32's x86 CPU
    "vec" layout: a block per head holds its keys transposed, then its
    values. Tests check this reading against the oracle."""
    layout = _kv_layout(llm, layer_name)
    assert layout in KNOWN_KV_LAYOUTS, f"cannot decode KV layout {layout!r}; call skip_unless_kv_readable first"
    attn = model_runner(llm).compilation_config.static_forward_context[layer_name]
    cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
    blocks, heads, block_size, two_hd = cache.shape
    hd = two_hd // 2
    flat = cache.view(blocks, heads, 2 * block_size * hd)
    return (flat[:, :, : block_size * hd].view(blocks, heads, hd, block_size),
            flat[:, :, block_size * hd:].view(blocks, heads, block_size, hd))


def read_kv(llm, layer_name: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value) of one token slot of one cache layer, each [kv_heads,
    head_dim]. Other layouts than x86 "vec" (ARM "neon", "amx", GPU
    backends) are not decoded here (see :func:`skip_unless_kv_readable`)."""
    keys, values = _vec_cache(llm, layer_name)
    block, offset = divmod(slot, keys.shape[-1])
    return keys[block, :, :, offset].clone(), values[block, :, offset].clone()


def kv_by_slot(llm, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of one cache layer's (keys, values), each [num_slots, kv_heads,
    head_dim], indexed by slot."""
    keys, values = _vec_cache(llm, layer_name)
    blocks, heads, hd, block_size = keys.shape
    return (keys.permute(0, 3, 1, 2).reshape(blocks * block_size, heads, hd).clone(),
            values.permute(0, 2, 1, 3).reshape(blocks * block_size, heads, hd).clone())


def free_blocks(llm) -> int:
    return scheduler(llm).kv_cache_manager.block_pool.get_num_free_blocks()


def spec_metrics(llm) -> dict:
    """vLLM's spec_decode counters. vLLM reads them from the process-wide
    Prometheus registry, which holds the *newest* in-process engine's
    collectors: call it only on the engine created last (per-engine figures
    are in ``model_runner(llm).drafter.stats``)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) if hasattr(m, "values") else m.value
    return out


def observe_loops(llm, observer):
    """Call ``observer(loop, exit_states)`` after every tick of the served
    model, per loop group, until the returned function is called (wraps this
    model instance's ``run_tick``; the model itself has no hooks)."""
    model = served_model(llm).model
    original = model.run_tick

    def run_tick(hidden_states, positions, groups):
        out = original(hidden_states, positions, groups)
        for g in groups:
            observer(g.loop, out[g.start:g.end])
        return out

    model.run_tick = run_tick
    return lambda: model.__dict__.pop("run_tick", None)


def until(check, timeout: float = 60.0, every: float = 0.25):
    """Call ``check()`` until it stops raising AssertionError (servers'
    counters lag their responses: worker snapshots reach /metrics through a
    flush thread, KV is freed after the response); re-raise its last failure
    after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(every)


@contextlib.contextmanager
def drafter_hooks(llm, draft_override=None, trace=None):
    """Set the debug drafter's hooks (vllm_loopspec/speculative/debug.py) for
    the duration of a block."""
    drafter = model_runner(llm).drafter
    drafter.draft_override, drafter.trace = draft_override, trace
    try:
        yield drafter
    finally:
        drafter.draft_override = drafter.trace = None
