"""Faster forwards over :class:`OuroReference`'s own parameters.

``fast_trace`` is the same computation as ``OuroReference.trace`` (loop ``t``
of every token attends to the loop-``t`` keys/values of earlier tokens; the
normed state after each loop is the exit state and the next loop's input) but
uses fused causal attention and rotary tables computed once per call, which is
what makes CPU training affordable. ``CachedGreedy`` decodes a batch of
equal-length prompts incrementally with one KV plane per (loop, layer): the
fixed-depth cache of the served model, so shallow-loop logits along a
generation are exactly what a loopspec drafter sees. Both are checked against
the oracle in ``tests/test_checkpoint_trained.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_loopspec.reference import OuroReference, apply_rope, rope_cos_sin


def _attn_qkv(attn, x, cos, sin):
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _layer(layer, h, cos, sin, past=None):
    """One Ouro layer; ``past`` = (k, v) of earlier tokens at this loop/layer."""
    attn = layer.self_attn
    q, k, v = _attn_qkv(attn, layer.input_layernorm(h), cos, sin)
    if past is not None:
        k = torch.cat([past[0], k], dim=2)
        v = torch.cat([past[1], v], dim=2)
    t_new, t_all = q.shape[2], k.shape[2]
    if t_new == t_all:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        # new queries sit at the end: query i sees keys 0..t_all-t_new+i
        mask = torch.ones(t_new, t_all, dtype=torch.bool, device=h.device).tril(t_all - t_new)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    b = h.shape[0]
    o = attn.o_proj(o.transpose(1, 2).reshape(b, t_new, attn.num_heads * attn.head_dim))
    h = h + layer.input_layernorm_2(o)
    h = h + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(h)))
    return h, (k, v)


def fast_trace(model: OuroReference, input_ids: torch.Tensor, num_loops: int | None = None) -> list[torch.Tensor]:
    """Normed exit state of every loop, list of [B, T, H] (like ``trace().hidden``)."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    cfg = model.config
    loops = num_loops or cfg.total_ut_steps
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    cos, sin = cos.to(input_ids.device), sin.to(input_ids.device)
    h = model.model.embed_tokens(input_ids)
    hidden = []
    for _ in range(loops):
        for layer in model.model.layers:
            h, _ = _layer(layer, h, cos, sin)
        h = model.model.norm(h)
        hidden.append(h)
    return hidden


class CachedGreedy:
    """Batched full-depth greedy decoding with per-(loop, layer) KV planes."""

    def __init__(self, model: OuroReference) -> None:
        self.model = model
        self.cfg = model.config

    def _step(self, ids: torch.Tensor, start: int, cache):
        cfg = self.cfg
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        h = self.model.model.embed_tokens(ids)
        hidden = []
        n = len(self.model.model.layers)
        for u in range(cfg.total_ut_steps):
            for i, layer in enumerate(self.model.model.layers):
                h, kv = _layer(layer, h, cos, sin, cache[u * n + i])
                cache[u * n + i] = kv
            h = self.model.model.norm(h)
            hidden.append(h)
        return hidden

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, max_new_tokens: int):
        """prompts: [B, P] (no padding). Returns (new ids [B, N], per-loop logits
        [R, B, N, V] of the positions that predicted each new token)."""
        n_slots = self.cfg.total_ut_steps * len(self.model.model.layers)
        cache = [None] * n_slots
        hidden = self._step(prompts, 0, cache)
        logits_per_step, out = [], []
        pos = prompts.shape[1]
        for _ in range(max_new_tokens):
            lg = torch.stack([self.model.lm_head(h[:, -1]).float() for h in hidden])  # [R, B, V]
            token = lg[-1].argmax(-1)
            logits_per_step.append(lg)
            out.append(token)
            hidden = self._step(token[:, None], pos, cache)
            pos += 1
        return torch.stack(out, 1), torch.stack(logits_per_step, 2)
