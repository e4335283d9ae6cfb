"""How far a step of ``"schedule": "auto"`` spreads its batch apart.

The chooser (:mod:`.schedule_choice`) compares arms by committed tokens per
request per second. A round advances each row by the row's own acceptance:
at width 8 on greedy short prompts, seven rows commit 15-17 tokens a round
and one commits 1-9; the seven finish, and the eighth decodes on alone.
A batch is done when its last row is, and a row left alone costs nearly a
whole step per token (a plain step of one row took 2.2 ms against 4.0 ms
for sixteen, short prompts), so the tokens a lagging row still owes cost
several times what they would in step with the others. The mean rate of a
round does not see that.

So each speculative step is charged, in tokens, for the lag it adds: the
growth of the batch's spread, its rows' largest remaining work less their
mean (:func:`lag_growth`). The chooser prices those tokens at one row's
cost (:meth:`.ScheduleChooser.observe`). Plain steps, and pipelined steps
whose rows accept alike, add none; a step in which a lagging row catches up
takes some back.

It replaces a model of the rows' lasting paces with a step's cost in
proportion to its width (the thirty-fifth to forty-fourth sessions), which
saw a round's lag only once the rows' paces had drifted apart, and saw a
row left alone as costing a sixteenth of a step. Measured
(``benchmarks/probes/drain_tail.py``: an auto d2 engine forced to the
policy's rounds at the full width and pipelined steps once rows finish,
greedy, 128 tokens; trial rate over the chooser's full-width rating, 1 is
exact): with this charge 1.01, 1.03, 0.95 and 1.06 at short c16, short c8,
long c8 and long c16; with the paces 0.95, 0.93, 1.00 and 1.05
(``drain_tail_fortyfifth_*.txt``). As accurate on these forced trials; the
difference is when the cost is seen. On the sweep's protocol
(``probes/sweep_replay_trace.py --draft-loops 2 --trace short:0:16``), the
paces let rounds win context bucket 1 of short greedy c16 (rated 280-306
tokens/s per request against the pipeline's 255; their trials ran 0.87-0.94x
the fixed pipeline), and the auto trials ran at a median 0.91x the fixed
pipeline over six repeats; with the charge, 0.97x, rounds in two of six.

Only the current batch is counted: requests still to arrive would fill the
rows that finish early.
"""

from __future__ import annotations

from collections.abc import Sequence


def lag_growth(committed: Sequence[int], remaining: Sequence[int]) -> float:
    """Tokens of lag a step added to its rows: their spread (the largest
    work left less the mean) after the step less before it, the rows
    having committed ``committed`` and having ``remaining`` tokens left
    after it. Negative where the step narrowed the spread; 0 for one row."""
    if len(committed) < 2:
        return 0.0
    after = [max(int(r), 0) for r in remaining]
    before = [r + int(c) for r, c in zip(after, committed)]
    return _spread(after) - _spread(before)


def _spread(remaining: Sequence[int]) -> float:
    return max(remaining) - sum(remaining) / len(remaining)
