"""One loopspec round for a whole engine step, independent of vLLM's runner.

The step's flat batch holds, per request row, its scheduled tokens; a
speculating row's last ``K_i`` tokens are draft slots (vLLM scheduled them
from our placeholder proposal) and the token before them is ``A``, the last
committed token, not yet forwarded. The round:

1. runs the shallow loops ``[0, d)`` over every non-draft token (prefill
   chunks, plain decodes, and each ``A``) in one pass;
2. for ``j = 1..K``: drafts ``c_j`` from ``lm_head`` of the row's latest
   shallow state, then runs loops ``[0, d)`` on ``c_j`` alone (for ``j = K_i``
   that is the final shallow fill; its state is only kept for verification);
3. runs the deep loops ``[d, R)`` once over all tokens, starting from the kept
   shallow states: for a speculating row that is the causal ``K_i+1``-row
   verification.

No shallow loop runs twice for a position, and every loop sees exactly
``K_i + 1`` rows of a speculating request. The passes are supplied by the
caller (:class:`RoundPasses`), which owns attention metadata and KV slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class RoundPasses(Protocol):
    def shallow(self, token_index: np.ndarray, token_ids: torch.Tensor, phase: str) -> torch.Tensor:
        """Loops ``[0, d)`` on the batch tokens at ``token_index`` (sorted,
        grouped by row) fed with ``token_ids``; returns their loop-``d`` states.
        ``phase`` ("base", "draft" or "final_fill") is for profiling only."""

    def deep(self, shallow_states: torch.Tensor) -> torch.Tensor:
        """Loops ``[d, R)`` over every token of the batch."""

    def draft(self, rows: np.ndarray, step: int, shallow_states: torch.Tensor) -> torch.Tensor:
        """Choose the ``step``-th draft token (1-based) of each row from its
        latest shallow state (greedy, or sampled from the processed ``q``)."""


@dataclass
class RoundLayout:
    """Where each row's tokens sit in the flat batch."""

    query_start: np.ndarray  # [B+1] flat offsets of each row's tokens
    num_drafts: np.ndarray  # [B] K_i (0 for rows that do not speculate)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start[-1])

    def non_draft_index(self) -> np.ndarray:
        ends = self.query_start[1:] - self.num_drafts
        return np.concatenate(
            [np.arange(s, e) for s, e in zip(self.query_start[:-1], ends)] or [np.zeros(0, np.int64)]
        ).astype(np.int64)

    def __post_init__(self) -> None:
        # Flat index of ``A`` (the token before the drafts) for every row.
        self.anchors = (self.query_start[1:] - self.num_drafts - 1).astype(np.int64)

    def anchor_index(self) -> np.ndarray:
        return self.anchors


@dataclass
class RoundResult:
    hidden_states: torch.Tensor  # [num_tokens, H] loop-R exit states
    draft_token_ids: torch.Tensor  # [num_tokens] input ids with drafts filled in


def run_round(layout: RoundLayout, input_ids: torch.Tensor, passes: RoundPasses) -> RoundResult:
    ids = input_ids.clone()
    base = layout.non_draft_index()
    base_states = passes.shallow(base, ids[base], "base")
    states = base_states.new_empty((layout.num_tokens, base_states.shape[-1]))
    states[torch.from_numpy(base)] = base_states

    latest = layout.anchor_index().copy()  # per row: index of its newest shallow state
    for step in range(1, int(layout.num_drafts.max(initial=0)) + 1):
        rows = np.nonzero(layout.num_drafts >= step)[0]
        tokens = passes.draft(rows, step, states[torch.from_numpy(latest[rows])])
        where = latest[rows] + 1
        ids[torch.from_numpy(where)] = tokens.to(ids.dtype)
        phase = "final_fill" if bool((layout.num_drafts[rows] == step).all()) else "draft"
        states[torch.from_numpy(where)] = passes.shallow(where, tokens.to(ids.dtype), phase)
        latest[rows] = where

    return RoundResult(
        hidden_states=passes.deep(states),
        draft_token_ids=ids,
    )
