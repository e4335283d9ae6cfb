"""loopspec's own counters (beside vLLM's spec_decode metrics)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LoopSpecStats:
    rounds: int = 0
    """Engine steps that ran a speculative round."""
    speculating_rows: int = 0
    """Request-rounds that drafted at least one token."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    """Rounds that drafted position j (j = 0..K-1)."""
    accepted_per_pos: list[int] = field(default_factory=list)
    """Rounds whose draft at position j was accepted."""
    rows_per_loop: list[int] = field(default_factory=list)
    """Rows each loop processed in speculative steps (index = loop)."""
    skipped: Counter = field(default_factory=Counter)
    """Request-steps that decoded one token without drafting, by reason."""

    def count_loop_rows(self, loops: range, rows: int) -> None:
        if len(self.rows_per_loop) < loops.stop:
            self.rows_per_loop.extend([0] * (loops.stop - len(self.rows_per_loop)))
        for loop in loops:
            self.rows_per_loop[loop] += rows

    def count_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        for per_pos, n in ((self.drafted_per_pos, num_drafts), (self.accepted_per_pos, num_accepted)):
            if len(per_pos) < num_drafts:
                per_pos.extend([0] * (num_drafts - len(per_pos)))
            for j in range(n):
                per_pos[j] += 1
        self.accepted_tokens += num_accepted

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "speculating_rows": self.speculating_rows,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "drafted_per_pos": list(self.drafted_per_pos),
            "accepted_per_pos": list(self.accepted_per_pos),
            "rows_per_loop": list(self.rows_per_loop),
            "skipped": dict(self.skipped),
        }
