"""The pipelined schedule of issue 12, serially, on the plain-PyTorch oracle.

This is the specification the engine's pipelined ticks are to be checked
against (RFC §7), and the source of the schedule's counted costs (ticks,
rows per tick, loop passes per committed token) on a real checkpoint. It
runs one request; the engine batches many, and a batch changes nothing in
a request's arithmetic.

The schedule. Every in-flight token of the request advances ``d1`` loops
per *tick*. A token reaching depth ``d1`` proposes its successor (the
argmax, or a sample, of the processed distribution ``q1`` at that depth),
which enters loop 0 in the next tick; with a second proposal at ``d2``, a
token reaching depth ``d2`` whose depth-``d2`` choice differs from its first
proposal starts a second candidate for the same position beside it. A token
reaching depth ``R`` is verified: its loop-``R`` distribution ``p`` decides
the next token by the cascade *first candidate, second candidate, residual
sample* (greedy: whichever candidate equals the argmax, else the argmax).
The winning candidate keeps its progress; every other candidate, with all
it started, is pruned; without a winner the decided token enters loop 0 at
the next tick. Each verification commits exactly one token.

KV. Committed tokens' keys and values live in one cache per loop and layer
(what the engine's per-loop KV planes hold). An in-flight token keeps its
own entries until it is committed, and attends to the committed cache, its
in-flight ancestors' entries and its own: two candidates for one position
never see each other (in the engine: their own KV slots).

Sampled verification is lossless: ``c1 ~ q1`` is accepted with
``min(1, p(c1)/q1(c1))``; otherwise the next token must follow the residual
``r1 = norm(max(p - q1, 0))``, and ``c2`` is a draft for ``r1`` drawn from
``q2' = norm(max(q2 - q1, 0))`` with ``c1`` removed (``r1(c1) = 0`` whenever
``c1`` can be rejected, so ``c1`` is never worth proposing twice): accepted
with ``min(1, r1(c2)/q2'(c2))``, else the token is drawn from
``norm(max(r1 - q2', 0))``. Each step is the standard speculative sampling
step, so the committed token follows ``p`` exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_loopspec.reference import OuroReference, apply_rope, rope_cos_sin


# -- sampling -------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    """How logits become a distribution (vLLM's order: temperature, then
    top-k, then top-p). ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float() / (self.temperature or 1.0)
        if self.top_k:
            kth = torch.topk(logits, self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) >= self.top_p  # keep the token that crosses p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return logits.softmax(-1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
    r = (p - q).clamp_min(0.0)
    total = float(r.sum())
    return r / total if total > 1e-12 else None


def second_proposal_distribution(q1: torch.Tensor, q2: torch.Tensor, first: int) -> torch.Tensor | None:
    """``q2'``: the depth-``d2`` distribution's excess over ``q1``, without the
    first candidate; None when it has no mass (no second proposal)."""
    q = (q2 - q1).clamp_min(0.0)
    q[first] = 0.0
    total = float(q.sum())
    return q / total if total > 1e-12 else None


def cascade(p: torch.Tensor, first: int, q1: torch.Tensor, second: int | None, q2: torch.Tensor | None,
            generator: torch.Generator | None = None) -> tuple[int, int]:
    """Sampled verification: returns (token, which) with ``which`` 1 (first
    candidate), 2 (second) or 0 (residual sample)."""
    def uniform() -> float:
        return float(torch.rand((), generator=generator))

    if uniform() * float(q1[first]) < float(p[first]):
        return first, 1
    r1 = _residual(p, q1)
    if r1 is None:  # p == q1: rejection has probability 0
        return first, 1
    if second is not None and q2 is not None:
        if uniform() * float(q2[second]) < float(r1[second]):
            return second, 2
        r2 = _residual(r1, q2)
        if r2 is not None:
            r1 = r2
    return int(torch.multinomial(r1, 1, generator=generator)), 0


# -- the oracle, one loop of one token at a time ----------------------------------

class LoopCache:
    """Committed keys and values per loop and layer: ``[R, N, kv_heads, T, hd]``."""

    def __init__(self, model: OuroReference, max_len: int) -> None:
        cfg = model.config
        shape = (cfg.total_ut_steps, cfg.num_hidden_layers, cfg.num_key_value_heads, max_len, cfg.head_dim)
        dtype = model.lm_head.weight.dtype
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.length = 0


@dataclass
class Node:
    """An in-flight token: its own KV entries per loop and layer and its
    state after ``depth`` loops."""

    token: int
    pos: int
    parent: "Node | None"
    hidden: torch.Tensor  # [H]: the embedding at depth 0, else the normed exit of loop depth-1
    depth: int = 0
    kv: dict = field(default_factory=dict)  # (loop, layer) -> (k [kv_heads, hd], v)
    q: torch.Tensor | None = None  # the distribution this candidate was drawn from
    first: "Node | None" = None  # candidates for the next position
    second: "Node | None" = None
    q1: torch.Tensor | None = None  # this token's depth-d1 distribution (its first proposal's)
    pruned: bool = False
    states: dict = field(default_factory=dict)  # loop -> exit state, every loop this node ran


def run_loop(model: OuroReference, cache: LoopCache, node: Node, loop: int) -> None:
    """Loop ``loop`` for ``node``: attention over the committed cache, the
    node's in-flight ancestors and itself, at that loop."""
    h = node.hidden[None, None]
    pos = torch.tensor([node.pos])
    ancestors = []
    a = node.parent
    while a is not None and not a.pruned and a.pos >= cache.length:
        ancestors.append(a)
        a = a.parent
    ancestors.reverse()
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(1, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, 1, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, 1, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(pos, attn.head_dim, attn.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        node.kv[(loop, i)] = (k[0, :, 0], v[0, :, 0])
        keys = [cache.k[loop, i, :, : cache.length]] + [n.kv[(loop, i)][0][:, None] for n in ancestors + [node]]
        values = [cache.v[loop, i, :, : cache.length]] + [n.kv[(loop, i)][1][:, None] for n in ancestors + [node]]
        kk = torch.cat(keys, dim=1).repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=0)
        vv = torch.cat(values, dim=1).repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=0)
        scores = (q[0] @ kk.transpose(-1, -2)) / math.sqrt(attn.head_dim)  # [heads, 1, T]
        out = scores.float().softmax(-1).to(vv.dtype) @ vv
        out = attn.o_proj(out.transpose(0, 1).reshape(1, 1, attn.num_heads * attn.head_dim))
        h = h + layer.input_layernorm_2(out)
        h = h + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(h)))
    node.hidden = model.model.norm(h)[0, 0]
    node.depth = loop + 1
    node.states[loop] = node.hidden


def commit(cache: LoopCache, node: Node) -> None:
    """Move a verified node's entries into the committed cache."""
    assert node.pos == cache.length
    for (loop, i), (k, v) in node.kv.items():
        cache.k[loop, i, :, node.pos] = k
        cache.v[loop, i, :, node.pos] = v
    cache.length += 1


def prefill(model: OuroReference, prompt: list[int], max_len: int) -> tuple[LoopCache, torch.Tensor]:
    """The prompt at every loop into a fresh cache; returns it and the
    prompt's last loop-``R`` exit state."""
    cache = LoopCache(model, max_len)
    trace = model.trace(torch.tensor(prompt))
    for loop, loop_kv in enumerate(trace.kv):
        for i, (k, v) in enumerate(loop_kv):
            cache.k[loop, i, :, : len(prompt)] = k[0]
            cache.v[loop, i, :, : len(prompt)] = v[0]
    cache.length = len(prompt)
    return cache, trace.hidden[-1][0, -1]


@dataclass
class PipelineStats:
    ticks: int = 0
    rows: int = 0  # sum over ticks of in-flight tokens
    loop_passes: int = 0  # token-loops computed (rows x loops)
    pruned_loop_passes: int = 0  # of which for tokens later pruned
    committed: int = 0
    first_accepted: int = 0
    second_proposals: int = 0
    second_accepted: int = 0
    corrections: int = 0  # verifications that took neither candidate

    @property
    def ticks_per_token(self) -> float:
        return self.ticks / max(self.committed, 1)


@torch.no_grad()
def decode_plain(model: OuroReference, prompt: list[int], max_new_tokens: int,
                 sampling: Sampling = Sampling(), generator: torch.Generator | None = None) -> list[int]:
    """Token by token, every loop, with the same one-token arithmetic as the
    pipeline: the schedule's greedy output must equal this one exactly."""
    cache, last = prefill(model, prompt, len(prompt) + max_new_tokens + 1)
    out = [_choose(model, last, sampling, generator)]
    while len(out) < max_new_tokens:
        node = Node(out[-1], cache.length, None, model.model.embed_tokens.weight[out[-1]])
        for loop in range(model.config.total_ut_steps):
            run_loop(model, cache, node, loop)
        commit(cache, node)
        out.append(_choose(model, node.hidden, sampling, generator))
    return out


def _choose(model, hidden, sampling: Sampling, generator) -> int:
    logits = model.lm_head(hidden)
    if sampling.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(sampling.probs(logits), 1, generator=generator))


@torch.no_grad()
def decode_pipelined(model: OuroReference, prompt: list[int], max_new_tokens: int, d1: int,
                     d2: int | None = None, sampling: Sampling = Sampling(),
                     generator: torch.Generator | None = None, force_first=None,
                     on_tick=None, first_token: int | None = None) -> tuple[list[int], PipelineStats]:
    """Decode ``max_new_tokens`` with the pipelined schedule. ``d2``: depth
    of the second proposal (None: none). ``force_first(pos, token)`` may
    replace a first proposal (tests force rejections at chosen stages).
    ``on_tick(nodes)`` sees the in-flight nodes after each tick.
    ``first_token``: the first new token, when the caller fixes it (the
    prefill's choice otherwise)."""
    loops = model.config.total_ut_steps
    if not 1 <= d1 < loops or (d2 is not None and not d1 < d2 < loops):
        raise ValueError(f"need 1 <= d1 < d2 < R={loops}; got d1={d1}, d2={d2}")
    cache, last = prefill(model, prompt, len(prompt) + max_new_tokens + 2)
    stats = PipelineStats()
    out = [_choose(model, last, sampling, generator) if first_token is None else first_token]
    embed = model.model.embed_tokens.weight
    root = Node(out[0], cache.length, None, embed[out[0]])
    all_nodes = [root]
    while len(out) < max_new_tokens:
        live = [n for n in all_nodes if not n.pruned and n.depth < loops]
        stats.ticks += 1
        stats.rows += len(live)
        for node in live:  # oldest first: ancestors before descendants
            for loop in range(node.depth, min(node.depth + d1, loops)):
                run_loop(model, cache, node, loop)
                stats.loop_passes += 1
        if on_tick is not None:
            on_tick([n for n in all_nodes if not n.pruned])
        # Proposals, then the verification of the root.
        for node in [n for n in all_nodes if not n.pruned]:
            if node.depth >= d1 and node.first is None and len(out) + (node.pos - root.pos) < max_new_tokens:
                logits = model.lm_head(node.hidden)
                node.q1 = sampling.probs(logits) if not sampling.greedy else None
                token = (int(logits.argmax()) if sampling.greedy
                         else int(torch.multinomial(node.q1, 1, generator=generator)))
                if force_first is not None:
                    token = force_first(node.pos + 1, token)
                node.first = Node(token, node.pos + 1, node, embed[token], q=node.q1)
                all_nodes.append(node.first)
            if (d2 is not None and node.depth >= d2 and node.first is not None and node.second is None
                    and node.depth - d1 < d2):  # the tick that reached d2
                logits = model.lm_head(node.states[d2 - 1])
                if sampling.greedy:
                    token, q2 = int(logits.argmax()), None
                    if token == node.first.token:
                        continue
                else:
                    q2 = second_proposal_distribution(node.q1, sampling.probs(logits), node.first.token)
                    if q2 is None:
                        continue
                    token = int(torch.multinomial(q2, 1, generator=generator))
                node.second = Node(token, node.pos + 1, node, embed[token], q=q2)
                all_nodes.append(node.second)
                stats.second_proposals += 1
        if root.depth < loops:
            continue
        # Verify the root: one committed token.
        logits = model.lm_head(root.hidden)
        first, second = root.first, root.second
        if sampling.greedy:
            target = int(logits.argmax())
            winner = first if first is not None and first.token == target else (
                second if second is not None and second.token == target else None)
            which = 1 if winner is first and winner is not None else 2 if winner is not None else 0
        else:
            p = sampling.probs(logits)
            if first is None:
                target, which = int(torch.multinomial(p, 1, generator=generator)), 0
            else:
                target, which = cascade(p, first.token, first.q, None if second is None else second.token,
                                        None if second is None else second.q, generator)
            winner = first if which == 1 else second if which == 2 else None
        stats.first_accepted += which == 1
        stats.second_accepted += which == 2
        stats.corrections += which == 0
        for candidate in (first, second):
            if candidate is not None and candidate is not winner:
                _prune(candidate, stats)
        commit(cache, root)
        out.append(target)
        stats.committed += 1
        root.pruned = True  # done: no longer in flight
        if winner is None:
            winner = Node(target, root.pos + 1, None, embed[target])
            all_nodes.append(winner)
        winner.parent = None
        root = winner
        all_nodes = [n for n in all_nodes if not n.pruned]
    return out, stats


def _prune(node: Node, stats: PipelineStats) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        if n.pruned:
            continue
        n.pruned = True
        stats.pruned_loop_passes += n.depth
        stack += [c for c in (n.first, n.second) if c is not None]
