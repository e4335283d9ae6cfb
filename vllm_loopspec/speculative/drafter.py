"""The loopspec drafter: the class vLLM's ``custom_class`` method instantiates.

Like vLLM's own proposers (``EagleProposer``, ``NgramProposer``), the
drafter owns speculation and the runner only calls it:

* :meth:`LoopSpecDrafter.propose` (vLLM calls it after each step's
  bookkeeping): counts the step's acceptance and answers how many draft
  slots each request gets next step (``K_i``: from the adaptive policy,
  :mod:`~vllm_loopspec.speculative.adaptive`, or the fixed K; shrunk near
  ``max_tokens`` and the context limit; 0 for requests whose sampling the
  rejection sampler cannot verify). The slots hold placeholders: loopspec
  drafts inside the next step's forward, where the shallow loops of ``A``
  run anyway.
* :meth:`LoopSpecDrafter.step_started` / :meth:`step_finished` (from the
  runner): time each engine step for the adaptive policy's cost model.
* :meth:`LoopSpecDrafter.run_step` (called from the runner's model forward):
  plans the step's ticks, runs the round, and hands the drafts (and, when
  sampling, the draft distribution ``q``) to vLLM's rejection sampler.

The served model is the draft model: its loops ``[0, d)``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_loopspec.speculative.adaptive import SKIP_MEASURED, SKIP_WIDTH_CAP, AdaptiveController, sampling_mix
from vllm_loopspec.speculative.batch_drain import lag_growth
from vllm_loopspec.speculative.options import ADDITIONAL_CONFIG_KEY, LoopSpecOptions
from vllm_loopspec.speculative.pipeline import (Entry, GreedyDecider, Pass, PipelineOutput, PipelineSchedule,
                                                 SampledDecider, run_pipelined)
from vllm_loopspec.speculative.plan import RoundPlan, StepLayout, TickAttention, build_plan, host_tensor, tick_attention
from vllm_loopspec.speculative.planes import StackedPlanes, stack_loop_planes
from vllm_loopspec.speculative.policy import fit_linear, seeded_costs
from vllm_loopspec.speculative.round import RoundOutput, run_round
from vllm_loopspec.speculative.schedule_choice import (PIPELINED, PLAIN, POLICY, UNCHOSEN, ScheduleChooser, arm_depth,
                                                       arm_kind, arms_for_depths)
from vllm_loopspec.speculative.metrics import LoopSpecStats

logger = init_logger("vllm.loopspec.drafter")  # under vLLM's logger, which has the handlers

# Row counts warmed at startup (:meth:`LoopSpecDrafter.warm_up_row_counts`):
# 1..128 covers a pipelined step's passes and logits up to width 32 at d=1
# and rounds' verifications up to 128 tokens, and takes 640 of oneDNN's 1024
# cached kernels (five weight shapes), leaving the rest for prefill shapes.
WARM_ROW_COUNTS = 128

TIME_UNDER_CAP_EVERY = 8  # plain steps under the width cap: one in this many is timed

PLACEHOLDER_TOKEN = 0  # vLLM schedules these slots; the round writes the real drafts

# Reasons a request decodes one token without drafting in a step.
SKIP_LOGPROBS = "logprobs"
SKIP_STRUCTURED = "structured_output"
SKIP_BUDGET = "token_budget"  # max_tokens or max_model_len leaves no room
# vLLM's rejection sampler cannot apply these to the target distribution:
# such requests decode one token per step, through the plain sampler's path.
SKIP_MIN_P = "min_p"
SKIP_LOGIT_BIAS = "logit_bias"
# "auto": a speculative step that new requests' prefill joined runs plain.
SKIP_ARRIVALS = "arrivals"
_SAMPLING_EPS = 1e-5
_TINY = torch.finfo(torch.float32).tiny  # log(0) guard for the uniform draws


def _median_seconds(run, device, repeats: int = 3) -> float:
    """Median wall seconds of ``run()`` over ``repeats`` calls after one
    that is not counted (it may pay one-off work)."""
    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    seconds = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def _decode_only(scheduler_output) -> bool:
    """Every scheduled row decodes: its last token and its drafts, no prefill."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    return all(n == 1 + len(spec.get(req_id, ())) for req_id, n in scheduler_output.num_scheduled_tokens.items())


class LoopSpecDrafter:
    def __init__(self, vllm_config) -> None:
        raw = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            raise RuntimeError("loopspec drafter started without loopspec options; "
                               "use --speculative-config loopspec")
        self.vllm_config = vllm_config
        self.options = LoopSpecOptions.from_dict(raw)
        self.stats = LoopSpecStats()
        self.runner = None
        self.model = None
        # Draft ticks padded to these row counts (fixed shapes for CUDA graph
        # capture); None on CPU, where shapes cost nothing.
        self.row_buckets: list[int] | None = None
        self._last_num_drafts: np.ndarray | None = None  # K_i of the step just verified
        # The adaptive policy of each draft depth a step may run at (one
        # unless draft_loops is a list): acceptance per position and a
        # tick's cost depend on the depth. ``controller``: the one of the
        # depth chosen for the next (then the running) step.
        self.controllers: dict[int, AdaptiveController] = {}
        if self.options.adaptive:
            self.controllers = {d: AdaptiveController(max_k=self.options.max_speculative_tokens,
                                                      start_k=self.options.num_speculative_tokens)
                                for d in self.options.depths}
        self.controller: AdaptiveController | None = self.controllers.get(self.options.draft_loops)
        self._next_depth = self.options.draft_loops  # the draft depth of the next step
        self._round_controller: AdaptiveController | None = None  # the policy whose round was verified last
        self._step_shape: tuple[int, int, int] | None = None  # (ticks, drafting rows, tokens)
        self._step_width: int | None = None  # requests of a decode-only step
        self._step_context = 0  # the step's rows' lengths, summed
        self._step_committed: int | None = None  # tokens the step committed (propose)
        self._step_rated: float | None = None  # ... as the chooser is fed them (None: not a chosen step)
        self._step_lag = 0.0  # tokens of lag the step added to its batch (:mod:`.batch_drain`)
        self._step_scheduled: dict[str, int] = {}  # tokens scheduled per request this step
        # Async scheduling: K_i chosen for the next step (the runner trims
        # vLLM's uniform placeholder drafts to them), and each step's
        # committed counts, read one step late (on a device that is when the
        # copy has landed).
        self.next_drafts: dict[str, int] = {}
        self._committed_now: _Committed | None = None
        self._committed_prev: _Committed | None = None
        self._step_start = 0.0
        self._step_end: float | None = None
        self._planes: tuple[StackedPlanes | None] | None = None  # found at the first pipelined step
        # "schedule": "auto": the chooser picks each decode step's arm by
        # measured rate (:mod:`.schedule_choice`). _next_pipelined: whether
        # the next step pipelines; _step_pipelined: the running step's.
        self.chooser = ScheduleChooser(arms_for_depths(self.options.depths)) if self.options.schedule == "auto" else None
        self._next_pipelined = self._step_pipelined = self.options.schedule == "pipelined"
        # (width, mix, context, arm, declined) of the next step; declined: a
        # step of the policy arm that drafts nothing (a plain step).
        self._next_choice: tuple[int, int, int, str, bool] | None = None
        # The running step's choice and the arm of the step before it, with
        # its start; then the last step's, with its seconds.
        self._choice_step: tuple[int, int, int, str, bool, str | None, float] | None = None
        self._choice_timed: tuple[int, int, int, str, bool, str | None, float] | None = None
        # Async: a chosen step not observed (the first at a width, the
        # policy's warm-up), told to the chooser after the step before it
        # is observed (one step late there).
        self._unobserved: tuple[str, str] | None = None
        # The end of the running chosen step (its start, then its end), and
        # the last few gaps from a chosen step's end to the next start:
        # the seconds of a batch's last step (see _time_schedule_choice).
        self._choice_end: tuple[float, float] | None = None
        self._choice_gaps: deque = deque(maxlen=8)
        self._running_arm: str = UNCHOSEN  # the arm of the running step, if the chooser chose it
        self._choice_shapes: set[tuple[str, int]] = set()  # (arm, width) of timed steps
        self.step_drafts, self.step_arm = 0, None
        self._plain_arm_steps = 0  # "auto": steps of its plain arm
        # "auto": plain steps left on the chooser's hold (ScheduleChoice.hold),
        # the width it was chosen for, the held steps not yet credited to the
        # chooser, and whether the next step is one of them.
        self._hold_left = self._hold_width = self._held_steps = 0
        self._next_held = False
        # The starts of the first and last held steps that ran, and how many ran.
        self._held_first = self._held_last = 0.0
        self._held_started = 0
        self.proposed_drafts = True  # whether the last (synchronous) proposal drafted anything

    # -- vLLM's proposer interface -------------------------------------------
    def load_model(self, model) -> None:
        """The draft model is the served model itself: its loops ``[0, d)``."""
        from vllm_loopspec.models.ouro import kv_layer_name

        self.model = model
        self.draft_loops = self.options.draft_loops
        # The next round's draft depth: any d in [1, R) is exact in any step
        # (a round writes every loop's KV of each token it keeps: loops
        # [0, d) in its shallow ticks, [d, R) in its deep pass; nothing of d
        # outlives the step). The engine's draft_loops unless set.
        self.round_draft_loops = self.draft_loops
        self.num_loops = model.num_loops
        n = model.config.num_hidden_layers
        self._shallow_names = {d: [kv_layer_name(u, i, n) for u in range(d) for i in range(n)]
                               for d in range(1, self.num_loops)}

    def shallow_names(self, d: int) -> list[str]:
        """The attention layers of loops ``[0, d)``: a round's shallow ticks."""
        return self._shallow_names[d]

    def warm_up(self, num_tokens: int) -> None:
        """Compile the model's tick (:class:`~vllm_loopspec.models.ouro.OuroTick`)
        at startup, as vLLM compiles ``forward`` in its profile run (no
        attention metadata: attention writes and reads nothing), so that the
        first round does not compile, and compiles for a general row count
        (a first call with one row would specialise the graph to one row)."""
        from vllm.config import CompilationMode
        from vllm.forward_context import set_forward_context
        from vllm_loopspec.models.ouro import LoopGroup

        config = self.vllm_config
        if config.compilation_config.mode == CompilationMode.NONE:
            return
        device = self.runner.device
        hidden = torch.zeros((num_tokens, self.model.config.hidden_size),
                             dtype=config.model_config.dtype, device=device)
        positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        with set_forward_context(None, config, num_tokens=num_tokens):
            self.model.model.run_tick(hidden, positions, (LoopGroup(0, 0, num_tokens),))

    def warm_up_row_counts(self, max_rows: int, lm_head: bool = True) -> float:
        """Run one loop of the layer stack, and ``lm_head`` where this rank
        holds it, once over every row count ``1..max_rows`` at startup (no
        attention metadata, as :meth:`warm_up`); returns the seconds it took.

        On x86 CPUs vLLM's linear layers are oneDNN matmuls, and oneDNN
        builds (JIT-compiles) a kernel the first time it meets a row count:
        ~0.3-0.5 ms per weight shape, ~2 ms for a pass over the stack and
        ``lm_head`` of the bundled model. A plain step meets one row count per
        batch width; a round's or a pipelined step's passes meet many, so on
        a fresh engine the first speculative steps at a new width paid for
        them (a fresh engine's first pipelined step at width 17: median
        69.8 ms without this, 64.2 ms with it, over 8 runs each; findings,
        fifty-second session), and the adaptive policy measured those
        steps slower than they are.
        oneDNN keeps 1024 kernels for the whole process, one per (weight
        shape, row count): callers keep ``max_rows`` well under 1024 over
        the model's five weight shapes (:data:`WARM_ROW_COUNTS`)."""
        from vllm.forward_context import set_forward_context
        from vllm_loopspec.models.ouro import LoopGroup

        config, device = self.vllm_config, self.runner.device
        start = time.perf_counter()
        hidden = torch.zeros((max_rows, self.model.config.hidden_size),
                             dtype=config.model_config.dtype, device=device)
        positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        for n in range(1, max_rows + 1):
            with set_forward_context(None, config, num_tokens=n):
                self.model.model.run_tick(hidden[:n], positions[:n], (LoopGroup(0, 0, n),))
            if lm_head:
                self.model.compute_logits(hidden[:n])
        return time.perf_counter() - start

    def seed_costs(self, max_rows: int) -> None:
        """Seed each depth's adaptive policy with step costs from the model's
        own pieces, timed here at startup (:func:`~.policy.seeded_costs`):
        one loop of the layer stack and ``lm_head`` over 1, 2, 4, ... rows
        (up to ``max_rows`` and 64), without attention metadata, as
        :meth:`warm_up` runs the tick. The policy then decides as soon as
        acceptance is measured (its warm-up no longer waits for a cost
        fit); the engine's own step timings replace the seed once they
        cover enough shapes."""
        from vllm.distributed import get_pp_group
        from vllm.forward_context import set_forward_context
        from vllm_loopspec.models.ouro import LoopGroup

        if not self.controllers or not get_pp_group().is_last_rank:  # lm_head lives on the last stage
            return
        config, device = self.vllm_config, self.runner.device
        hidden_size, dtype = self.model.config.hidden_size, config.model_config.dtype
        rows = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max(max_rows, 1)]
        tick, logits = [], []
        for n in rows:
            hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
            positions = torch.zeros(n, dtype=torch.int64, device=device)
            with set_forward_context(None, config, num_tokens=n):
                tick.append(_median_seconds(
                    lambda: self.model.model.run_tick(hidden, positions, (LoopGroup(0, 0, n),)), device))
            logits.append(_median_seconds(lambda: self.model.compute_logits(hidden), device))
        features = np.column_stack([np.ones(len(rows)), rows])
        tick_fit = fit_linear(features, np.asarray(tick))
        logits_fit = fit_linear(features, np.asarray(logits))
        if tick_fit is None or logits_fit is None:  # a single row count: no slope
            tick_fit = np.array([tick[0], 0.0])
            logits_fit = np.array([logits[0], 0.0])
        for d, controller in self.controllers.items():
            controller.seed(seeded_costs(tuple(tick_fit), tuple(logits_fit), self.num_loops, d))
        logger.info("loopspec: step costs seeded at startup: a loop %.3f ms + %.4f ms per row, "
                    "lm_head %.3f ms + %.4f ms per row", *(1e3 * c for c in (*tick_fit, *logits_fit)))

    def bind(self, runner) -> None:
        """The runner whose batch this drafter speculates for (its input
        batch, requests and attention groups)."""
        self.runner = runner
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        self._tp_group = group if group.world_size > 1 else None

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]] | torch.Tensor:
        """Placeholder drafts for the next step, ``K_i`` per request."""
        if self.runner.use_async_scheduling:
            return self._propose_async()
        self._count_acceptance(sampled_token_ids)
        self._step_committed = sum(map(len, sampled_token_ids))
        if self.chooser is not None:
            self._step_rated, self._step_lag = self._step_committed, 0.0
            if self.step_drafts and self.step_arm is not None and arm_kind(self.step_arm) != PLAIN:
                self._step_lag = self._lag_added(self.step_arm, self.runner.input_batch.req_ids,
                                                 list(map(len, sampled_token_ids)))
        if self._take_held_step():
            self.proposed_drafts = False
            return [[]] * len(sampled_token_ids)
        # A row that sampled nothing is a partial prefill chunk.
        limits = self._next_limits(lambda row, req_id: row < len(sampled_token_ids) and bool(sampled_token_ids[row]))
        self.proposed_drafts = any(limits)
        return [[] if k is None else [PLACEHOLDER_TOKEN] * k for k in limits]

    def _propose_async(self) -> torch.Tensor:
        """Under vLLM's async scheduler the next step is already scheduled
        with the same number of placeholder drafts for every decoding row
        (vLLM scatters a device tensor of them into the step's input ids);
        the ``K_i`` decided here trim them when the step starts
        (:meth:`LoopSpecRunnerMixin.execute_model`). This step's committed
        tokens are not known on the host yet: limits assume every draft of
        this step is accepted (an upper bound on the length, so a limit is
        never too large), and acceptance is counted one step late."""
        self._count_committed(self._committed_prev)
        self._committed_prev, self._committed_now = self._committed_now, None
        runner = self.runner
        batch = runner.input_batch
        discard = runner.discard_request_mask.np
        computed = batch.num_computed_tokens_cpu
        scheduled = self._step_scheduled
        limits = self._next_limits(
            # Not a partial prefill chunk, and in this step.
            lambda row, req_id: not discard[row] and scheduled.get(req_id, 0) > 0,
            # Its length through this step with every draft accepted, plus the bonus token.
            lambda row, req_id: int(computed[row]) + scheduled[req_id] + 1)
        self.next_drafts = {req_id: k for req_id, k in zip(batch.req_ids, limits) if k}
        return torch.zeros((len(batch.req_ids), runner.num_spec_tokens), dtype=torch.int32, device=runner.device)

    def _next_limits(self, decoding, num_tokens=None) -> list[int | None]:
        """``K_i`` for the next step of every row of the batch: None for rows
        ``decoding(row, req_id)`` rejects, else the request's limit
        (:meth:`num_drafts`, at length ``num_tokens(row, req_id)`` when given)
        and, with the adaptive policy, its decision within it."""
        batch = self.runner.input_batch
        if self._take_held_step():
            return [None] * len(batch.req_ids)
        rows = [decoding(row, req_id) for row, req_id in enumerate(batch.req_ids)]
        sampled = None
        max_len = self.runner.model_config.max_model_len
        self._next_pipelined, self._next_choice = self.options.schedule == "pipelined", None
        if self.controller is not None:
            decoding_rows = [row for row, d in enumerate(rows) if d]
            # Every row decodes in most steps: a slice reads no index list.
            where = slice(0, len(rows)) if len(decoding_rows) == len(rows) else decoding_rows
            sampled = batch.temperature_cpu[where] > 0
            mix = sampling_mix(sampled)
            if self.chooser is not None and decoding_rows:
                reasons = self._reasons_none_may_draft(batch.req_ids[row] for row in decoding_rows)
                if reasons is not None:
                    # No row may draft (every request asks for logprobs,
                    # min_p, ...): a plain step that is no evidence about
                    # speculating at this batch's key, so the chooser
                    # neither decides nor measures it, and each row counts
                    # under its own reason (fresh-clone CI on 54982d2: a
                    # lone logprobs request's steps, observed as declined
                    # policy steps, taught the key plain).
                    self.stats.skipped.update(reasons)
                    return [0 if d else None for d in rows]
                if self._held_steps:
                    # The steps between the first and the last held start:
                    # plain steps of one width, one after another.
                    self.chooser.credit_held(self._held_steps, self._held_started - 1,
                                             self._held_last - self._held_first)
                    self._held_steps = self._held_started = 0
                context = int(batch.num_tokens_no_spec[where].sum()) // len(decoding_rows)
                # The step that just ran is observed when the next starts: the
                # chooser waits for it before measuring a long arm again.
                in_flight = self._choice_step[3] if self._choice_step is not None else None
                choice = self._choose_on_every_rank(len(decoding_rows), mix, context, in_flight)
                self._hold_left, self._hold_width = choice.hold, len(decoding_rows)
                kind = arm_kind(choice.arm)
                self._next_pipelined = kind == PIPELINED
                self._next_choice = (len(decoding_rows), mix, context, choice.arm, False)
                if kind != PLAIN:
                    self._next_depth = arm_depth(choice.arm, self.options.draft_loops)
                    self.controller = self.controllers[self._next_depth]
                if kind == PLAIN:
                    # Plain steps have delivered more here than speculation.
                    self.stats.skipped[SKIP_MEASURED] += len(decoding_rows)
                    return [0 if d else None for d in rows]
                if kind == PIPELINED:
                    # A pipelined step: every slot a request may have (its
                    # first proposals are verified inside the step).
                    return [self.num_drafts(row, req_id, max_len,
                                            None if num_tokens is None else num_tokens(row, req_id))
                            if rows[row] else None
                            for row, req_id in enumerate(batch.req_ids)]
            if self.controller.holds_plain(len(decoding_rows), mix):
                # Under the width cap: a plain step, with no per-request
                # limits and no policy work.
                self.stats.skipped[SKIP_WIDTH_CAP] += len(decoding_rows)
                self._policy_declined()
                return [0 if d else None for d in rows]
        limits: list[int | None] = [
            self.num_drafts(row, req_id, max_len, None if num_tokens is None else num_tokens(row, req_id))
            if rows[row] else None
            for row, req_id in enumerate(batch.req_ids)]
        if self.controller is None:
            return limits
        drafts = self._adapt(limits, sampled)
        if not any(drafts):
            self._policy_declined()
        return drafts

    def _choose_on_every_rank(self, width: int, mix: int, context: int, in_flight: str | None):
        """The chooser's choice for the next step; under tensor parallelism,
        TP rank 0's on every rank. Each rank times its own steps, so ranks'
        choosers may rate arms differently, and ranks that ran different arms
        (a round against a pipelined step, another depth, a hold of another
        length) would run different collectives: the step would hang or
        compute garbage. The drafts' count per request is already rank 0's
        (vLLM's scheduler takes the driver's proposal)."""
        group = self._tp_group
        if group is None:
            return self.chooser.choose(width, mix, context, in_flight)
        choice = self.chooser.choose(width, mix, context, in_flight) if group.rank_in_group == 0 else None
        return group.broadcast_object(choice, src=0)

    def _policy_declined(self) -> None:
        """The policy arm's step drafts nothing: it is a plain step, and the
        chooser sees it as a sample of both arms (:meth:`ScheduleChooser.observe`)."""
        if self._next_choice is not None and arm_kind(self._next_choice[3]) == POLICY:
            self._next_choice = (*self._next_choice[:4], True)

    def _take_held_step(self) -> bool:
        """Whether the next step is one of the chooser's held plain steps:
        its plain verdict holds for this unchanged batch (the runner ends the
        hold when the batch changes), so no decision is made."""
        if not self._hold_left:
            return False
        self._hold_left -= 1
        self._held_steps += 1
        self._next_pipelined, self._next_choice, self._next_held = False, None, True
        self.stats.skipped[SKIP_MEASURED] += self._hold_width
        return True

    def note_committed(self, counts: torch.Tensor) -> None:
        """Async: tokens each row of this step committed (accepted drafts +
        1; 0 for a partial prefill chunk), still on the device."""
        batch = self.runner.input_batch
        rows = counts.shape[0]
        self._committed_now = _Committed(
            counts=counts, num_drafts=self._last_num_drafts, req_ids=list(batch.req_ids[:rows]),
            sampled=[bool(t > 0) for t in batch.temperature_cpu[:rows]], controller=self._round_controller)
        self._last_num_drafts = None

    def _count_committed(self, committed: "_Committed | None") -> None:
        counts = committed.counts.tolist() if committed is not None else None
        if committed is not None and self._choice_timed is not None:
            # Async: the step timed when the next one started committed these.
            width, mix, context, arm, declined, after, seconds = self._choice_timed
            lag = self._lag_added(PLAIN if declined else arm, committed.req_ids, counts)
            self.chooser.observe(width, mix, arm, sum(counts), seconds, context, after=after, declined=declined,
                                 lag=lag)
            self._choice_timed = None
        if self._unobserved is not None:  # the step after the one just observed
            self.chooser.skip(*self._unobserved)
            self._unobserved = None
        if committed is None or committed.num_drafts is None:
            return
        for row, k in enumerate(committed.num_drafts):
            if k and row < len(counts):
                self._count_row(committed.req_ids[row], committed.sampled[row], int(k), max(counts[row] - 1, 0),
                                committed.controller)

    def _lag_added(self, arm: str | None, req_ids: list[str], counts: list[int]) -> float:
        """Tokens of lag a step of ``arm`` added to its batch, for the
        chooser to charge (:mod:`.batch_drain`; rows that committed
        nothing, partial prefill chunks, are left out). None from plain
        steps, whose rows keep pace, nor from a step of another arm that
        drafted nothing (the policy's plain decision): the caller passes
        PLAIN for it, or (synchronous steps) does not call."""
        if arm is None or arm_kind(arm) == PLAIN:
            return 0.0
        rows = [(req_id, n) for req_id, n in zip(req_ids, counts) if n]  # zip: req_ids may run longer
        # Async: a request that finished since is gone (none left).
        return lag_growth([n for _, n in rows],
                          [self._remaining(r) if r in self.runner.requests else 0 for r, _ in rows])

    def _adapt(self, limits: list[int | None], sampled: np.ndarray) -> list[int | None]:
        """The adaptive policy's ``K_i`` within each request's limit;
        ``sampled``: per decoding row (in order), whether it samples."""
        batch = self.runner.input_batch
        decoding = [row for row, k in enumerate(limits) if k is not None]
        requests = [(batch.req_ids[row], bool(s), limits[row]) for row, s in zip(decoding, sampled)]
        context = int(batch.num_tokens_no_spec[: len(limits)].sum())
        remaining = [self._remaining(req_id) for req_id, _, _ in requests] if len(requests) > 1 else None
        drafts, skipped = self.controller.plan(requests, context=context, remaining=remaining)
        self.stats.skipped.update(skipped)
        self.controller.forget(batch.req_ids)
        out = list(limits)
        for row, k in zip(decoding, drafts):
            out[row] = k
        return out

    def _remaining(self, req_id: str) -> int:
        """Tokens request ``req_id`` may still commit (its ``max_tokens``,
        else the context limit; a stop string or EOS may end it sooner)."""
        state = self.runner.requests[req_id]
        max_len = self.runner.model_config.max_model_len
        room_context = max_len - len(state.prompt_token_ids or ()) - len(state.output_token_ids)
        params = state.sampling_params
        if params is None or not params.max_tokens:
            return max(room_context, 1)
        return max(min(params.max_tokens - len(state.output_token_ids), room_context), 1)

    # -- per-request K ---------------------------------------------------------
    def num_drafts(self, row: int, req_id: str, max_len: int, num_tokens: int | None = None) -> int:
        """Drafts request ``req_id`` may make next step; ``num_tokens``: its
        length (default: what the input batch holds, exact when scheduling is
        synchronous)."""
        state = self.runner.requests[req_id]
        params = state.sampling_params
        if params is None:
            return 0
        reason = self._never_drafts(params)
        if reason is not None:
            self.stats.skipped[reason] += 1
            return 0
        if num_tokens is None:
            num_tokens = int(self.runner.input_batch.num_tokens_no_spec[row])
            num_output = len(state.output_token_ids)
        else:
            num_output = num_tokens - len(state.prompt_token_ids or ())
        room_output = (params.max_tokens or max_len) - num_output - 1
        if room_output < 0:
            return 0  # finished this step
        room_context = max_len - num_tokens - 1
        k = min(self.options.draft_slots, room_output, room_context)
        if k <= 0:
            self.stats.skipped[SKIP_BUDGET] += 1
            return 0
        return k

    def _never_drafts(self, params) -> str | None:
        """Why a request with sampling ``params`` decodes plainly in every
        step (what it asks the rejection sampler cannot verify), else None."""
        if params.logprobs is not None and self.options.skip_logprobs_requests:
            return SKIP_LOGPROBS
        if getattr(params, "structured_outputs", None) is not None:
            return SKIP_STRUCTURED
        if params.min_p > _SAMPLING_EPS:
            return SKIP_MIN_P
        if params.logit_bias:
            return SKIP_LOGIT_BIAS
        return None

    def _reasons_none_may_draft(self, req_ids) -> list[str] | None:
        """Each request's reason when none of ``req_ids`` may ever draft
        (:meth:`_never_drafts`), else None (stops at the first that may)."""
        requests, reasons = self.runner.requests, []
        for req_id in req_ids:
            params = requests[req_id].sampling_params
            reason = self._never_drafts(params) if params is not None else None
            if reason is None:
                return None
            reasons.append(reason)
        return reasons

    def runs_plain_instead(self, scheduler_output) -> bool:
        """``"auto"``: whether a speculative step (a pipelined one or the
        policy's round) runs plain instead, because requests its choice did
        not count (new requests, prefill chunks) share it: their first
        tokens would wait for every tick of the speculation (at a burst's
        arrival, the lone greedy request's 40 ms pipelined step or 25 ms
        K=16 round on top of the 50 ms prefill of 16 prompts), and the arm
        was chosen for a batch without them. The runner then drops the
        step's drafts."""
        choice = self._next_choice
        # Not under async scheduling: there the step was scheduled before
        # the choice was made, and its rows do not show arrivals this way.
        if (self.chooser is None or choice is None or arm_kind(choice[3]) == PLAIN
                or self.runner.use_async_scheduling):
            return False
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not scheduler_output.scheduled_new_reqs and _decode_only(scheduler_output):
            return False  # decode rows only (a batch that only narrowed keeps its arm)
        self._next_pipelined = False
        self.stats.skipped[SKIP_ARRIVALS] += len(spec)
        return True

    # -- step timing (the adaptive policy's cost model) -----------------------
    def step_started(self, scheduler_output) -> None:
        now = time.perf_counter()
        if self.model is not None and self.model.precomputed_logits is not None:
            self.model.precomputed_logits = None  # never a step's precomputed logits in the next step
        tokens = scheduler_output.total_num_scheduled_tokens
        self._step_scheduled = scheduler_output.num_scheduled_tokens
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        self._step_pipelined = self._next_pipelined
        self.round_draft_loops = self._next_depth
        # What the step runs, for traces and benchmarks: its largest K_i and,
        # with "auto", the arm it was chosen for (None: not a chosen decode step).
        self.step_drafts = max(map(len, spec_tokens.values())) if spec_tokens else 0
        self.step_arm = self._next_choice[3] if self._next_choice is not None else PLAIN if self._next_held else None
        if self.chooser is not None:
            self._time_schedule_choice(now, scheduler_output)
        if self.step_arm == PLAIN:
            self._plain_arm_steps += 1
        if (self.controller is None or not tokens or self._step_pipelined
                or (not self.controller.armed and not spec_tokens and self.controller.step % TIME_UNDER_CAP_EVERY)
                or (self.step_arm == PLAIN and self._plain_arm_steps % TIME_UNDER_CAP_EVERY)):
            # Under the width cap (and in the "auto" chooser's plain steps)
            # most plain steps go untimed: their cost is known, and timing
            # is a share of a narrow step's host work.
            self._step_shape = self._step_end = None
            return
        drafts = [len(t) for t in spec_tokens.values()]
        self._step_shape = (max(drafts, default=0), sum(1 for k in drafts if k), tokens)
        cached = scheduler_output.scheduled_cached_reqs
        self._step_context = (sum(cached.num_computed_tokens) + tokens
                              + sum(r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs))
        scheduled = self._step_scheduled
        decode_only = _decode_only(scheduler_output)
        self._step_width = len(scheduled) if decode_only else None
        self._step_committed = self._step_rated = None
        if self._step_end is not None:
            busy = not scheduler_output.scheduled_new_reqs  # else the engine may have idled
            self.controller.observe_gap(now - self._step_end if busy else None)
        self._step_start = now
        # The policy of the step's depth: by step_finished, propose may have
        # chosen the next step's (another depth's).
        self._step_controller = self.controller

    def _time_schedule_choice(self, now: float, scheduler_output) -> None:
        """``"auto"``: the last decode step's seconds, start to this start
        (its rate is observed with its committed tokens: known now when
        scheduling is synchronous, one step later under async; a batch's
        last step, start to its end plus the recent gaps between steps), and
        the running step's choice if it is the decode step it was chosen for."""
        last, self._choice_step, self._choice_timed = self._choice_step, None, None
        end, self._choice_end = self._choice_end, None
        if last is not None:
            width, mix, context, arm, declined, after, start = last
            seconds = now - start
            if self.runner.use_async_scheduling:
                if not scheduler_output.scheduled_new_reqs:  # else the engine may have idled
                    self._choice_timed = (width, mix, context, arm, declined, after, seconds)
            elif self._step_rated is not None:
                ended = end[1] if end is not None and end[0] == start else None
                if not scheduler_output.scheduled_new_reqs:
                    if ended is not None:
                        self._choice_gaps.append(now - ended)
                elif ended is not None:
                    # A batch's last step (or the last before arrivals): the
                    # engine may have idled since it ended, so it is timed to
                    # its end, plus the recent gaps between steps. Untimed, it
                    # was no sample: a pipelined step cut short by max_tokens
                    # (width 8, T=0.8, d2: 8 tokens a request in 22-23 ms,
                    # native's steps for the same tokens 17-18 ms:
                    # probes/pipelined_trial_steps.py) never counted against
                    # its arm where batches end (findings, fifty-third session).
                    seconds = ended - start + (float(np.median(self._choice_gaps)) if self._choice_gaps else 0.0)
                else:
                    seconds = 0.0  # the engine may have idled: no sample
                if seconds > 0:
                    self.chooser.observe(width, mix, arm, self._step_rated, seconds, context, after=after,
                                         declined=declined, lag=self._step_lag)
        choice, self._next_choice = self._next_choice, None
        held, self._next_held = self._next_held, False
        after, self._running_arm = self._running_arm, PLAIN if held else UNCHOSEN
        if held and not scheduler_output.scheduled_new_reqs:
            # A step with new requests ends the timed span at the last held
            # start: the engine may have idled before it (a batch that
            # finished inside a hold leaves the hold set until the next
            # batch's first step, which would time the idle gap as plain
            # steps, at the context bucket where batches end).
            if not self._held_started:
                self._held_first = now
            self._held_last = now
            self._held_started += 1
        scheduled = scheduler_output.num_scheduled_tokens
        if self._hold_left and (len(scheduled) != self._hold_width
                                or scheduler_output.total_num_scheduled_tokens != self._hold_width):
            # The batch changed (a request finished or joined, a prefill
            # chunk, a preemption): the step after this one is chosen.
            self._hold_left = 0
        if (choice is None or len(scheduled) != choice[0]
                or not _decode_only(scheduler_output)):
            return
        # Only steps that represent their arm: not an arm's first step at a
        # width (it may pay one-off work), not the policy's warm-up (it
        # cycles K, the largest included, to fit its cost model). Not the
        # first of each draft count and token count, as before: the
        # policy's rounds vary both, so most of its steps were dropped and
        # its measuring ran on (68 policy steps at width 8 in
        # benchmarks/probes/auto_trace.py), while a first round of a new K
        # took what later ones take (84 against 77-79 ms at K=16), and a
        # rate is a median, which one slow step barely moves.
        arm = self._running_arm = choice[3]
        shape = (arm, len(scheduled))
        first = shape not in self._choice_shapes
        warming_up = arm_kind(arm) == POLICY and self.controller.warming_up(choice[1])
        self._choice_shapes.add(shape)
        if not first and not warming_up:
            self._choice_step = (*choice, after, now)
        elif self.runner.use_async_scheduling:
            self._unobserved = (arm, after)
        else:
            # No sample, but a step of its arm: the chooser counts it in the
            # run its next steps settle in. Uncounted, the next step of the
            # arm looked settled however soon after a switch it came: at
            # short T=0.8 c8, d2, an engine's first plain steps at width 8,
            # right after pipelined ones, rated plain from the five after
            # the first (2.6-2.9 ms; settled plain steps 2.0-2.15 ms in that
            # run), and a pipeline that delivers no more than plain steps
            # won the key on them for the rest of the run
            # (benchmarks/results/findings.md, fifty-third session).
            self.chooser.skip(arm, after)

    def step_finished(self) -> None:
        if self._choice_step is not None:
            self._choice_end = (self._choice_step[-1], time.perf_counter())
        if self._step_shape is None:
            return
        self._step_end = time.perf_counter()
        mix = self._sampling_mix() if self._step_width else 0  # only decode-only steps feed the correction
        self._step_controller.observe_step(*self._step_shape, self._step_end - self._step_start,
                                     width=self._step_width, committed=self._step_committed,
                                     context=self._step_context, mix=mix)
        self._step_shape = None

    def _sampling_mix(self) -> int:
        requests = self.runner.requests
        return sampling_mix([bool(requests[r].sampling_params and requests[r].sampling_params.temperature > 0)
                             for r in self._step_scheduled if r in requests])

    def _count_acceptance(self, sampled_token_ids) -> None:
        """Per-engine acceptance per draft position (vLLM's own counters are
        per front end and do not count drafts per position), and per request
        for the adaptive policy."""
        num_drafts, self._last_num_drafts = self._last_num_drafts, None
        if num_drafts is None:
            return
        batch = self.runner.input_batch
        for row, k in enumerate(num_drafts):
            if k and row < len(sampled_token_ids):
                self._count_row(batch.req_ids[row], bool(batch.temperature_cpu[row] > 0), int(k),
                                max(len(sampled_token_ids[row]) - 1, 0), self._round_controller)

    def _count_row(self, req_id: str, sampled: bool, num_drafts: int, accepted: int,
                   controller: AdaptiveController | None) -> None:
        """``controller``: the policy of the depth the round drafted at."""
        self.stats.count_acceptance(num_drafts, accepted)
        if controller is not None:
            controller.observe_round(req_id, sampled, num_drafts, accepted)

    # -- the round -------------------------------------------------------------
    def run_step(self, input_ids: torch.Tensor, positions: torch.Tensor, spec_metadata, common) -> torch.Tensor:
        """The model forward of a step with drafts: returns loop-``R`` exit
        states of every scheduled token, with the drafts handed to vLLM."""
        if self._step_pipelined:
            return self.run_pipelined_step(self.layout(spec_metadata, common), input_ids, positions,
                                           spec_metadata, common)
        plan = self.plan(spec_metadata, common)
        chooser = self.make_chooser(plan)
        output = self.execute(plan, chooser, input_ids, positions)
        self.hand_off(plan, output, chooser, spec_metadata)
        self._count_round(plan)
        return output.hidden_states

    def plan(self, spec_metadata, common) -> RoundPlan:
        return build_plan(self.layout(spec_metadata, common), common, self.runner.attn_groups[0][0],
                          self.runner.device, self.row_buckets)

    def layout(self, spec_metadata, common) -> StepLayout:
        """Where the step's rows and drafts sit in its flat batch."""
        runner = self.runner
        num_drafts = np.asarray(spec_metadata.num_draft_tokens, dtype=np.int64)
        num_reqs = num_drafts.shape[0]  # not common.num_reqs: that one may be padded
        query_start = common.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
        if runner.use_async_scheduling:
            # The host copy still assumes every draft of the last step was
            # accepted until after this forward; the device copy was corrected
            # before it (vLLM's async path). On a GPU this read waits for it.
            computed = runner.num_computed_tokens[:num_reqs].cpu().numpy().astype(np.int64)
        else:
            computed = runner.input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        return StepLayout(query_start=query_start, num_drafts=num_drafts, seq_lens=computed + np.diff(query_start))

    def make_chooser(self, plan: RoundPlan) -> "DraftChooser":
        runner = self.runner
        spec_rows = plan.layout.spec_rows
        pad = plan.num_spec_rows - len(spec_rows)
        rows = np.concatenate([spec_rows, np.full(pad, spec_rows[0], np.int64)])  # padding: greedy
        sampled = np.concatenate([runner.input_batch.temperature_cpu[spec_rows] > 0, np.zeros(pad, bool)])
        return DraftChooser(runner.input_batch.sampling_metadata, rows, sampled, plan.drafts_valid)

    def execute(self, plan: RoundPlan, chooser, input_ids, positions) -> RoundOutput:
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        d = self.round_draft_loops
        model = _ServedModel(self.model, self.shallow_names(d), context, d, self.num_loops, self.stats)
        try:
            return run_round(plan, model, chooser, input_ids, positions)
        finally:
            model.restore()

    def hand_off(self, plan: RoundPlan, output: RoundOutput, chooser: "DraftChooser", spec_metadata) -> None:
        """Put the drafts where vLLM's rejection sampler reads them: the flat
        ``draft_token_ids`` of the step's ``SpecDecodeMetadata``, the
        sampling metadata's ``spec_token_ids`` (penalties and bad words read
        them; only then are they copied to the host), and the draft
        distribution ``q`` the runner gives the sampler when sampling."""
        runner = self.runner
        flat = output.drafts.reshape(-1)[plan.draft_gather]
        spec_metadata.draft_token_ids.copy_(flat.to(spec_metadata.draft_token_ids.dtype))
        if self._drafts_read_by_sampling():
            per_row = output.drafts.T.tolist()
            self._set_spec_token_ids(plan.layout, lambda s, k: per_row[s][:k])
        if chooser.q is not None:
            runner._draft_probs = chooser.q
            runner._draft_prob_req_ids = [runner.input_batch.req_ids[r] for r in plan.layout.spec_rows]

    def _drafts_read_by_sampling(self) -> bool:
        """Whether penalties or bad words will read the step's drafts from
        the sampling metadata's ``spec_token_ids`` (only then are they
        copied to the host)."""
        meta = self.runner.input_batch.sampling_metadata
        return meta.spec_token_ids is not None and bool(meta.bad_words_token_ids or not meta.no_penalties)

    def _set_spec_token_ids(self, layout: StepLayout, drafts_of) -> None:
        """``spec_token_ids`` of each speculating row: ``drafts_of(s, k)``,
        the ``k`` drafts of the ``s``-th speculating row."""
        meta = self.runner.input_batch.sampling_metadata
        for s, row in enumerate(layout.spec_rows):
            meta.spec_token_ids[row][:] = drafts_of(s, int(layout.num_drafts[row]))

    # -- the pipelined step (RFC §7) -------------------------------------------
    def run_pipelined_step(self, layout: StepLayout, input_ids, positions, spec_metadata, common) -> torch.Tensor:
        """The model forward of a pipelined step: every slot verified at
        depth ``R`` inside the step, the chain handed to vLLM as its drafts."""
        from vllm.forward_context import get_forward_context

        runner = self.runner
        attn_group, device, slot_mapping = runner.attn_groups[0][0], runner.device, common.slot_mapping

        # Built once per step for each set of tokens: every loop's KV plane
        # has the same blocks and slots, so the metadata of slot j's tokens
        # serves them at every loop they pass through, tick after tick.
        built: dict[tuple[Entry, ...], TickAttention] = {}

        def attention(entries: list[Entry], flat: list[int]) -> TickAttention:
            """One loop group's metadata (the runner's block tables and slots)."""
            key = tuple(entries)
            if key not in built:
                slots = slot_mapping[host_tensor(flat).to(device, non_blocking=True)]
                built[key] = tick_attention(common, attn_group, device, [e.count for e in entries],
                                            [e.seq_len for e in entries], [e.row for e in entries], slots)
            return built[key]

        from vllm_loopspec.models.ouro import MergedAttention

        planes = self.stacked_planes()
        if planes is not None:
            # Every loop's block tables and slots shifted to its plane once
            # per step ([loop, row, block] and [loop, token]): a pass then
            # gathers its rows' with one index each.
            offsets = torch.tensor(planes.block_offset, dtype=torch.int64)
            plane_tables = (common.block_table_tensor.unsqueeze(0)
                            + offsets.to(device, common.block_table_tensor.dtype)[:, None, None]
                            ).flatten(0, 1)  # [loop * rows + row, block]
            plane_slots = (slot_mapping.unsqueeze(0)
                           + (offsets * planes.block_size).to(device, slot_mapping.dtype)[:, None]
                           ).flatten()  # [loop * tokens + token]
            num_rows, num_tokens = common.block_table_tensor.shape[0], slot_mapping.shape[0]

        def merge(pass_: Pass) -> MergedAttention:
            """Every group of a pass under one metadata (one attention call
            per layer): each entry's blocks and slots on its loop's plane."""
            entries = pass_.entries
            rows = [e.row for e in entries]
            table_index = [u * num_rows + r for u, r in zip(pass_.entry_loops, rows)]
            slot_index = [u * num_tokens + i for u, i in zip(pass_.row_loops, pass_.flat)]
            block_table = plane_tables[host_tensor(table_index).to(device, non_blocking=True)]
            slots = plane_slots[host_tensor(slot_index).to(device, non_blocking=True)]
            tick = tick_attention(common, attn_group, device, [e.count for e in entries],
                                  [e.seq_len for e in entries], rows, slots, block_table=block_table)
            return MergedAttention(tick.metadata, tick.slot_mapping, planes.caches)

        d = self.round_draft_loops
        schedule = PipelineSchedule(layout, self.num_loops, d, self.options.second_proposal_loop_at(d))
        model = _PipelineServedModel(self.model, get_forward_context(), self.stats)
        decider = self._pipeline_decider(layout)
        verified = _VerifiedLogits(layout)
        try:
            output = run_pipelined(schedule, model, decider, attention, input_ids, positions,
                                   self.pipeline_override(layout), self.pipeline_observer(layout, positions),
                                   merge if planes is not None else None, verified)
        finally:
            model.restore()
        self.model.precomputed_logits = verified.precomputed(device)
        self.hand_off_chain(layout, output, spec_metadata)
        if isinstance(decider, SampledDecider):
            self._hand_off_targets(layout, output, decider)
        return output.hidden_states

    def _pipeline_decider(self, layout: StepLayout):
        batch = self.runner.input_batch
        sampled = {int(r): bool(batch.temperature_cpu[r] > 0) for r in layout.spec_rows}
        if not any(sampled.values()):
            return GreedyDecider()
        meta = batch.sampling_metadata
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        # Each row's temperature on the host, once per step (greedy rows: 1,
        # unused); a tick divides by one scalar where its rows share one.
        temperatures = {r: float(batch.temperature_cpu[r]) if sampled[r] else 1.0 for r in sampled}
        truncates = meta.top_k is not None or meta.top_p is not None

        def process(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
            """As vLLM's rejection sampler processes the target: temperature,
            top-k, top-p, softmax."""
            values = {temperatures[r] for r in rows}
            if len(values) == 1:
                scaled = logits.float() / values.pop()
            else:
                scaled = logits.float() / host_tensor([temperatures[r] for r in rows], np.float32).to(
                    logits.device, non_blocking=True).unsqueeze(-1)
            if truncates:
                index = host_tensor(rows).to(logits.device, non_blocking=True)
                scaled = apply_top_k_top_p(scaled, meta.top_k[index] if meta.top_k is not None else None,
                                           meta.top_p[index] if meta.top_p is not None else None)
            return scaled.softmax(dim=-1, dtype=torch.float32)

        generators = {r: meta.generators[r] for r in sampled if sampled[r] and r in meta.generators}
        return SampledDecider(process, sampled, generators)

    def _hand_off_targets(self, layout: StepLayout, output: PipelineOutput, decider: SampledDecider) -> None:
        """vLLM's draft probabilities for a pipelined chain: for a sampled
        row, the target distribution each draft was decided from (so vLLM's
        ``p/q`` is 1 and it keeps the chain, or, where a logits processor
        of its own changed ``p``, runs an exact speculative step against
        it); for a greedy row, a one-hot at its draft (ignored)."""
        runner = self.runner
        spec_rows = layout.spec_rows.tolist()
        vocab = next(iter(decider.target.values())).shape[-1] if decider.target else None
        if vocab is None:
            return
        probs = torch.zeros((len(spec_rows), layout.max_drafts, vocab), dtype=torch.float32, device=runner.device)
        offset = 0
        for s, row in enumerate(spec_rows):
            for j in range(int(layout.num_drafts[row])):
                target = decider.target.get((row, j))
                if target is None:
                    probs[s, j, output.drafts[offset + j]] = 1.0
                else:
                    probs[s, j] = target
            offset += int(layout.num_drafts[row])
        runner._draft_probs = probs
        runner._draft_prob_req_ids = [runner.input_batch.req_ids[r] for r in spec_rows]

    def stacked_planes(self) -> StackedPlanes | None:
        """Every loop plane of each layer as one KV view (one attention call
        per pass; :mod:`.planes`), found once the caches are bound; None where
        the layout does not allow it, off the CPU backend (its caches are
        blocks-first), with a KV connector (the merged call skips vLLM's
        per-layer connector hooks) or with ``VLLM_LOOPSPEC_MERGED_PLANES=0``."""
        if self._planes is None:
            self._planes = (self._find_stacked_planes(),)
        return self._planes[0]

    def _find_stacked_planes(self) -> StackedPlanes | None:
        import os

        from vllm.platforms import current_platform
        from vllm_loopspec.models.ouro import kv_layer_name

        if (not current_platform.is_cpu() or self.vllm_config.kv_transfer_config is not None
                or os.environ.get("VLLM_LOOPSPEC_MERGED_PLANES", "1") == "0"):
            return None
        layers = self.runner.compilation_config.static_forward_context
        n = self.model.config.num_hidden_layers
        names = [kv_layer_name(u, i, n) for u in range(self.num_loops) for i in range(n)]
        caches = {name: getattr(layers.get(name), "kv_cache", None) for name in names}
        block_size = self.runner.cache_config.block_size
        if any(not isinstance(c, torch.Tensor) or c.dim() != 4 or c.shape[2] != block_size for c in caches.values()):
            return None  # not the CPU backend's [blocks, kv_heads, block_size, 2 * head_size]
        return stack_loop_planes(caches, lambda u, i: kv_layer_name(u, i, n), n, self.num_loops, block_size)

    def pipeline_override(self, layout: StepLayout):
        """Test hook (:class:`~.debug.DebugLoopSpecDrafter`): a replacement
        for first proposals, ``(row, slot, token) -> token``."""
        return None

    def pipeline_observer(self, layout: StepLayout, positions):
        """Test hook (:class:`~.debug.DebugLoopSpecDrafter`): sees every pass."""
        return None

    def hand_off_chain(self, layout: StepLayout, output: PipelineOutput, spec_metadata) -> None:
        """The verified chain as the step's drafts (and, for penalties and
        bad words, the sampling metadata's ``spec_token_ids``); counts."""
        drafts = torch.tensor(output.drafts, dtype=spec_metadata.draft_token_ids.dtype)
        spec_metadata.draft_token_ids.copy_(drafts.to(spec_metadata.draft_token_ids.device))
        if self._drafts_read_by_sampling():
            ends = np.cumsum(layout.num_drafts[layout.spec_rows])
            self._set_spec_token_ids(layout, lambda s, k: output.drafts[ends[s] - k: ends[s]])
        # vLLM will see every draft accepted (the chain is verified): the
        # engine's acceptance counts first proposals that survived instead.
        self._last_num_drafts = None
        stats, counts = self.stats, output.counts
        num_drafts = layout.num_drafts[layout.spec_rows]
        stats.rounds += 1
        stats.pipelined_steps += 1
        stats.speculating_rows += len(num_drafts)
        stats.drafted_tokens += int(num_drafts.sum())
        stats.count_positions(num_drafts, counts.first_accepted)
        stats.pipelined_ticks += counts.ticks
        stats.pipelined_restarts += counts.restarts
        stats.pipelined_pruned += counts.pruned
        stats.pipelined_second_proposals += counts.refined
        stats.pipelined_second_kept += counts.second_accepted

    def _count_round(self, plan: RoundPlan) -> None:
        num_drafts = plan.layout.num_drafts
        self._last_num_drafts = num_drafts
        self._round_controller = self.controller
        self.stats.rounds += 1
        self.stats.speculating_rows += int((num_drafts > 0).sum())
        self.stats.drafted_tokens += int(num_drafts.sum())


@dataclass
class _Committed:
    """One async step's committed tokens per row and what the rows drafted."""

    counts: torch.Tensor  # [rows] on the device
    num_drafts: np.ndarray | None  # K_i per row (None: the step had no round)
    req_ids: list[str]
    sampled: list[bool]
    controller: AdaptiveController | None = None  # the policy of the depth the round drafted at


class _ServedModel:
    """The round's view of the served model inside the step's forward
    context: shallow ticks swap the shallow layers' attention to the tick's
    (restored afterwards); deep ticks use the runner's own metadata."""

    def __init__(self, model, shallow_layer_names, context, draft_loops, num_loops, stats) -> None:
        self.model = model
        self.names = shallow_layer_names
        self.context = context
        self.d = draft_loops
        self.loops = num_loops
        self.stats = stats
        self.saved = ({n: context.attn_metadata[n] for n in self.names},
                      {n: context.slot_mapping[n] for n in self.names})

    def restore(self) -> None:
        self.context.attn_metadata.update(self.saved[0])
        self.context.slot_mapping.update(self.saved[1])

    def embed(self, token_ids):
        return self.model.embed_input_ids(token_ids)

    def shallow(self, hidden, positions, tick: TickAttention):
        tick.activate(self.names, self.context)
        self.stats.count_loop_rows(range(0, self.d), hidden.shape[0] - tick.masked_rows, tick.masked_rows)
        return self.model.model.run_loops(hidden, positions, 0, self.d)

    def deep(self, shallow_states, positions):
        self.stats.count_loop_rows(range(self.d, self.loops), shallow_states.shape[0])
        return self.model.model.run_loops(shallow_states, positions, self.d, self.loops)

    def logits(self, hidden):
        return self.model.compute_logits(hidden)


class _VerifiedLogits:
    """The loop-``R`` logits a pipelined step computed to verify each slot's
    successor, kept in the runner's sample-row order (row ``r``'s ``K_r + 1``
    positions from ``offsets[r]``; a row without drafts has one). vLLM's
    sampler needs exactly these after the forward: handed over as
    :class:`~vllm_loopspec.models.ouro.PrecomputedLogits`, vLLM's
    ``lm_head`` then runs over the bonus positions and the rows without
    drafts only, not over ``K`` of every ``K + 1`` rows a second time (at
    width 8 on a CPU, where a pass is compute bound, ``lm_head`` is a
    quarter of a tick's matmul work)."""

    def __init__(self, layout: StepLayout) -> None:
        counts = layout.num_drafts + 1
        self.offsets = (np.cumsum(counts) - counts).tolist()
        self.filled = np.zeros(int(counts.sum()), dtype=bool)
        self.logits: torch.Tensor | None = None

    def __call__(self, slots: list[tuple[int, int]], logits: torch.Tensor) -> None:
        rows = [self.offsets[r] + j for r, j in slots]
        if self.logits is None:
            self.logits = logits.new_empty((self.filled.shape[0], logits.shape[-1]))
        self.logits[host_tensor(rows).to(logits.device, non_blocking=True)] = logits
        self.filled[rows] = True

    def precomputed(self, device) -> "PrecomputedLogits | None":
        from vllm_loopspec.models.ouro import PrecomputedLogits

        if self.logits is None:
            return None
        missing = torch.from_numpy(np.nonzero(~self.filled)[0]).to(device, non_blocking=True)
        return PrecomputedLogits(self.logits, missing)


class _PipelineServedModel:
    """The pipeline's view of the served model: each pass points every
    layer of each group's loop at that group's attention (restored after
    the step), then runs one mixed-loop tick."""

    def __init__(self, model, context, stats) -> None:
        from vllm_loopspec.models.ouro import kv_layer_name

        self.model = model
        self.context = context
        self.stats = stats
        n = model.config.num_hidden_layers
        self.names = [[kv_layer_name(u, i, n) for i in range(n)] for u in range(model.num_loops)]
        every = [name for names in self.names for name in names]
        self.saved = ({n: context.attn_metadata[n] for n in every}, {n: context.slot_mapping[n] for n in every})

    def restore(self) -> None:
        self.context.attn_metadata.update(self.saved[0])
        self.context.slot_mapping.update(self.saved[1])

    def embed(self, token_ids):
        return self.model.embed_input_ids(token_ids)

    def tick(self, hidden, positions, groups, merged=None):
        from vllm_loopspec.models.ouro import LoopGroup

        for loop, start, end, attention in groups:
            if attention is not None:
                attention.activate(self.names[loop], self.context)
            self.stats.count_loop_rows(range(loop, loop + 1), end - start)
        return self.model.model.run_tick(hidden, positions, [LoopGroup(u, s, e) for u, s, e, _ in groups], merged)

    def logits(self, hidden):
        return self.model.compute_logits(hidden)


class DraftChooser:
    """Picks each draft token from the shallow logits of every speculating
    row: greedy rows take the argmax; sampled rows sample the processed
    shallow distribution ``q`` (temperature, top-k, top-p: the processing
    vLLM's rejection sampler applies to the target), written into one
    ``[B_s, K_max, vocab]`` buffer for the sampler. Seeded requests draw
    from their own generator, and only for drafts they really make (masked
    and padding rows draw nothing). A seeded request therefore replays
    exactly under the same schedule; where vLLM's scheduler gives it a
    different number of drafts (its padding of one-token prefills, the token
    budget), its stream differs, as with any speculative method
    (``tests/test_request_fuzz.py``, strict xfail)."""

    def __init__(self, meta, spec_rows: np.ndarray, sampled: np.ndarray, drafts_valid: np.ndarray) -> None:
        self.q: torch.Tensor | None = None
        self.any_sampled = bool(sampled.any())
        if not self.any_sampled:
            return
        device = meta.temperature.device
        rows = torch.from_numpy(spec_rows).to(device)
        self.sampled = torch.from_numpy(sampled).to(device)
        self.temperature = torch.where(self.sampled, meta.temperature[rows].float(), 1.0)
        self.top_k = meta.top_k[rows] if meta.top_k is not None else None
        self.top_p = meta.top_p[rows] if meta.top_p is not None else None
        self.seeded = [(s, meta.generators[int(r)]) for s, r in enumerate(spec_rows)
                       if sampled[s] and int(r) in meta.generators]
        self.drafts_valid = drafts_valid
        self.k_max = drafts_valid.shape[0]

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if not self.any_sampled:
            return greedy
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        logits = logits.float() / self.temperature.unsqueeze(-1)
        q = apply_top_k_top_p(logits, self.top_k, self.top_p).softmax(dim=-1, dtype=torch.float32)
        # The exponential race: argmax q_i / E_i with E_i ~ Exp(1) is a draw
        # from q. E = -log U (U uniform) is the same distribution and, on CPU,
        # about 5x cheaper than Tensor.exponential_.
        uniform = torch.empty_like(q).uniform_()
        for s, generator in self.seeded:
            if self.drafts_valid[step, s]:
                uniform[s].uniform_(generator=generator)
        noise = uniform.clamp_min_(_TINY).log_().neg_()
        tokens = torch.where(self.sampled, (q / noise).argmax(dim=-1), greedy)
        if self.q is None:
            self.q = q.new_zeros((q.shape[0], self.k_max, q.shape[1]))
        # Greedy rows of a mixed batch: a one-hot q at their draft (the
        # sampler's greedy path ignores it; it only has to be well formed).
        one_hot = torch.zeros_like(q).scatter_(1, greedy.unsqueeze(1), 1.0)
        self.q[:, step] = torch.where(self.sampled.unsqueeze(1), q, one_hot)
        return tokens
