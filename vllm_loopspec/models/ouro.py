"""Ouro looped decoder for vLLM 0.32 (registered out of tree by the plugin).

One stack of ``N`` layers is applied ``R`` times per token. Every loop has its
own attention KV, so each ``(loop u, layer i)`` pair owns one vLLM
``Attention`` registered as ``model.layers.{u*N+i}.self_attn.attn``: the KV
cache manager then allocates ``N*R`` layers in one group, and a query at loop
``u`` reads only loop-``u`` keys of earlier tokens (fixed-depth decoding).

After every loop the residual stream goes through ``model.norm``; that normed
state is the loop's exit (its logits are ``lm_head`` of it) and the next
loop's input.

The unit of work is a *tick*: one application of the shared layer stack to a
set of rows, each row tagged with the loop it is at (:class:`LoopGroup`,
contiguous rows at one loop). The projections and the MLP run once over all
rows of the tick; attention runs per group against that loop's own
``Attention`` layer and KV. :meth:`OuroModel.run_tick` is what loopspec's
round is made of (draft with loops ``[0, d)``, verify with ``[d, R)`` from
the kept states, or rows at several depths at once); :meth:`OuroModel.forward`
stays the plain ``R``-loop path of native serving.

Both are compiled in vLLM's compile mode, as two graphs. ``forward`` is one
graph of ``R`` loops whose attention layers are fixed at trace time.
:class:`OuroTick` is one graph of a single tick whose loop groups are *not*
part of the graph: its attention is the opaque op ``tick_attention``, which
reads the running tick's groups (set by :meth:`OuroModel.run_tick` before
the call) and dispatches each group to its loop's ``Attention``. vLLM runs a
compiled graph without re-checking guards, so anything baked into it must be
the same for every call; this way one compiled tick serves every loop, every
draft depth and every mix of loops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import direct_register_custom_op

@dataclass(frozen=True)
class LoopGroup:
    """Rows ``[start, end)`` of a tick, all at ``loop`` (0-based). The
    attention metadata of that loop's layers describes exactly these rows."""

    loop: int
    start: int
    end: int


def kv_layer_name(loop: int, layer: int, num_layers: int) -> str:
    """vLLM layer name of the attention of ``layer`` at ``loop`` (0-based)."""
    return f"model.layers.{loop * num_layers + layer}.self_attn.attn"


@dataclass(frozen=True)
class MergedAttention:
    """Every loop group of a tick in one attention call per layer: the
    tick's rows under one metadata whose blocks and slots address each row's
    own loop plane inside ``caches[layer]`` (one view over every plane of a
    physical layer, :mod:`vllm_loopspec.speculative.planes`)."""

    metadata: Any
    slot_mapping: torch.Tensor
    caches: tuple[torch.Tensor, ...]


class _RunningTick:
    """The loop groups of the tick being run (one engine process runs one
    forward at a time), and their merged attention when there is one."""

    groups: Sequence[LoopGroup] = ()
    merged: MergedAttention | None = None


_RUNNING_TICK = _RunningTick()


@contextmanager
def running_tick(groups: Sequence[LoopGroup], merged: MergedAttention | None = None):
    previous = _RUNNING_TICK.groups, _RUNNING_TICK.merged
    _RUNNING_TICK.groups, _RUNNING_TICK.merged = tuple(groups), merged
    try:
        yield
    finally:
        _RUNNING_TICK.groups, _RUNNING_TICK.merged = previous


def _merged_attention(q, k, v, layer: int, num_layers: int, merged: MergedAttention) -> torch.Tensor:
    """One call of the backend for every row of the tick: loop 0's layer
    supplies the implementation and the KV scales (the same for every loop
    of a layer); the cache is the layer's view over every loop plane.
    This is what vLLM's ``Attention.forward`` does for one layer (write the
    new KV, then attend), minus its per-call lookups."""
    from vllm.forward_context import get_forward_context

    attention = get_forward_context().no_compile_layers[kv_layer_name(0, layer, num_layers)]
    cache = merged.caches[layer]
    rows = q.shape[0]
    q = q.view(rows, attention.num_heads, attention.head_size)
    k = k.view(rows, attention.num_kv_heads, attention.head_size)
    v = v.view(rows, attention.num_kv_heads, attention.head_size_v)
    attention.impl.do_kv_cache_update(attention, k, v, cache, merged.slot_mapping)
    out = torch.empty((rows, attention.num_heads, attention.head_size_v), dtype=q.dtype, device=q.device)
    attention.impl.forward(attention, q, k, v, cache, merged.metadata, output=out)
    return out.view(rows, -1)


def _tick_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, num_layers: int) -> torch.Tensor:
    """Attention of ``layer`` for the running tick: each loop group's rows
    against that loop's ``Attention`` (its own KV and metadata), or all of
    them in one call where the tick has a merged attention."""
    from vllm.forward_context import get_forward_context

    if _RUNNING_TICK.merged is not None:
        return _merged_attention(q, k, v, layer, num_layers, _RUNNING_TICK.merged)
    attention = get_forward_context().no_compile_layers
    groups = _RUNNING_TICK.groups
    if len(groups) == 1:
        return attention[kv_layer_name(groups[0].loop, layer, num_layers)](q, k, v)
    return torch.cat([attention[kv_layer_name(g.loop, layer, num_layers)](q[g.start:g.end], k[g.start:g.end],
                                                                         v[g.start:g.end])
                      for g in groups])


def _tick_attention_fake(q, k, v, layer, num_layers):
    return torch.empty_like(q)


_LIBRARY = torch.library.Library("vllm_loopspec", "FRAGMENT")
direct_register_custom_op("tick_attention", _tick_attention, fake_impl=_tick_attention_fake,
                          target_lib=_LIBRARY)


class OuroMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate, hidden, bias=False, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


class OuroAttention(nn.Module):
    """Shared projections, one KV-owning ``Attention`` per loop."""

    def __init__(self, vllm_config: VllmConfig, layer_index: int, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        tp = get_tensor_model_parallel_world_size()
        self.layer_index = layer_index
        self.num_layers = config.num_hidden_layers
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=False,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        )
        self.attn = nn.ModuleList(
            Attention(
                self.num_heads,
                self.head_dim,
                self.head_dim**-0.5,
                num_kv_heads=self.num_kv_heads,
                cache_config=vllm_config.cache_config,
                prefix=kv_layer_name(loop, layer_index, config.num_hidden_layers),
            )
            for loop in range(config.total_ut_steps)
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, groups: Sequence[LoopGroup] | None) -> torch.Tensor:
        """``groups`` fixed by the caller (traced into a graph as they are),
        or ``None``: the running tick's, looked up when the op runs."""
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        if groups is None:
            attn = torch.ops.vllm_loopspec.tick_attention(q, k, v, self.layer_index, self.num_layers)
        elif len(groups) == 1:  # every row at one loop: no split
            attn = self.attn[groups[0].loop](q, k, v)
        else:
            attn = torch.cat([self.attn[g.loop](q[g.start:g.end], k[g.start:g.end], v[g.start:g.end])
                              for g in groups])
        out, _ = self.o_proj(attn)
        return out


class OuroDecoderLayer(nn.Module):
    """``h += norm2(attn(norm1(h)))`` then ``h += norm4(mlp(norm3(h)))``."""

    def __init__(self, vllm_config: VllmConfig, layer_index: int, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        eps = config.rms_norm_eps
        self.self_attn = OuroAttention(vllm_config, layer_index, f"{prefix}.self_attn")
        self.mlp = OuroMLP(config.hidden_size, config.intermediate_size, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps=eps)

    def forward(self, positions, hidden_states, groups, residual):
        # The residual stream is carried separately and summed by the fused
        # add-norms: after the call ``hidden_states + residual`` is ``h``.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.input_layernorm_2(self.self_attn(positions, hidden_states, groups))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm_2(self.mlp(hidden_states))
        return hidden_states, residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class OuroModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.num_loops = config.total_ut_steps
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            OuroDecoderLayer(vllm_config, i, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.early_exit_gate = ReplicatedLinear(
            config.hidden_size, 1, bias=True, prefix=f"{prefix}.early_exit_gate"
        )
        from vllm.compilation.backends import set_model_tag

        with set_model_tag("ouro_tick"):  # its own compile cache, apart from forward's
            self.tick = OuroTick(model=self, vllm_config=vllm_config, prefix=f"{prefix}.tick")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def apply_stack(
        self, hidden_states: torch.Tensor, positions: torch.Tensor, groups: Sequence[LoopGroup] | None
    ) -> torch.Tensor:
        """The layer stack and the after-loop norm over every row (``groups``
        as in :meth:`OuroAttention.forward`)."""
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, groups, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def run_tick(
        self, hidden_states: torch.Tensor, positions: torch.Tensor, groups: Sequence[LoopGroup],
        merged: MergedAttention | None = None,
    ) -> torch.Tensor:
        """One tick: every row advances one loop (row ``r`` of group ``g``
        from loop ``g.loop``'s input to its normed exit state). The groups
        tile the rows in order; the current forward context holds, for each
        group's loop, attention metadata over exactly that group's rows.
        Runs the compiled tick (:class:`OuroTick`) in vLLM's compile mode."""
        if merged is not None:  # the op reads the merged attention when it runs
            with running_tick(groups, merged):
                if self.tick.do_not_compile:
                    return self.apply_stack(hidden_states, positions, None)
                return self.tick(hidden_states, positions)
        if self.tick.do_not_compile or torch.compiler.is_compiling():
            # Eager, or traced into ``forward``'s graph: the groups are known here.
            return self.apply_stack(hidden_states, positions, groups)
        with running_tick(groups):
            return self.tick(hidden_states, positions)

    def run_loops(
        self, hidden_states: torch.Tensor, positions: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """Ticks for loops ``[start, end)`` over the same rows, all at one
        loop per tick; returns the exit state of loop ``end-1``."""
        rows = hidden_states.shape[0]
        for loop in range(start, end):
            hidden_states = self.run_tick(hidden_states, positions, (LoopGroup(loop, 0, rows),))
        return hidden_states

    def exit_lambda(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Per-row exit probability of the gate for a loop's exit state."""
        gate, _ = self.early_exit_gate(hidden_states)
        return torch.sigmoid(gate.float()).squeeze(-1)

    def forward(self, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        return self.run_loops(h, positions, 0, self.num_loops)


@dataclass
class PrecomputedLogits:
    """Logits of the rows vLLM's runner asks :meth:`OuroForCausalLM.compute_logits`
    for right after a step's forward, where the step already computed some of
    them (a pipelined step's verifications: the loop-``R`` logits of every
    slot with a successor). ``logits`` holds them in the runner's sample-row
    order; ``missing`` indexes the rows still to compute (bonus positions,
    rows without drafts)."""

    logits: torch.Tensor  # [sample rows, vocab]
    missing: torch.Tensor  # [rows to compute]


@support_torch_compile(dynamic_arg_dims={"hidden_states": 0, "positions": 0})
class OuroTick(nn.Module):
    """One tick of :class:`OuroModel` as its own compiled graph, its loop
    groups left to run time (``tick_attention``). It owns no weights: the
    model is held outside the module tree, so parameters keep their names
    and are not registered twice."""

    def __init__(self, *, model: OuroModel, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self._model = (model,)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._model[0].apply_stack(hidden_states, positions, None)


class OuroForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = OuroModel(vllm_config=vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # Set by the drafter at the end of a step's forward, read (once) by
        # the runner's compute_logits call that follows it.
        self.precomputed_logits: PrecomputedLogits | None = None

    @property
    def num_loops(self) -> int:
        return self.model.num_loops

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits of any loop's exit state (they share ``lm_head``). Right
        after a step whose forward left :attr:`precomputed_logits` (the
        runner's call over the step's sample rows), only the rows it lacks
        go through ``lm_head``."""
        precomputed, self.precomputed_logits = self.precomputed_logits, None
        if precomputed is None or precomputed.logits.shape[0] != hidden_states.shape[0]:
            return self.logits_processor(self.lm_head, hidden_states)
        if precomputed.missing.numel():
            rest = self.logits_processor(self.lm_head, hidden_states[precomputed.missing])
            if rest is None:  # a TP rank that receives no logits
                return None
            precomputed.logits[precomputed.missing] = rest
        return precomputed.logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked = [
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
        ]
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            for fused, part, shard in stacked:
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    params[target].weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(
                        f"Ouro checkpoint has an unexpected weight '{name}'; "
                        "is this an Ouro (model_type 'ouro') checkpoint?"
                    )
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded
