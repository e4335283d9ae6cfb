"""The pipelined step (issue 12, RFC §7): every in-flight token of every
request advances ``d1`` loops per tick, drafting and verification overlap.

vLLM schedules, for a speculating request, ``[A, c_1..c_K]`` (``A`` the last
committed token, not yet forwarded). A round (:mod:`.round`) drafts all
``c_j`` with loops ``[0, d)`` and then verifies them at once; a rejection at
``c_j`` is found only after every later draft was paid for. Here instead:

* ``A`` (and every other non-draft token of the step: prefill chunks, plain
  decodes) enters loop 0 at tick 0;
* a token that reaches depth ``d1`` *proposes* its successor (greedy: the
  argmax of its depth-``d1`` logits; sampled: a draw from the processed
  ``q``), which enters loop 0 at the next tick, beside its predecessor;
* a token that reaches depth ``R`` *verifies* its successor with its target
  distribution ``p`` (greedy: the successor must be ``argmax p``; sampled:
  accepted with ``min(1, p/q)``, else replaced by a draw from
  ``norm(max(p - q, 0))``). A replaced successor restarts at loop 0 in the
  next tick at the same position and KV slot (its passes overwrite every
  loop's stale entries), and everything drafted after it is pruned.

With a second proposal at depth ``d2`` (``second_proposal_loop``), a token
that reaches ``d2`` *refines* its successor: greedy, the successor becomes the
depth-``d2`` argmax; sampled, the first proposal ``c ~ q1`` is kept with
``min(1, q2(c)/q1(c))``, else replaced by a draw from ``norm(max(q2 - q1,
0))``, which makes the candidate an exact draw from ``q2``, the distribution
verification then uses. A replaced successor restarts at loop 0 like a
rejected one, ``R - d2`` loops earlier than verification would have found
it. (LoopSpec runs the second candidate *beside* the first, which needs KV
slots of its own for it; this one takes the first one's place.)

The step ends when every slot holds a verified token at depth ``R``: vLLM
then gets the chain as the step's drafts and the loop-``R`` states of every
slot for its logits. Its rejection sampler stays the arbiter: greedy, every
handed draft is the target argmax and is accepted (unless a logits processor
vLLM applies to the target, e.g. a penalty, disagrees: then it rejects, which
is still exact); sampled, the draft distribution handed over for slot ``j``
is ``p_{j-1}`` itself (the chain token was drawn from it by the lossless
cascade above), so vLLM accepts it with probability ``p/p = 1`` and the
committed tokens follow the target.

Two tokens of one request are never at the same loop in one pass (a
successor starts only after its predecessor left loop ``d1 - 1``), so the
rows of a loop group hold at most one pipelined token per request, and a
token at loop ``u`` reads loop-``u`` KV its predecessors wrote in earlier
ticks. The schedule's state (:class:`PipelineSchedule`) lives on the host
and is pure Python; :func:`run_pipelined` does the tensor work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from vllm_loopspec.speculative.plan import NUMPY_INTS, StepLayout, TickAttention, host_tensor

NOT_STARTED = -1


class Entry(NamedTuple):
    """Tokens ``[start, start + count)`` (flat) of request row ``row``, all at
    one loop in one pass; ``seq_len``: the row's length through the last."""

    row: int
    start: int
    count: int
    seq_len: int


@dataclass
class Pass:
    """One pass of a tick: its loop groups (ascending loop, entries in row
    order) and, flattened once for the tensor work, its rows (the entries'
    tokens, group after group) as plain lists. A tick's host work is a few
    dozen small operations, each costing microseconds, so every list here
    is built once and turned into a tensor at most once."""

    groups: list[tuple[int, list[Entry]]]
    flat: list[int] = field(default_factory=list)  # flat index of each row
    row_loops: list[int] = field(default_factory=list)  # loop of each row
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (loop, start, end) of each group's rows
    entries: list[Entry] = field(default_factory=list)  # every group's, in order
    entry_loops: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for loop, entries in self.groups:
            start = len(self.flat)
            for e in entries:
                if e.count == 1:
                    self.flat.append(e.start)
                else:
                    self.flat.extend(range(e.start, e.start + e.count))
            self.row_loops.extend([loop] * (len(self.flat) - start))
            self.spans.append((loop, start, len(self.flat)))
            self.entries.extend(entries)
            self.entry_loops.extend([loop] * len(entries))


@dataclass
class PipelineCounts:
    """What one step's pipeline did (for the metrics and the benchmarks)."""

    ticks: int = 0
    passes: int = 0  # run_tick calls
    restarts: int = 0  # successors replaced at verification
    refined: int = 0  # successors replaced by a second proposal at d2
    pruned: int = 0  # in-flight tokens discarded with a replaced ancestor
    first_accepted: list[int] = field(default_factory=list)  # per slot j-1: first proposals kept, summed over rows
    second_accepted: int = 0  # slots whose final token is a second proposal


class PipelineSchedule:
    """Host state of one step's pipeline: the depth and token of every slot
    of every speculating row. Pure Python; :func:`run_pipelined` asks it
    what each pass runs and tells it what the logits decided."""

    def __init__(self, layout: StepLayout, num_loops: int, draft_loops: int,
                 second_proposal_loop: int | None = None) -> None:
        if not 1 <= draft_loops < num_loops:
            raise ValueError(f"draft_loops must be in [1, {num_loops}), got {draft_loops}")
        d2 = second_proposal_loop
        if d2 is not None and not (draft_loops < d2 < num_loops and d2 % draft_loops == 0):
            raise ValueError(f"second_proposal_loop must be a multiple of draft_loops ({draft_loops}) "
                             f"below {num_loops}, got {d2}")
        self.layout = layout
        self.R = num_loops
        self.d1 = draft_loops
        self.d2 = d2
        self.spec_rows = layout.spec_rows.tolist()
        self.num_drafts = {r: int(layout.num_drafts[r]) for r in self.spec_rows}
        self.anchor = {r: int(layout.anchors[r]) for r in self.spec_rows}
        self.base_seq = {r: int(layout.seq_lens[r] - layout.num_drafts[r]) for r in self.spec_rows}
        # Base tokens (every row's non-draft tokens, A included) share one depth.
        self.base_depth = 0
        ends = layout.query_start[1:] - layout.num_drafts
        self.base_entries = [
            Entry(r, int(layout.query_start[r]), int(ends[r] - layout.query_start[r]),
                  int(layout.seq_lens[r] - layout.num_drafts[r]))
            for r in range(layout.num_rows) if ends[r] > layout.query_start[r]]
        # Slot j = 1..K_i of each speculating row at index j - 1; the methods
        # below take the *predecessor's* slot j - 1, which is the same index.
        self.depth = {r: [NOT_STARTED] * self.num_drafts[r] for r in self.spec_rows}
        self.token = {r: [0] * self.num_drafts[r] for r in self.spec_rows}
        # What each slot holds: "first" (its first proposal), "second" (a
        # second proposal), "target" (the token its verification decided).
        self.kind = {r: [""] * self.num_drafts[r] for r in self.spec_rows}
        self.counts = PipelineCounts(first_accepted=[0] * layout.max_drafts)

    # -- where things are --------------------------------------------------------
    def flat(self, row: int, slot: int) -> int:
        """Flat index of slot ``slot`` (0 = ``A``) of speculating row ``row``."""
        return self.anchor[row] + slot

    @property
    def done(self) -> bool:
        return self.base_depth >= self.R and all(d >= self.R for ds in self.depth.values() for d in ds)

    def passes(self) -> list[Pass]:
        """The next tick's passes, each with its ``(loop, entries)`` groups
        in ascending loop, entries in row order."""
        out = []
        for s in range(self.d1):
            by_loop: dict[int, list[Entry]] = {}
            if self.base_depth + s < self.R:
                by_loop.setdefault(self.base_depth + s, []).extend(self.base_entries)
            for r in self.spec_rows:
                anchor, base_seq = self.anchor[r], self.base_seq[r]
                for j, d in enumerate(self.depth[r], start=1):
                    if d != NOT_STARTED and d + s < self.R:
                        by_loop.setdefault(d + s, []).append(Entry(r, anchor + j, 1, base_seq + j))
            if not by_loop:
                break
            out.append(Pass([(u, sorted(by_loop[u])) for u in sorted(by_loop)]))
        return out

    def finish_tick(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """Advance every running token by ``d1`` loops. Returns, in row
        order, the slots ``(row, slot)`` with a successor slot that now
        *propose* (just reached depth ``d1``), *refine* (just reached
        ``d2`` while their successor holds its first proposal) and *verify*
        (just reached ``R``)."""
        self.counts.ticks += 1
        propose, refine, verify = [], [], []

        def advance(row: int, slot: int, depth: int) -> int:
            new = min(depth + self.d1, self.R)
            if slot < self.num_drafts.get(row, 0):
                if depth < self.d1 <= new:
                    propose.append((row, slot))
                if self.d2 is not None and depth < self.d2 <= new:
                    refine.append((row, slot))
                if new == self.R:
                    verify.append((row, slot))
            return new

        if self.base_depth < self.R:
            for r in self.spec_rows:
                advance(r, 0, self.base_depth)
            self.base_depth = min(self.base_depth + self.d1, self.R)
        for r in self.spec_rows:
            ds = self.depth[r]
            for j, d in enumerate(ds, start=1):
                if d != NOT_STARTED and d < self.R:
                    ds[j - 1] = advance(r, j, d)
        propose.sort()
        verify.sort()
        refine.sort()
        return propose, refine, verify

    def proposed(self, row: int, slot: int, token: int) -> None:
        """``token`` is the first proposal for ``slot + 1``: it enters loop 0."""
        self.token[row][slot] = token
        self.depth[row][slot] = 0
        self.kind[row][slot] = "first"

    def refined(self, row: int, slot: int, token: int) -> bool:
        """Slot ``slot``'s second proposal for ``slot + 1`` is ``token``.
        Returns whether the successor was kept; if not, it restarts with
        ``token`` and every slot after it is pruned."""
        if self.token[row][slot] == token:
            return True
        self.counts.refined += 1
        self._restart(row, slot, token, "second")
        return False

    def verified(self, row: int, slot: int, token: int) -> bool:
        """Slot ``slot``'s target decided ``token`` for ``slot + 1``. Returns
        whether the successor was kept; if not, it restarts with ``token``
        and every slot after it is pruned."""
        if self.token[row][slot] == token and self.depth[row][slot] != NOT_STARTED:
            return True
        self.counts.restarts += 1
        self._restart(row, slot, token, "target")
        return False

    def _restart(self, row: int, slot: int, token: int, kind: str) -> None:
        self.token[row][slot] = token
        self.depth[row][slot] = 0
        self.kind[row][slot] = kind
        for k in range(slot + 1, self.num_drafts[row]):
            if self.depth[row][k] != NOT_STARTED:
                self.counts.pruned += 1
            self.depth[row][k] = NOT_STARTED

    def drafts(self) -> list[int]:
        """The verified chain in vLLM's flat draft order (row by row)."""
        self.counts.first_accepted = [0] * self.layout.max_drafts
        self.counts.second_accepted = 0
        out = []
        for r in self.spec_rows:
            out.extend(self.token[r])
            for j, kind in enumerate(self.kind[r]):
                self.counts.first_accepted[j] += int(kind == "first")
                self.counts.second_accepted += int(kind == "second")
        return out


class PipelineModel(Protocol):
    """What the pipeline needs of the served model and the step's context."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def tick(self, hidden: torch.Tensor, positions: torch.Tensor,
             groups: Sequence[tuple[int, int, int, TickAttention | None]], merged=None) -> torch.Tensor:
        """One pass: rows ``[start, end)`` at ``loop`` under ``attention``
        for each ``(loop, start, end, attention)``; or, with ``merged``, every
        group's attention in one call per layer (the groups' own are None)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class Decider(Protocol):
    """Proposes, refines and verifies tokens from logits (greedy or sampled)."""

    def decide(self, logits: torch.Tensor, propose: list[tuple[int, int]], refine: list[tuple[int, int]],
               verify: list[tuple[int, int]], proposals: list[int]) -> list[int]:
        """One tick's decisions, one call (one argmax, one processing of the
        distributions): ``logits`` of the slots ``propose + refine +
        verify`` in that order; ``proposals``: the current successor of
        each ``refine + verify`` slot. Returns a token per slot, in order:
        the proposed successor, the refined one, the verified one."""


class GreedyDecider:
    def decide(self, logits, propose, refine, verify, proposals):
        return logits.argmax(dim=-1).tolist()


class SampledDecider:
    """Sampled (and mixed) rows: a proposal is a draw from the processed
    shallow distribution ``q``; verification accepts it with
    ``min(1, p/q)``, else draws from ``norm(max(p - q, 0))`` (the standard
    speculative sampling step, so the decided token follows ``p``). Greedy
    rows take argmaxes. ``process(logits, rows)`` turns logits into the
    distribution vLLM's rejection sampler would (temperature, top-k,
    top-p); ``generators``: per row, a seeded request's generator (each
    tick it draws two uniforms per slot of its row, in slot order;
    unseeded rows draw from the global generator).

    :attr:`target` keeps, per ``(row, slot)``, the distribution ``p`` the
    slot's successor was decided from: the draft distribution vLLM's
    rejection sampler gets for that draft (the decided token was drawn
    from it, so ``p/q = 1`` there and vLLM accepts it)."""

    def __init__(self, process: Callable[[torch.Tensor, list[int]], torch.Tensor], sampled: dict[int, bool],
                 generators: dict[int, torch.Generator]) -> None:
        self.process = process
        self.sampled = sampled
        self.generators = generators
        self.proposal_q: dict[tuple[int, int], torch.Tensor] = {}
        self.target: dict[tuple[int, int], torch.Tensor] = {}

    def _uniforms(self, rows: list[int], device) -> torch.Tensor:
        """Two float64 uniforms per slot (``rows``: each slot's row, a row's
        slots adjacent): a seeded row's from its generator, in one call."""
        out = torch.empty((len(rows), 2), dtype=torch.float64, device=device)
        if any(r not in self.generators for r in rows):
            out.uniform_()
        start = 0
        for row, group in itertools.groupby(rows):
            end = start + len(list(group))
            if row in self.generators:
                out[start:end].uniform_(generator=self.generators[row])
            start = end
        return out

    def decide(self, logits, propose, refine, verify, proposals):
        slots = propose + refine + verify
        sampled = [i for i, (r, _) in enumerate(slots) if self.sampled[r]]
        out = logits.argmax(dim=-1).tolist() if len(sampled) < len(slots) else [0] * len(slots)
        if not sampled:
            return out
        sampled.sort(key=lambda i: slots[i][0])  # a row's slots adjacent (stable: in slot order)
        rows = [slots[i][0] for i in sampled]
        in_order = sampled == list(range(len(slots)))
        p = self.process(logits if in_order else logits[sampled], rows)
        n_propose, n_refined = len(propose), len(propose) + len(refine)
        # A proposal draws from its processed distribution; a refinement or
        # verification keeps its successor's proposal c ~ q with
        # min(1, p(c)/q(c)), else draws from norm(max(p - q, 0)). With q = 0
        # for proposals, one set of tensor ops does both: their residual is
        # p itself and nothing is kept. Each draw inverts the residual's CDF
        # (float64) at the slot's first uniform; the acceptance test uses
        # its second, independent of the draw, so the decided token follows
        # p. (On CPU the CDF costs about half the exponential race's noise,
        # which needs a uniform and a log per vocabulary entry.) The tests
        # themselves run on the host, over the two probabilities each slot
        # reads: a tick is a few dozen operations of microseconds each.
        stepped = [k for k, i in enumerate(sampled) if i >= n_propose]  # positions in ``sampled``
        weights = p
        uniform = self._uniforms(rows, p.device)
        kept = {}
        if stepped:
            zero = p.new_zeros(p.shape[-1])
            q = torch.stack([self.proposal_q.pop(slots[i]) if i >= n_propose else zero for i in sampled])
            residual = (p - q).clamp_min_(0.0)
            # No residual mass (p <= q everywhere, p = q up to rounding): the
            # draw, used only if rounding rejects c, is from p itself.
            weights = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
            c = [proposals[sampled[k] - n_propose] for k in stepped]
            at = (host_tensor(stepped).to(p.device, non_blocking=True), host_tensor(c).to(p.device, non_blocking=True))
            qc, pc = torch.stack([q[at], p[at]]).tolist()
            second = uniform[:, 1].tolist()
            kept = {k: token for k, token, qk, pk in zip(stepped, c, qc, pc) if qk > 0 and second[k] * qk < pk}
        cdf = weights.double().cumsum_(dim=-1)
        draws = torch.searchsorted(cdf, uniform[:, :1] * cdf[:, -1:], right=True)[:, 0].clamp_max_(p.shape[-1] - 1)
        for k, (i, token) in enumerate(zip(sampled, draws.tolist())):
            out[i] = kept.get(k, token)
            if i < n_refined:  # a proposal, or a refined successor (now a draw from p): verification uses p
                self.proposal_q[slots[i]] = p[k]
            else:
                self.target[slots[i]] = p[k]
        return out


@dataclass
class PipelineOutput:
    hidden_states: torch.Tensor  # [num_tokens, H] loop-R exit states
    drafts: list[int]  # vLLM's flat draft order
    counts: PipelineCounts


def run_pipelined(schedule: PipelineSchedule, model: PipelineModel, decide: Decider,
                  attention: Callable[[list[Entry], list[int]], TickAttention],
                  input_ids: torch.Tensor, positions: torch.Tensor,
                  override: Callable[[int, int, int], int] | None = None,
                  on_pass: Callable[[list[tuple[int, list[Entry]]], torch.Tensor, torch.Tensor], None] | None = None,
                  merge: Callable[[Pass], object] | None = None,
                  on_verified: Callable[[list[tuple[int, int]], torch.Tensor], None] | None = None,
                  ) -> PipelineOutput:
    """Run the step's ticks until every slot is verified at depth ``R``.
    ``attention(entries, flat)`` builds one loop group's attention metadata
    (``flat``: its rows' flat indices); ``merge(pass_)``, where given, one
    attention for every group of a pass that has several
    (:class:`~vllm_loopspec.models.ouro.MergedAttention`).
    ``on_verified(slots, logits)``, where given, gets each tick's loop-``R``
    logits of the slots ``(row, slot)`` that verified their successor. A
    slot's last ones are those of its final state: the target logits vLLM's
    sampler needs at that position, which the caller can keep rather than
    have vLLM run ``lm_head`` over those rows again. Test hooks:
    ``override(row, slot, token)`` replaces first proposals;
    ``on_pass(groups, token_ids, states)`` sees every pass just after it
    ran (the step's current tokens and newest states by flat index)."""
    n = schedule.layout.num_tokens
    device = input_ids.device
    tokens = input_ids[:n].tolist()  # the step's current tokens, on the host (proposals and restarts write here)
    states: torch.Tensor | None = None
    while not schedule.done:
        for pass_ in schedule.passes():
            flat = host_tensor(pass_.flat).to(device, non_blocking=True)
            merged = merge(pass_) if merge is not None and len(pass_.spans) > 1 else None
            spans = [(loop, start, end, None if merged is not None else
                      attention(entries, pass_.flat[start:end]))
                     for (loop, start, end), (_, entries) in zip(pass_.spans, pass_.groups)]
            first_loop, _, first_end = pass_.spans[0]
            if first_loop == 0:  # tokens entering the stack: their embeddings
                entering = host_tensor([tokens[i] for i in pass_.flat[:first_end]], NUMPY_INTS[input_ids.dtype])
                hidden = model.embed(entering.to(device, non_blocking=True))
                if states is None:
                    states = hidden.new_empty((n, hidden.shape[-1]))
                if first_end < len(pass_.flat):
                    hidden = torch.cat([hidden, states[flat[first_end:]]])
            else:
                hidden = states[flat]
            states[flat] = model.tick(hidden, positions[flat], spans, merged)
            schedule.counts.passes += 1
            if on_pass is not None:
                on_pass(pass_.groups, host_tensor(tokens), states)
        propose, refine, verify = schedule.finish_tick()
        slots = propose + refine + verify
        if not slots:
            continue
        index = host_tensor([schedule.flat(r, j) for r, j in slots]).to(device, non_blocking=True)
        logits = model.logits(states[index])
        proposals = [schedule.token[r][j] for r, j in refine + verify]
        decided = decide.decide(logits, propose, refine, verify, proposals)
        if on_verified is not None and verify:
            on_verified(verify, logits[len(logits) - len(verify):])
        for (r, j), token in zip(propose, decided):
            if override is not None:
                token = override(r, j + 1, token)
            schedule.proposed(r, j, token)
            tokens[schedule.flat(r, j + 1)] = token
        for (r, j), token, refining in zip(refine + verify, decided[len(propose):],
                                           [True] * len(refine) + [False] * len(verify)):
            keep = schedule.refined if refining else schedule.verified
            if not keep(r, j, token):
                tokens[schedule.flat(r, j + 1)] = token
    drafts = schedule.drafts()
    return PipelineOutput(hidden_states=states, drafts=drafts, counts=schedule.counts)
