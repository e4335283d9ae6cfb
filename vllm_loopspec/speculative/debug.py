"""The drafter with test and profiling hooks, kept off the serving path.

Selected instead of :class:`LoopSpecDrafter` when ``VLLM_LOOPSPEC_DEBUG=1``
is set before the engine is configured (the test suite and the benchmarks
set it). All hooks are off (``None``) until a caller sets them:

* ``draft_override(req_id, step, token, anchor_position) -> token``: replace
  greedy drafts (force acceptance or rejection at a chosen position);
* ``trace``: a list; each round appends ``{req_id: {"prefix", "tokens",
  "positions", "slots"}}`` (tokens are ``[A, c_1..c_K]``);
* ``pipeline_trace``: a list; every pass of a pipelined step appends, for
  each pipelined token (a draft slot) it ran, ``{"req_id", "loop",
  "position", "chain", "state"}`` (``chain``: the tokens ``[A, .., x]``
  the token's state depends on, from ``A`` through itself; ``state``: its
  exit state of ``loop``), pruned tokens included;
* ``profile``: a dict; each round adds wall seconds per phase ("plan",
  "base", "draft", "draft_logits", "draft_choose", "draft_host", "verify").

Always on with tensor parallelism: after each round (or pipelined step) the drafts every TP rank
hands to vLLM (and wrote into its KV shard) are compared across the group,
and a rank that drafted differently stops the engine
(:class:`TensorParallelDraftMismatch`).
"""

from __future__ import annotations

import time

import torch

from vllm_loopspec.speculative.drafter import LoopSpecDrafter, _ServedModel


class DebugLoopSpecDrafter(LoopSpecDrafter):
    def __init__(self, vllm_config) -> None:
        super().__init__(vllm_config)
        self.draft_override = None
        self.trace: list[dict] | None = None
        self.profile: dict[str, float] | None = None
        self.pipeline_trace: list[dict] | None = None

    # -- profile -----------------------------------------------------------------
    def _add(self, phase: str, seconds: float) -> None:
        if self.profile is not None:
            self.profile[phase] = self.profile.get(phase, 0.0) + seconds

    def plan(self, spec_metadata, common):
        start = time.perf_counter()
        try:
            return super().plan(spec_metadata, common)
        finally:
            self._add("plan", time.perf_counter() - start)

    def execute(self, plan, chooser, input_ids, positions):
        if self.profile is None:
            return super().execute(plan, chooser, input_ids, positions)
        from vllm.forward_context import get_forward_context

        model = _ProfiledModel(self, get_forward_context())
        start = time.perf_counter()
        try:
            from vllm_loopspec.speculative.round import run_round

            return run_round(plan, model, _timed_chooser(self, chooser), input_ids, positions)
        finally:
            model.restore()
            total = time.perf_counter() - start
            # Host work of the draft ticks: their wall time minus the model
            # compute inside them (layers, lm_head, embedding).
            draft_wall = total - model.base_seconds - model.verify_seconds
            self._add("draft_host", draft_wall - model.draft_compute_seconds)

    # -- tensor parallelism ----------------------------------------------------
    def hand_off(self, plan, output, chooser, spec_metadata) -> None:
        super().hand_off(plan, output, chooser, spec_metadata)
        check_same_drafts_on_every_tp_rank(spec_metadata.draft_token_ids)

    def hand_off_chain(self, layout, output, spec_metadata) -> None:
        super().hand_off_chain(layout, output, spec_metadata)
        check_same_drafts_on_every_tp_rank(spec_metadata.draft_token_ids)

    # -- draft override and trace -------------------------------------------------
    def make_chooser(self, plan):
        chooser = super().make_chooser(plan)
        if self.draft_override is None:
            return chooser
        override = self.draft_override
        req_ids = self.runner.input_batch.req_ids
        spec_rows = plan.layout.spec_rows.tolist()
        anchor_pos = (plan.layout.seq_lens - plan.layout.num_drafts - 1)[plan.layout.spec_rows].tolist()
        valid = plan.drafts_valid

        def choose(logits, step):
            tokens = chooser(logits, step).tolist()
            for s, r in enumerate(spec_rows):  # padding rows (after these) keep theirs
                if valid[step, s]:
                    tokens[s] = override(req_ids[r], step + 1, int(tokens[s]), anchor_pos[s])
            return torch.tensor(tokens, dtype=torch.int64, device=logits.device)

        return _ChooserView(chooser, choose)

    def pipeline_override(self, layout):
        if self.draft_override is None:
            return None
        override = self.draft_override
        req_ids = self.runner.input_batch.req_ids
        anchor_pos = (layout.seq_lens - layout.num_drafts - 1).tolist()
        return lambda row, slot, token: override(req_ids[row], slot, int(token), anchor_pos[row])

    def pipeline_observer(self, layout, positions):
        if self.pipeline_trace is None:
            return None
        trace, req_ids = self.pipeline_trace, list(self.runner.input_batch.req_ids)
        anchors = layout.anchors
        spec = set(layout.spec_rows.tolist())

        def observe(groups, token_ids, states):
            for loop, entries in groups:
                for e in entries:
                    if e.row not in spec or e.start <= anchors[e.row]:
                        continue  # base tokens (A, prefill chunks) are checked by the round's tests
                    a = int(anchors[e.row])
                    trace.append({"req_id": req_ids[e.row], "loop": loop, "position": int(positions[e.start]),
                                  "chain": token_ids[a: e.start + 1].tolist(),
                                  "state": states[e.start].detach().clone()})

        return observe

    def run_step(self, input_ids, positions, spec_metadata, common):
        hidden = super().run_step(input_ids, positions, spec_metadata, common)
        if self.trace is not None:
            self.trace.append(self._record(input_ids, positions, spec_metadata, common))
        return hidden

    def _record(self, input_ids, positions, spec_metadata, common) -> dict:
        """After the round: ``input_ids`` still holds placeholders, so tokens
        come from the drafts vLLM's sampler will verify."""
        batch = self.runner.input_batch
        num_drafts = list(spec_metadata.num_draft_tokens)
        query_start = common.query_start_loc_cpu[: len(num_drafts) + 1].tolist()
        drafts = spec_metadata.draft_token_ids.tolist()
        rounds, offset = {}, 0
        for row, k in enumerate(num_drafts):
            if not k:
                continue
            anchor = query_start[row + 1] - k - 1
            span = slice(anchor, anchor + k + 1)
            pos_a = int(positions[anchor])
            rounds[batch.req_ids[row]] = {
                "prefix": batch.token_ids_cpu[row, :pos_a].tolist(),
                "tokens": [int(input_ids[anchor])] + drafts[offset: offset + k],
                "positions": positions[span].tolist(),
                "slots": common.slot_mapping[span].tolist(),
            }
            offset += k
        return rounds


class _ChooserView:
    """A chooser with the override applied; ``q`` stays the real chooser's."""

    def __init__(self, inner, call) -> None:
        self.inner = inner
        self.call = call

    def __call__(self, logits, step):
        return self.call(logits, step)

    @property
    def q(self):
        return self.inner.q


def _timed_chooser(drafter: DebugLoopSpecDrafter, chooser):
    def choose(logits, step):
        start = time.perf_counter()
        try:
            return chooser(logits, step)
        finally:
            drafter._add("draft_choose", time.perf_counter() - start)

    return _ChooserView(chooser, choose)


class _ProfiledModel(_ServedModel):
    """Times the model compute of each phase of the round."""

    def __init__(self, drafter: DebugLoopSpecDrafter, context) -> None:
        d = drafter.round_draft_loops
        super().__init__(drafter.model, drafter.shallow_names(d), context, d, drafter.num_loops, drafter.stats)
        self.drafter = drafter
        self.base_seconds = 0.0
        self.verify_seconds = 0.0
        self.draft_compute_seconds = 0.0
        self._shallow_calls = 0

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - start

    def embed(self, token_ids):
        out, dt = self._timed(super().embed, token_ids)
        if self._shallow_calls:
            self.draft_compute_seconds += dt
        else:
            self.base_seconds += dt
        return out

    def shallow(self, hidden, positions, tick):
        out, dt = self._timed(super().shallow, hidden, positions, tick)
        if self._shallow_calls == 0:
            self.base_seconds += dt
            self.drafter._add("base", dt)
        else:
            self.draft_compute_seconds += dt
            self.drafter._add("draft", dt)
        self._shallow_calls += 1
        return out

    def logits(self, hidden):
        out, dt = self._timed(super().logits, hidden)
        self.draft_compute_seconds += dt
        self.drafter._add("draft_logits", dt)
        return out

    def deep(self, shallow_states, positions):
        out, dt = self._timed(super().deep, shallow_states, positions)
        self.verify_seconds += dt
        self.drafter._add("verify", dt)
        return out


class TensorParallelDraftMismatch(RuntimeError):
    pass


def check_same_drafts_on_every_tp_rank(draft_token_ids: torch.Tensor) -> None:
    """Raise unless every rank of the tensor-parallel group drafted exactly
    ``draft_token_ids`` (one all-gather per round; nothing with TP=1)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return
    # float32 holds token ids exactly (< 2**24), and vLLM's CPU shared-memory
    # all-gather has no integer kernels.
    flat = draft_token_ids.reshape(-1).to(torch.float32).contiguous()
    gathered = group.all_gather(flat, dim=0).view(group.world_size, -1)
    if not bool((gathered == gathered[0]).all()):
        raise TensorParallelDraftMismatch(
            f"TP ranks drafted different tokens in one round (rank {group.rank_in_group} of "
            f"{group.world_size}): {gathered.tolist()}")
