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
    rows_per_loop: list[int] = field(default_factory=list)
    """Rows each loop processed in speculative steps (index = loop)."""
    skipped: Counter = field(default_factory=Counter)
    """Request-steps that decoded one token without drafting, by reason."""

    def count_loop_rows(self, loops: range, rows: int) -> None:
        if len(self.rows_per_loop) < loops.stop:
            self.rows_per_loop.extend([0] * (loops.stop - len(self.rows_per_loop)))
        for loop in loops:
            self.rows_per_loop[loop] += rows

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "speculating_rows": self.speculating_rows,
            "drafted_tokens": self.drafted_tokens,
            "rows_per_loop": list(self.rows_per_loop),
            "skipped": dict(self.skipped),
        }
