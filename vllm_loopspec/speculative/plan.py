"""The tick plan of one loopspec step, built once before the round runs.

vLLM schedules, for each speculating request row, ``[A, c_1..c_K]`` (``A``
the last committed token, not yet forwarded; the ``c_j`` draft slots), and
for other rows their prefill chunk or single decode token. The round is a
fixed sequence of ticks over that flat batch:

* the *base* ticks: loops ``[0, d)`` over every non-draft token;
* ``K_max`` *draft* ticks: loops ``[0, d)`` over one token per speculating
  row, the row's ``j``-th draft. Every draft tick has the same rows (all
  speculating rows, optionally padded up to a bucket size with rows of no
  request); a row whose ``K_i < j``, and every padding row, is *masked*: its
  token goes to a trash row, its KV slot is ``-1`` (vLLM's pad slot, never
  written);
* the deep ticks: loops ``[d, R)`` over every token, in the runner's own
  attention metadata.

Everything the ticks need — flat indices, positions, slots and the
attention metadata of each tick — is computed here, on the host, once per
step. The round then runs without asking the host anything.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

PAD_SLOT = -1  # vLLM's slot id for rows that must not write KV


@dataclass
class StepLayout:
    """Where each request row's tokens sit in the step's flat batch (host)."""

    query_start: np.ndarray  # [B+1] flat offsets of each row's tokens
    num_drafts: np.ndarray  # [B] K_i (0: the row does not speculate this step)
    seq_lens: np.ndarray  # [B] tokens of the row through its last scheduled token

    @property
    def num_rows(self) -> int:
        return int(self.num_drafts.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start[-1])

    @property
    def max_drafts(self) -> int:
        return int(self.num_drafts.max(initial=0))

    @property
    def anchors(self) -> np.ndarray:
        """Flat index of ``A`` (the token before the drafts) of every row."""
        return (self.query_start[1:] - self.num_drafts - 1).astype(np.int64)

    @property
    def spec_rows(self) -> np.ndarray:
        return np.nonzero(self.num_drafts > 0)[0]

    def non_draft_index(self) -> np.ndarray:
        ends = self.query_start[1:] - self.num_drafts
        return np.concatenate(
            [np.arange(s, e) for s, e in zip(self.query_start[:-1], ends)] or [np.zeros(0, np.int64)]
        ).astype(np.int64)


@dataclass
class TickAttention:
    """Attention metadata and KV slots of one tick, for the shallow layers."""

    metadata: Any  # the backend's metadata object (one for every shallow layer)
    slot_mapping: torch.Tensor
    masked_rows: int = 0  # rows that write no KV (counted apart in the metrics)

    def activate(self, layer_names: list[str], forward_context) -> None:
        """Point the shallow layers of the current forward context at this
        tick (vLLM's EAGLE proposer likewise reuses one context and updates
        its metadata between draft steps)."""
        for name in layer_names:
            forward_context.attn_metadata[name] = self.metadata
            forward_context.slot_mapping[name] = self.slot_mapping


@dataclass
class RoundPlan:
    layout: StepLayout
    base_index: torch.Tensor  # [n_base] flat indices of the base ticks' tokens
    base: TickAttention
    anchor_index: torch.Tensor  # [B_s] flat index of A per speculating row
    draft_index: torch.Tensor  # [K_max, B_s] flat index of draft j (trash row where masked)
    draft_positions: torch.Tensor  # [K_max, B_s]
    drafts: list[TickAttention]  # per draft tick
    draft_gather: torch.Tensor  # [sum K_i] index into drafts.view(-1) in vLLM's flat draft order
    drafts_valid: np.ndarray  # [K_max, B_s] host mask: draft j of row s is real
    trash: int  # flat row that masked ticks write to (== num_tokens)

    @property
    def num_spec_rows(self) -> int:
        """Rows of every draft tick: the speculating rows, then padding."""
        return int(self.anchor_index.shape[0])


def padded_rows(num_rows: int, buckets: list[int] | None) -> int:
    """The smallest bucket that holds ``num_rows`` (no padding without buckets
    or above the largest)."""
    for size in sorted(buckets or []):
        if size >= num_rows:
            return size
    return num_rows


NUMPY_INTS = {torch.int32: np.int32, torch.int64: np.int64}  # a torch int dtype as numpy's


def host_tensor(values, dtype=np.int64) -> torch.Tensor:
    """A host tensor of a list of ints. (``torch.tensor`` on a Python list
    costs about three times numpy's conversion plus ``from_numpy``; a
    pipelined tick makes a dozen such tensors.)"""
    return torch.from_numpy(np.array(values, dtype=dtype))


def tick_attention(common, attn_group, device: torch.device, query_lens, seq_lens, rows,
                   slots: torch.Tensor, masked_rows: int = 0,
                   block_table: torch.Tensor | None = None) -> TickAttention:
    """Attention metadata of one tick (or one loop group of a tick): request
    rows ``rows`` of the step (their block tables, unless ``block_table``
    gives them), ``query_lens`` tokens each ending at ``seq_lens``, writing
    KV at ``slots``; built by the runner's own builder from the step's
    ``CommonAttentionMetadata``. ``query_lens``, ``seq_lens`` and ``rows``:
    lists or arrays of ints (a pipelined tick builds this every pass, from
    lists)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens, seq_lens = (v.tolist() if isinstance(v, np.ndarray) else v for v in (query_lens, seq_lens))
    qsl = [0, *itertools.accumulate(query_lens)]
    qsl_cpu = host_tensor(qsl, np.int32)
    seq_lens_cpu = host_tensor(seq_lens, NUMPY_INTS[common.seq_lens.dtype])
    sub = CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device, non_blocking=True),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens_cpu.to(device, non_blocking=True),
        num_reqs=len(rows),
        num_actual_tokens=qsl[-1],
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_table_tensor=(common.block_table_tensor[host_tensor(rows).to(device, non_blocking=True)]
                            if block_table is None else block_table),
        slot_mapping=slots,
        causal=True,
    )
    return TickAttention(attn_group.build_metadata(sub), slots, masked_rows)


def build_plan(layout: StepLayout, common, attn_group, device: torch.device,
               row_buckets: list[int] | None = None) -> RoundPlan:
    """Plan the step's ticks. ``common`` is the step's
    ``CommonAttentionMetadata`` (all scheduled tokens), ``attn_group`` the
    runner's attention group of the KV cache group (all loops share one).
    With ``row_buckets``, draft ticks are padded to a bucket size (fixed
    shapes for graph capture); padding rows belong to no request."""
    n = layout.num_tokens
    slot_mapping = common.slot_mapping

    def tick(query_lens: np.ndarray, seq_lens: np.ndarray, rows: np.ndarray, slots: torch.Tensor,
             masked_rows: int = 0) -> TickAttention:
        return tick_attention(common, attn_group, device, query_lens, seq_lens, rows, slots, masked_rows)

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

    # Base ticks: every row's non-draft tokens.
    base_index = layout.non_draft_index()
    base_query = np.diff(layout.query_start) - layout.num_drafts
    base_seq = layout.seq_lens - layout.num_drafts
    base_index_dev = on_device(base_index)
    base = tick(base_query, base_seq, np.arange(layout.num_rows), slot_mapping[base_index_dev])

    # Draft ticks: one token per speculating row; masked where K_i < j.
    # Padding rows: no drafts, anchored at the trash row, reading (never
    # writing) the first speculating row's blocks at position 0.
    spec = layout.spec_rows
    pad = padded_rows(len(spec), row_buckets) - len(spec)
    k_i = np.concatenate([layout.num_drafts[spec], np.zeros(pad, np.int64)])
    anchors = np.concatenate([layout.anchors[spec], np.full(pad, n, np.int64)])
    anchor_pos = np.concatenate([layout.seq_lens[spec] - layout.num_drafts[spec] - 1, np.zeros(pad, np.int64)])
    tick_rows = np.concatenate([spec, np.full(pad, spec[0], np.int64)])
    steps = np.arange(1, layout.max_drafts + 1)[:, None]  # [K_max, 1]
    valid = steps <= k_i[None, :]  # [K_max, B_s]
    draft_index = np.where(valid, anchors[None, :] + steps, n)
    draft_pos = anchor_pos[None, :] + np.minimum(steps, k_i[None, :])
    draft_index_dev = on_device(draft_index)
    valid_dev = on_device(valid)
    slots_padded = torch.cat([slot_mapping[:n], slot_mapping.new_full((1,), PAD_SLOT)])
    drafts = []
    for j in range(layout.max_drafts):
        slots = torch.where(valid_dev[j], slots_padded[draft_index_dev[j]], PAD_SLOT)
        drafts.append(tick(np.ones(len(tick_rows), np.int32), draft_pos[j] + 1, tick_rows, slots,
                           masked_rows=int((~valid[j]).sum())))
    # vLLM's flat draft order: row by row, j = 1..K_i.
    row_major = np.nonzero(valid.T.reshape(-1))[0]  # index into [B_s, K_max]
    gather = (row_major // layout.max_drafts) + (row_major % layout.max_drafts) * len(tick_rows)
    return RoundPlan(
        layout=layout,
        base_index=base_index_dev,
        base=base,
        anchor_index=on_device(anchors),
        draft_index=draft_index_dev,
        draft_positions=on_device(draft_pos),
        drafts=drafts,
        draft_gather=on_device(gather.astype(np.int64)),
        drafts_valid=valid,
        trash=n,
    )
