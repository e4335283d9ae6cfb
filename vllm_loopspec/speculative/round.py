"""One loopspec round for a whole engine step, as a sequence of ticks.

A *tick* is one application of the shared layer stack to a set of rows
(:meth:`OuroModel.run_tick`). Given the step's :class:`~.plan.RoundPlan`:

1. base ticks: loops ``[0, d)`` over every non-draft token (prefill chunks,
   plain decodes, and each speculating row's ``A``);
2. for ``j = 1..K_max``: every speculating row drafts ``c_j`` from
   ``lm_head`` of its newest shallow state (greedy argmax, or a sample of the
   processed shallow distribution ``q``), and a draft tick runs loops
   ``[0, d)`` on the ``c_j`` (for ``j = K_i`` that is the final shallow fill;
   rows with ``K_i < j`` are masked: they write no KV and land in a trash
   row);
3. deep ticks: loops ``[d, R)`` over every token from the kept shallow
   states; for a speculating row that is the causal ``K_i + 1``-row
   verification.

No shallow loop runs twice for a position, every loop sees exactly
``K_i + 1`` rows of a speculating request, and nothing here reads a tensor
back to the host: indices, positions and attention metadata were all planned
before the first tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_loopspec.speculative.plan import RoundPlan, TickAttention


class RoundModel(Protocol):
    """What the round needs of the served model and of the step's context."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def shallow(self, hidden: torch.Tensor, positions: torch.Tensor, tick: TickAttention) -> torch.Tensor:
        """Loops ``[0, d)`` on ``hidden`` under the tick's attention."""

    def deep(self, shallow_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Loops ``[d, R)`` over every token of the step."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DraftChooser(Protocol):
    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """Draft token of every speculating row for draft ``step`` (0-based)
        from the rows' shallow logits ``[B_s, vocab]``."""


@dataclass
class RoundOutput:
    hidden_states: torch.Tensor  # [num_tokens, H] loop-R exit states
    drafts: torch.Tensor  # [K_max, B_s] draft tokens (masked entries are garbage)


def run_round(plan: RoundPlan, model: RoundModel, choose: DraftChooser,
              input_ids: torch.Tensor, positions: torch.Tensor) -> RoundOutput:
    n = plan.layout.num_tokens
    base_states = model.shallow(model.embed(input_ids[plan.base_index]), positions[plan.base_index], plan.base)
    states = base_states.new_empty((n + 1, base_states.shape[-1]))  # + the trash row
    states.index_copy_(0, plan.base_index, base_states)

    drafts = input_ids.new_empty((len(plan.drafts), plan.num_spec_rows))
    newest = plan.anchor_index  # per speculating row: flat index of its newest shallow state
    for j, tick in enumerate(plan.drafts):
        drafts[j] = choose(model.logits(states[newest]), j)
        where = plan.draft_index[j]
        states.index_copy_(0, where, model.shallow(model.embed(drafts[j]), plan.draft_positions[j], tick))
        newest = where

    return RoundOutput(hidden_states=model.deep(states[:n], positions[:n]), drafts=drafts)
