"""vLLM glue: a model runner that runs one loopspec round per engine step.

vLLM schedules, for each speculating request, ``[A, p_1..p_K]`` where the
``p_j`` are placeholders this runner proposed after the previous step. In
``_model_forward`` the round (``round.py``) replaces them with real drafts
made by the shallow loops, then the deep loops verify. Everything after the
forward is vLLM's: logits at the spec positions, the rejection sampler
(given our draft probabilities when sampling), rollback of rejected tokens,
stop handling and ``spec_decode`` metrics.
"""

from __future__ import annotations

import contextlib
import functools
import time

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_loopspec.spec.metrics import SnapshotWriter
from vllm_loopspec.spec.options import LoopSpecOptions
from vllm_loopspec.spec.patches import ADDITIONAL_CONFIG_KEY
from vllm_loopspec.spec.round import RoundLayout, run_round
from vllm_loopspec.spec.stats import LoopSpecStats

# Reasons a request decodes one token without drafting in a step.
SKIP_LOGPROBS = "logprobs"
SKIP_STRUCTURED = "structured_output"
SKIP_BUDGET = "token_budget"  # max_tokens or max_model_len leaves no room


class _StepPasses:
    """Shallow and deep passes of one step, with attention metadata for the
    subsets the round asks for (built from the step's block table and slot
    mapping, so drafted positions write the KV slots vLLM allocated)."""

    def __init__(self, runner: "LoopSpecRunnerMixin", cm: CommonAttentionMetadata,
                 row_of_token: np.ndarray, positions: torch.Tensor) -> None:
        self.runner = runner
        self.model = runner.model
        self.cm = cm
        self.row_of_token = row_of_token
        self.positions = positions
        self.positions_np = positions.cpu().numpy()
        self.anchor_positions: np.ndarray | None = None  # per row, set by the runner
        self.d = runner.loopspec.draft_loops
        self.loops = runner.model.num_loops
        self.q_rows: dict[tuple[int, int], torch.Tensor] = {}  # (row, step) -> q

    def shallow(self, token_index: np.ndarray, token_ids: torch.Tensor, phase: str) -> torch.Tensor:
        with self._timed(phase):
            return self._shallow(token_index, token_ids)

    def deep(self, shallow_states: torch.Tensor) -> torch.Tensor:
        with self._timed("verify"):
            return self._deep(shallow_states)

    def draft(self, rows: np.ndarray, step: int, shallow_states: torch.Tensor) -> torch.Tensor:
        with self._timed("draft_logits"):
            return self._draft(rows, step, shallow_states)

    @contextlib.contextmanager
    def _timed(self, phase: str):
        """Accumulate wall time per phase when a profile dict is attached."""
        profile = self.runner.loopspec_profile
        if profile is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            profile[phase] = profile.get(phase, 0.0) + time.perf_counter() - start

    def _shallow(self, token_index: np.ndarray, token_ids: torch.Tensor) -> torch.Tensor:
        rows, counts = np.unique(self.row_of_token[token_index], return_counts=True)
        last = np.cumsum(counts) - 1
        seq_lens = self.positions_np[token_index[last]] + 1
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        qsl[1:] = torch.from_numpy(np.cumsum(counts)).to(torch.int32)
        idx = torch.from_numpy(token_index).to(self.cm.slot_mapping.device)
        slots = self.cm.slot_mapping[idx]
        sub = CommonAttentionMetadata(
            query_start_loc=qsl.to(self.cm.query_start_loc.device),
            query_start_loc_cpu=qsl,
            seq_lens=torch.from_numpy(seq_lens).to(self.cm.seq_lens.dtype).to(self.cm.seq_lens.device),
            num_reqs=len(rows),
            num_actual_tokens=len(token_index),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=self.cm.block_table_tensor[torch.from_numpy(rows).to(self.cm.block_table_tensor.device)],
            slot_mapping=slots,
            causal=True,
        )
        metadata = self.runner.attn_groups[0][0].build_metadata(sub)
        names = self.runner.loopspec_layer_names
        with set_forward_context(
            {name: metadata for name in names},
            self.runner.vllm_config,
            num_tokens=len(token_index),
            slot_mapping={name: slots for name in names},
        ):
            h = self.model.embed_input_ids(token_ids)
            h = self.model.model.run_loops(h, self.positions[idx], 0, self.d)
        self.runner.loopspec_stats.count_loop_rows(range(0, self.d), len(token_index))
        return h

    def _deep(self, shallow_states: torch.Tensor) -> torch.Tensor:
        # Runs in the runner's own forward context: all scheduled tokens.
        self.runner.loopspec_stats.count_loop_rows(range(self.d, self.loops), shallow_states.shape[0])
        return self.model.model.run_loops(shallow_states, self.positions, self.d, self.loops)

    def _draft(self, rows: np.ndarray, step: int, shallow_states: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(shallow_states).float()
        tokens = logits.argmax(dim=-1)
        override = self.runner.loopspec_draft_override
        if override is not None:  # test hook: force acceptance or rejection
            req_ids = self.runner.input_batch.req_ids
            tokens = torch.tensor(
                [override(req_ids[r], step, int(t), int(self.anchor_positions[r]))
                 for r, t in zip(rows.tolist(), tokens)],
                dtype=tokens.dtype, device=tokens.device)
        meta = self.runner.input_batch.sampling_metadata
        if meta.all_greedy or meta.temperature is None:
            return tokens
        row_idx = torch.from_numpy(rows).to(logits.device)
        temperature = meta.temperature[row_idx].float()
        sampled = temperature > 0  # greedy rows carry a non-positive temperature
        if not bool(sampled.any()):
            return tokens
        which = sampled.nonzero().squeeze(-1)
        q = self._processed_probs(logits[which], temperature[which], row_idx[which], meta)
        noise = torch.empty_like(q).exponential_()
        for j, row in enumerate(row_idx[which].tolist()):
            gen = meta.generators.get(row)
            if gen is not None:  # seeded requests draw from their own stream
                noise[j].exponential_(generator=gen)
        tokens[which] = (q / noise).argmax(dim=-1)
        for k, row_q in zip(which.tolist(), q):
            self.q_rows[(int(rows[k]), step)] = row_q
        return tokens

    @staticmethod
    def _processed_probs(logits, temperature, rows, meta) -> torch.Tensor:
        """The draft distribution q with the requests' temperature, top-k and
        top-p — the same processing vLLM's rejection sampler applies to p."""
        logits = logits / temperature.unsqueeze(-1)
        top_k = meta.top_k[rows] if meta.top_k is not None else None
        top_p = meta.top_p[rows] if meta.top_p is not None else None
        logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1, dtype=torch.float32)


class LoopSpecRunnerMixin:
    """Mixed in before vLLM's V1 model runner (CPU or GPU)."""

    def _loopspec_setup(self) -> None:
        raw = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            raise RuntimeError("loopspec worker started without loopspec options; "
                               "use --speculative-config loopspec")
        self.loopspec = LoopSpecOptions.from_dict(raw)
        self.loopspec_stats = LoopSpecStats()
        self._loopspec_metrics = SnapshotWriter(self.loopspec_stats.as_dict)
        self._loopspec_sdm = None
        self._loopspec_cm = None
        # Test hooks (None in serving): replace greedy drafts
        # (``override(req_id, step, token, anchor_position) -> token``), and record
        # each round's positions, KV slots and tokens per request.
        self.loopspec_draft_override = None
        self.loopspec_trace: list[dict] | None = None
        # Profiling hook (benchmarks): phase -> accumulated seconds.
        self.loopspec_profile: dict[str, float] | None = None

    @functools.cached_property
    def loopspec_layer_names(self) -> list[str]:
        return [name for group in self.kv_cache_config.kv_cache_groups for name in group.layer_names]

    # -- capture what the step prepared -------------------------------------
    def _prepare_inputs(self, *args, **kwargs):
        out = super()._prepare_inputs(*args, **kwargs)
        self._loopspec_sdm = out[1]
        return out

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, common = super()._build_attention_metadata(*args, **kwargs)
        if not kwargs.get("for_cudagraph_capture"):
            self._loopspec_cm = common
        return attn_metadata, common

    # -- placeholders: make vLLM schedule the draft slots --------------------
    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        # Per-request limits are applied in propose_draft_token_ids.
        return common_attn_metadata is not None

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        self._draft_probs = None
        self._draft_prob_req_ids = None
        self._loopspec_count_acceptance(sampled_token_ids)
        max_len = self.model_config.max_model_len
        proposals: list[list[int]] = []
        for i, req_id in enumerate(self.input_batch.req_ids):
            if i >= len(sampled_token_ids) or not sampled_token_ids[i]:
                proposals.append([])  # partial prefill chunk: nothing sampled
                continue
            k = self._loopspec_num_drafts(i, req_id, max_len)
            proposals.append([0] * k)
        return proposals

    def _loopspec_count_acceptance(self, sampled_token_ids) -> None:
        """Per-engine acceptance per draft position (vLLM's own counters are
        per front end and do not count drafts per position)."""
        sdm = self._loopspec_sdm
        if sdm is None:
            return
        for row, num_drafts in enumerate(sdm.num_draft_tokens):
            if num_drafts and row < len(sampled_token_ids):
                accepted = max(len(sampled_token_ids[row]) - 1, 0)
                self.loopspec_stats.count_acceptance(num_drafts, accepted)

    def _loopspec_num_drafts(self, row: int, req_id: str, max_len: int) -> int:
        state = self.requests[req_id]
        params = state.sampling_params
        if params is None:
            return 0
        if params.logprobs is not None and self.loopspec.skip_logprobs_requests:
            self.loopspec_stats.skipped[SKIP_LOGPROBS] += 1
            return 0
        if getattr(params, "structured_outputs", None) is not None:
            self.loopspec_stats.skipped[SKIP_STRUCTURED] += 1
            return 0
        num_tokens = int(self.input_batch.num_tokens_no_spec[row])
        room_output = (params.max_tokens or max_len) - len(state.output_token_ids) - 1
        if room_output < 0:
            return 0  # finished this step
        room_context = max_len - num_tokens - 1
        k = min(self.loopspec.num_speculative_tokens, room_output, room_context)
        if k <= 0:
            self.loopspec_stats.skipped[SKIP_BUDGET] += 1
            return 0
        return k

    # -- the round ------------------------------------------------------------
    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        sdm = self._loopspec_sdm
        if sdm is None or input_ids is None or sum(sdm.num_draft_tokens) == 0:
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)
        cm = self._loopspec_cm
        num_reqs = cm.num_reqs
        query_start = cm.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
        num_drafts = np.asarray(sdm.num_draft_tokens, dtype=np.int64)
        layout = RoundLayout(query_start=query_start, num_drafts=num_drafts)
        n = layout.num_tokens
        row_of_token = np.repeat(np.arange(num_reqs), np.diff(query_start))
        passes = _StepPasses(self, cm, row_of_token, positions[:n])
        passes.anchor_positions = passes.positions_np[layout.anchor_index()]
        result = run_round(layout, input_ids[:n], passes)
        self._loopspec_publish_drafts(layout, result.draft_token_ids, passes, sdm)
        if self.loopspec_trace is not None:
            self._loopspec_record(layout, result.draft_token_ids, cm, positions)
        stats = self.loopspec_stats
        stats.rounds += 1
        stats.speculating_rows += int((num_drafts > 0).sum())
        stats.drafted_tokens += int(num_drafts.sum())
        return result.hidden_states

    def _loopspec_record(self, layout: RoundLayout, ids, cm, positions) -> None:
        rounds = {}
        for r in np.nonzero(layout.num_drafts > 0)[0]:
            a = int(layout.anchor_index()[r])
            span = slice(a, a + 1 + int(layout.num_drafts[r]))
            pos_a = int(positions[a])
            rounds[self.input_batch.req_ids[r]] = {
                "prefix": self.input_batch.token_ids_cpu[r, :pos_a].tolist(),
                "tokens": ids[span].tolist(),  # [A, c_1..c_K]
                "positions": positions[span].tolist(),
                "slots": cm.slot_mapping[span].tolist(),
            }
        self.loopspec_trace.append(rounds)

    def _loopspec_publish_drafts(self, layout: RoundLayout, ids: torch.Tensor,
                                 passes: _StepPasses, sdm) -> None:
        """Put the real drafts where vLLM's sampler and bookkeeping read them."""
        spec_rows = np.nonzero(layout.num_drafts > 0)[0]
        anchors = layout.anchor_index()
        flat = [ids[anchors[r] + 1 : anchors[r] + 1 + layout.num_drafts[r]] for r in spec_rows]
        drafts = torch.cat(flat).to(sdm.draft_token_ids.dtype)
        sdm.draft_token_ids.copy_(drafts.to(sdm.draft_token_ids.device))
        for r in spec_rows:
            # Penalties and logits processors read the spec tokens from here.
            start = anchors[r] + 1
            self.input_batch.spec_token_ids[r][:] = ids[start : start + layout.num_drafts[r]].tolist()
        if passes.q_rows:
            k_max = int(layout.num_drafts.max())
            vocab = next(iter(passes.q_rows.values())).shape[-1]
            probs = torch.zeros(layout.num_drafts.shape[0], k_max, vocab, dtype=torch.float32,
                                device=sdm.draft_token_ids.device)
            for (row, step), q in passes.q_rows.items():
                probs[row, step - 1] = q
            # Greedy rows in a mixed batch: one-hot at the draft (ignored by
            # the greedy path of the rejection sampler, but well-formed).
            for r in spec_rows:
                for step in range(1, layout.num_drafts[r] + 1):
                    if (r, step) not in passes.q_rows:
                        probs[r, step - 1, int(ids[anchors[r] + step])] = 1.0
            self._draft_probs = probs
            self._draft_prob_req_ids = list(self.input_batch.req_ids)


class LoopSpecCPUModelRunner(LoopSpecRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._loopspec_setup()


class LoopSpecCPUWorker(CPUWorker):
    """CPU worker whose model runner runs loopspec rounds (``--worker-cls``)."""

    def init_device(self) -> None:
        # CPUWorker.init_device builds its runner by looking up the module
        # global ``CPUModelRunner``; point it at ours for that call only.
        import vllm.v1.worker.cpu_worker as cpu_worker

        original = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = LoopSpecCPUModelRunner
        try:
            super().init_device()
        finally:
            cpu_worker.CPUModelRunner = original


def _gpu_classes():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    class LoopSpecGPUModelRunner(LoopSpecRunnerMixin, GPUModelRunner):
        def __init__(self, vllm_config, device) -> None:
            super().__init__(vllm_config, device)
            self._loopspec_setup()

    class LoopSpecGPUWorker(Worker):
        """GPU worker whose model runner runs loopspec rounds."""

        def _make_model_runner(self):
            return LoopSpecGPUModelRunner(self.vllm_config, self.device)

    return LoopSpecGPUModelRunner, LoopSpecGPUWorker


LoopSpecGPUModelRunner, LoopSpecGPUWorker = _gpu_classes()
