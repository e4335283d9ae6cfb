"""vLLM glue: the hooks of vLLM's V1 model runner that loopspec needs.

vLLM schedules, for each speculating request, ``[A, p_1..p_K]`` where the
``p_j`` are placeholders the drafter proposed after the previous step. The
runner keeps only what vLLM offers no other way into:

* ``_prepare_inputs`` and ``_build_attention_metadata``: remember the step's
  ``SpecDecodeMetadata`` and ``CommonAttentionMetadata``;
* ``_model_forward``: a step with drafts runs the drafter's round
  (:meth:`LoopSpecDrafter.run_step`) instead of the plain forward;
* ``_input_fits_in_drafter``: per-request limits are the drafter's business;
* ``take_draft_token_ids``: a proposal without drafts is not handed over;
* ``execute_model`` / ``sample_tokens``: time each step for the adaptive
  policy (:meth:`LoopSpecDrafter.step_started`), and run a step without
  drafts as a non-speculative runner would (``speculative_config`` set
  aside for the step);
* under async scheduling: ``execute_model`` trims vLLM's uniform
  placeholder drafts to each request's ``K_i``, ``_update_states`` keeps the
  scheduler's draft count, ``_bookkeeping_sync`` hands over each row's
  committed count and newest token, ``_copy_draft_token_ids_to_cpu`` keeps
  placeholders off the host (RFC §6).

A step in which no request drafts is vLLM's plain step: ``_prepare_inputs``
drops its (all-zero) ``SpecDecodeMetadata``, so the plain sampler runs
instead of the rejection sampler over zero drafts.

Everything else is vLLM's: the drafter is the ``custom_class`` proposer vLLM
builds and calls (``propose``), then logits at the spec positions, the
rejection sampler, rollback of rejected tokens, stop handling and
``spec_decode`` metrics.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from vllm_loopspec.patches import skip_accepted_counts_sync
from vllm_loopspec.speculative.metrics import SnapshotWriter

logger = init_logger("vllm.loopspec.runner")  # under vLLM's logger, which has the handlers


class LoopSpecRunnerMixin:
    """Mixed in before vLLM's V1 model runner (CPU or GPU)."""

    def _loopspec_setup(self) -> None:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        self.drafter.bind(self)
        # Every TP rank runs the same round; TP rank 0 of the last stage
        # (vLLM's output rank) counts it for its data-parallel replica
        # (data_parallel_index: vLLM resets data_parallel_rank to 0 in each
        # replica of a dense model, which runs as an independent engine).
        parallel = self.vllm_config.parallel_config
        self._loopspec_metrics = SnapshotWriter(
            self.drafter.stats.as_dict,
            replica=getattr(parallel, "data_parallel_index", parallel.data_parallel_rank),
            enabled=get_tensor_model_parallel_rank() == 0 and get_pp_group().is_last_rank,
        )
        self._loopspec_spec_metadata = None
        self._loopspec_common = None
        self._loopspec_config = self.speculative_config  # set aside for plain steps (_execute_plain_step)
        self._loopspec_plain_output = None  # a plain step's scheduler output, until sample_tokens
        skip_accepted_counts_sync(self)  # patch 16
        options = self.drafter.options
        logger.info("loopspec: draft loops %s, K %s%s, async scheduling %s", options.draft_loops,
                    options.num_speculative_tokens,
                    f" (adaptive, at most {options.max_speculative_tokens})" if options.adaptive else "",
                    "on" if self.use_async_scheduling else "off")

    def execute_model(self, scheduler_output, *args, **kwargs):
        if scheduler_output.scheduled_spec_decode_tokens:
            if self.drafter.runs_plain_instead(scheduler_output):
                scheduler_output = self._trim_to_chosen_drafts(scheduler_output, {}, not_drafted=True)
            elif self.use_async_scheduling:
                scheduler_output = self._trim_to_chosen_drafts(scheduler_output, self.drafter.next_drafts)
        self.drafter.step_started(scheduler_output)
        if scheduler_output.scheduled_spec_decode_tokens or self.use_async_scheduling:
            return super().execute_model(scheduler_output, *args, **kwargs)
        return self._execute_plain_step(scheduler_output, *args, **kwargs)

    # -- plain steps as a plain engine's -----------------------------------------
    # A step the scheduler gave no drafts (the width cap, the "auto"
    # chooser's plain verdict, a policy's plain decision, prefill) runs with
    # speculative_config set aside from execute_model to the end of
    # sample_tokens: every read of it in GPUModelRunner then takes the
    # non-speculative branch (_prepare_inputs, _build_attention_metadata's
    # use_spec_decode, _preprocess's placeholder clamp, sample_tokens' drafter
    # dispatch and copies, the KV connector's deferred finalize), so the step
    # costs nearer what a native engine's does: those branches were 15-20 us
    # of a 3 ms CPU step, of its 60-85 us excess over native's
    # (benchmarks/results/findings.md, twenty-fifth session). A step whose
    # drafts the runner cut (runs_plain_instead) takes this path too. The
    # drafter still decides the next step, from the step's output.
    def _execute_plain_step(self, scheduler_output, *args, **kwargs):
        self.speculative_config = None  # back from _loopspec_config when the step ends
        try:
            out = super().execute_model(scheduler_output, *args, **kwargs)
        except BaseException:
            self.speculative_config = self._loopspec_config
            raise
        if out is not None or self.execute_model_state is None:
            # Nothing left for sample_tokens (no tokens scheduled, or a
            # non-final pipeline stage): the step ends here.
            self.speculative_config = self._loopspec_config
            return out
        self._loopspec_plain_output = scheduler_output
        return out

    def _sample_plain_step(self, scheduler_output, *args, **kwargs):
        try:
            out = super().sample_tokens(*args, **kwargs)
        finally:
            self.speculative_config = self._loopspec_config
        # What GPUModelRunner.sample_tokens does for a custom_class drafter
        # after bookkeeping (propose_draft_token_ids, then the copy that
        # names the requests for take_draft_token_ids); a proposal without
        # drafts (the next step plain too: a hold, the width cap) names
        # none, so take_draft_token_ids hands nothing over.
        drafts = self.drafter.propose(out.sampled_token_ids)
        if self.drafter.proposed_drafts or self.use_async_scheduling:
            self._draft_token_ids = drafts
            self._copy_draft_token_ids_to_cpu(scheduler_output)
        else:
            self._draft_token_ids = self._draft_token_req_ids = None
        return out

    # -- async scheduling (patch 14) -------------------------------------------
    # vLLM's AsyncScheduler schedules step t+1 before step t's output is back:
    # every decoding row gets the same number of placeholder drafts, the
    # runner assumes them accepted and corrects num_computed_tokens on the
    # device from each row's committed count, which a drafter hands over
    # after sampling (EAGLE and ngram_gpu do it in vLLM). loopspec drafts
    # inside the step's forward, so the placeholders are all it needs; K_i
    # per request becomes a trim of each row's placeholders at the step's
    # start (as vLLM does for ngram_gpu), the trimmed slots counting as
    # rejected for the scheduler.
    def _trim_to_chosen_drafts(self, scheduler_output, chosen: dict[str, int], not_drafted: bool = False):
        """A copy of the step's schedule with each row's drafts cut to
        ``chosen[req_id]`` (async: the ``K_i`` the drafter chose after the
        previous step; ``{}``: a plain step, see
        :meth:`LoopSpecDrafter.runs_plain_instead`). The scheduler's own
        object keeps its drafts (in-process it is still the scheduler's, and
        ``Scheduler.update_from_output`` rolls the cut slots back as
        rejected); ``not_drafted``: the cut slots are also entered in its
        ``num_invalid_spec_tokens`` (the field through which vLLM leaves
        grammar-invalidated drafts out of its acceptance metrics), since no
        draft was made for them. vLLM's own trim
        (``update_scheduler_for_invalid_drafts``) serves ngram_gpu only: it
        edits in place, waits on a copy event and reads counts by row of a
        device tensor; here the counts are a host dict."""
        import dataclasses

        spec = dict(scheduler_output.scheduled_spec_decode_tokens)
        invalid = dict(scheduler_output.num_invalid_spec_tokens or {})
        scheduled = dict(scheduler_output.num_scheduled_tokens)
        total = scheduler_output.total_num_scheduled_tokens
        self._loopspec_scheduled_drafts = {req_id: len(t) for req_id, t in spec.items()}
        for req_id, tokens in list(spec.items()):
            keep = min(chosen.get(req_id, 0), len(tokens))
            cut = len(tokens) - keep
            if not cut:
                continue
            scheduled[req_id] -= cut
            total -= cut
            if not_drafted:
                invalid[req_id] = invalid.get(req_id, 0) + cut
            if keep:
                spec[req_id] = tokens[:keep]
            else:
                del spec[req_id]
        if not_drafted:
            scheduler_output.num_invalid_spec_tokens = invalid
        return dataclasses.replace(scheduler_output, scheduled_spec_decode_tokens=spec,
                                   num_scheduled_tokens=scheduled, total_num_scheduled_tokens=total)

    def _update_states(self, scheduler_output, *args, **kwargs):
        out = super()._update_states(scheduler_output, *args, **kwargs)
        if self.use_async_scheduling:
            # Keep the scheduler's draft count per request, as vLLM does after
            # trimming ngram_gpu's drafts: next step's correction of
            # num_computed_tokens starts from what the scheduler assumed.
            for req_id, count in getattr(self, "_loopspec_scheduled_drafts", {}).items():
                state = self.requests.get(req_id)
                if state is not None and state.prev_num_draft_len != count:
                    state.prev_num_draft_len = count
            self._loopspec_scheduled_drafts = {}
        return out

    def _bookkeeping_sync(self, scheduler_output, sampler_output, *args, **kwargs):
        if self.use_async_scheduling:
            rows = sampler_output.sampled_token_ids.shape[0]
            discard = torch.from_numpy(self.discard_request_mask.np[:rows].copy())
            counts, next_tokens = committed_per_row(sampler_output.sampled_token_ids,
                                                    discard.to(sampler_output.sampled_token_ids.device))
            self._copy_valid_sampled_token_count(next_tokens, counts)
            self.drafter.note_committed(counts)
        return super()._bookkeeping_sync(scheduler_output, sampler_output, *args, **kwargs)

    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only: bool = False) -> None:
        if not self.use_async_scheduling:
            return super()._copy_draft_token_ids_to_cpu(scheduler_output, zeros_only)
        # The proposal is placeholders: copied to the host, vLLM's sampler
        # would write them over the round's real drafts in spec_token_ids
        # (update_async_spec_token_ids), which penalties and bad words read.
        if torch.is_tensor(self._draft_token_ids):
            self.prev_num_spec_tokens = self._draft_token_ids.shape[1]
        self._draft_token_req_ids = None

    def take_draft_token_ids(self):
        if not self.use_async_scheduling and not self.drafter.proposed_drafts:
            # A proposal without drafts (a plain step next: the width cap, a
            # measured plain arm) has nothing to hand over: vLLM's
            # Scheduler.schedule already emptied the spec_token_ids of every
            # request it scheduled, and Scheduler.update_draft_token_ids
            # would only set them to [] again, request by request.
            return None
        return super().take_draft_token_ids()

    def sample_tokens(self, *args, **kwargs):
        plain, self._loopspec_plain_output = self._loopspec_plain_output, None
        if plain is not None:
            out = self._sample_plain_step(plain, *args, **kwargs)
        else:
            out = super().sample_tokens(*args, **kwargs)
        self.drafter.step_finished()
        return out

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        if self.speculative_config is None:  # a plain step (_execute_plain_step)
            self._loopspec_spec_metadata = None
            return super()._prepare_inputs(scheduler_output, *args, **kwargs)
        out = super()._prepare_inputs(scheduler_output, *args, **kwargs)
        spec_metadata = out[1]
        if spec_metadata is not None and sum(spec_metadata.num_draft_tokens) == 0:
            # vLLM builds spec metadata for every step of a speculative
            # engine; a step without drafts (logits at each request's last
            # token either way) takes the plain sampler's path.
            out = (out[0], None, *out[2:])
            spec_metadata = None
        self._loopspec_spec_metadata = spec_metadata
        return out

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, common = super()._build_attention_metadata(*args, **kwargs)
        if not kwargs.get("for_cudagraph_capture"):
            self._loopspec_common = common
        return attn_metadata, common

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        return common_attn_metadata is not None

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        spec_metadata = self._loopspec_spec_metadata
        if spec_metadata is None or input_ids is None or sum(spec_metadata.num_draft_tokens) == 0:
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)
        return self.drafter.run_step(input_ids, positions, spec_metadata, self._loopspec_common)

    def shutdown(self) -> None:
        self._loopspec_metrics.stop()
        super().shutdown()


def committed_per_row(sampled: torch.Tensor, discard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From a step's sampled ids ``[rows, 1 + K]`` (rejected slots ``-1``):
    tokens each row committed (0 for a discarded partial-prefill row) and its
    newest token (0 where none), on the device, without a host read."""
    counts = torch.where(discard, 0, (sampled != -1).sum(dim=1)).to(torch.int32)
    newest = sampled.gather(1, (counts.long() - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return counts, torch.where(counts > 0, newest, torch.zeros_like(newest))
