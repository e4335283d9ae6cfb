"""Probe: vLLM 0.32's async scheduling on CPU, with native decoding, ngram_gpu or loopspec.

Findings and the reasoning: docs/async-scheduling.md. This is an experiment, not product
code: it forces async scheduling on with in-process patches (the CPU platform turns it
off, vLLM refuses it for custom_class methods, the plugin refuses it for loopspec) and,
for loopspec, applies the prototype runner/drafter overrides the doc describes.

    python benchmarks/probes/async_cpu_probe.py loopspec --k 4 --stress
    python benchmarks/probes/async_cpu_probe.py native
    python benchmarks/probes/async_cpu_probe.py ngram_gpu --k 3

Runs two engines one after the other, each in its own process and in-process mode
(VLLM_ENABLE_V1_MULTIPROCESSING=0): native decoding with synchronous scheduling, then
MODE with async scheduling; compares their greedy outputs and prints which async pieces
of vLLM's runner ran. Exit status 0 when the outputs are equal.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "ouro-stdlib")
PROMPTS = ["import os\nimport sys\n\ndef main(", "def read(path):\n    with open(path) as f:\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n",
           "for i in range(10):\n    for j in range(10):\n        print(i, j)\nfor i in range(10):\n"]


def force_async_scheduling() -> None:
    """Validate every VllmConfig with async scheduling off, then switch it on. Wraps
    ``__post_init__``, which runs in the front end and again in the engine core
    (v1/engine/core.py:1311), so neither vLLM's method check (config/vllm.py:1553-1571)
    nor the CPU platform (platforms/cpu.py:331) keeps it off."""
    from vllm.config.vllm import VllmConfig

    original = VllmConfig.__post_init__

    def post_init(self, *args, **kwargs):
        self.scheduler_config.async_scheduling = False
        original(self, *args, **kwargs)
        self.scheduler_config.async_scheduling = True

    VllmConfig.__post_init__ = post_init


def allow_literal_pinned_buffers() -> None:
    """ngram_gpu's runner buffers ask for pin_memory=True literally
    (v1/worker/gpu_model_runner.py:628-632); a CPU-only torch refuses."""
    import torch

    zeros = torch.zeros

    def cpu_zeros(*args, **kwargs):
        if kwargs.get("pin_memory") and not torch.cuda.is_available():
            kwargs["pin_memory"] = False
        return zeros(*args, **kwargs)

    torch.zeros = cpu_zeros


def loopspec_async_prototype() -> None:
    """The loopspec side of async rounds (docs/async-scheduling.md, "Prototype")."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_loopspec.speculative import drafter as ld
    from vllm_loopspec.speculative import runner as lr
    from vllm_loopspec.speculative.plan import StepLayout, build_plan

    mixin = lr.LoopSpecRunnerMixin

    def _bookkeeping_sync(self, scheduler_output, sampler_output, *args, **kwargs):
        # Hand vLLM the per-row next token and valid count on device before its bookkeeping,
        # as EAGLE and ngram_gpu do (GPUModelRunner._copy_valid_sampled_token_count).
        if self.use_async_scheduling:
            sampled = sampler_output.sampled_token_ids  # [rows, 1 + K], -1 = rejected
            rows = sampled.shape[0]
            discard = torch.from_numpy(self.discard_request_mask.np[:rows].copy()).to(sampled.device)
            counts = torch.where(discard, 0, (sampled != -1).sum(1)).to(torch.int32)
            last = sampled.gather(1, (counts.long() - 1).clamp(min=0)[:, None]).squeeze(1)
            self._copy_valid_sampled_token_count(torch.where(counts > 0, last, torch.zeros_like(last)), counts)
        return GPUModelRunner._bookkeeping_sync(self, scheduler_output, sampler_output, *args, **kwargs)

    def propose_draft_token_ids(self, *args, **kwargs):
        out = GPUModelRunner.propose_draft_token_ids(self, *args, **kwargs)
        if not self.use_async_scheduling:
            return out
        # _prepare_input_ids scatters the previous proposal from a device tensor
        # [rows, K]; loopspec's are placeholders its round overwrites.
        return torch.zeros(len(self.input_batch.req_ids), self.num_spec_tokens, dtype=torch.int32,
                           device=self.device)

    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only=False):
        if not self.use_async_scheduling:
            return GPUModelRunner._copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only)
        # Without this, _sample writes the placeholders over the round's real drafts in
        # sampling_metadata.spec_token_ids (update_async_spec_token_ids): penalties break.
        if torch.is_tensor(self._draft_token_ids):
            self.prev_num_spec_tokens = self._draft_token_ids.shape[1]
        self._draft_token_req_ids = None

    def plan(self, spec_metadata, common):
        runner = self.runner
        if not runner.use_async_scheduling:
            return original_plan(self, spec_metadata, common)
        num_drafts = np.asarray(spec_metadata.num_draft_tokens, dtype=np.int64)
        num_reqs = num_drafts.shape[0]
        query_start = common.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
        # input_batch.num_computed_tokens_cpu is optimistic (every draft accepted) until
        # after the forward; the device copy is corrected before it (free on CPU).
        computed = runner.num_computed_tokens[:num_reqs].cpu().numpy().astype(np.int64)
        layout = StepLayout(query_start=query_start, num_drafts=num_drafts,
                            seq_lens=computed + np.diff(query_start))
        return build_plan(layout, common, runner.attn_groups[0][0], runner.device, self.row_buckets)

    original_plan = ld.LoopSpecDrafter.plan
    mixin._bookkeeping_sync = _bookkeeping_sync
    mixin.propose_draft_token_ids = propose_draft_token_ids
    mixin._copy_draft_token_ids_to_cpu = _copy_draft_token_ids_to_cpu
    ld.LoopSpecDrafter.plan = plan


def count_async_pieces(counts: collections.Counter) -> None:
    import vllm.v1.worker.gpu_model_runner as gmr

    def wrap(cls, name):
        original = getattr(cls, name)

        def counted(self, *args, **kwargs):
            counts[f"{cls.__name__}.{name}"] += 1
            return original(self, *args, **kwargs)

        setattr(cls, name, counted)

    wrap(gmr.AsyncGPUModelRunnerOutput, "__init__")
    wrap(gmr.AsyncGPUModelRunnerOutput, "get_output")
    wrap(gmr.GPUModelRunner, "_copy_valid_sampled_token_count")
    wrap(gmr.GPUModelRunner, "_get_valid_sampled_token_count")


def child(mode: str, scheduling: str, k: int, stress: bool, penalty: bool, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_loopspec import register

    register()
    counts: collections.Counter = collections.Counter()
    count_async_pieces(counts)
    if scheduling == "async":
        force_async_scheduling()
        if mode == "ngram_gpu":
            allow_literal_pinned_buffers()
        if mode == "loopspec":
            loopspec_async_prototype()
    from vllm import LLM, SamplingParams

    spec = None
    if mode in ("ngram", "ngram_gpu"):
        spec = {"method": mode, "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif mode == "loopspec":
        spec = {"method": "loopspec", "num_speculative_tokens": k, "adaptive": False}
    llm = LLM(CHECKPOINT, dtype="float32", max_model_len=512, max_num_batched_tokens=128, max_num_seqs=8,
              gpu_memory_utilization=0.5, enforce_eager=True, seed=0, num_gpu_blocks_override=64,
              disable_log_stats=False, speculative_config=spec)
    prompts, params = PROMPTS, [dict(max_tokens=48)] * len(PROMPTS)
    if stress:  # chunked prefills, requests of different lengths finishing at different steps
        prompts = [PROMPTS[i % 4] * (1 + (i % 3) * 6) + f"# {i}\n" for i in range(12)]
        params = [dict(max_tokens=3 + (i * 37) % 58) for i in range(12)]
    extra = dict(repetition_penalty=1.3, presence_penalty=0.5) if penalty else {}
    sps = [SamplingParams(temperature=0.0, ignore_eos=True, **p, **extra) for p in params]
    start = time.time()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    seconds = time.time() - start
    metrics = {m.name: m.value for m in llm.get_metrics() if "spec_decode_num" in m.name and hasattr(m, "value")}
    config = llm.llm_engine.vllm_config
    with open(out, "w") as f:
        json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
                   "async_scheduling": config.scheduler_config.async_scheduling,
                   "counts": dict(counts), "spec_metrics": metrics}, f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="loopspec", choices=["native", "ngram", "ngram_gpu", "loopspec"])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--stress", action="store_true")
    parser.add_argument("--penalty", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "SCHEDULING", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.k, args.stress, args.penalty, args.child[2])
        return 0
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="ERROR",
               TOKENIZERS_PARALLELISM="false")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, scheduling in (("native", "sync"), (args.mode, "async")):
            out = os.path.join(tmp, f"{mode}-{scheduling}.json")
            cmd = [sys.executable, __file__, "--k", str(args.k), "--child", mode, scheduling, out]
            cmd += ["--stress"] * args.stress + ["--penalty"] * args.penalty
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                print(f"{mode} ({scheduling} scheduling) failed:\n{proc.stderr[-3000:]}")
                return 1
            with open(out) as f:
                results[scheduling] = json.load(f)
    sync, async_ = results["sync"], results["async"]
    for name, r in (("native, sync", sync), (f"{args.mode}, async", async_)):
        print(f"{name}: async_scheduling={r['async_scheduling']} {r['seconds']:.2f} s "
              f"spec={r['spec_metrics']} counts={r['counts']}")
    same = sync["tokens"] == async_["tokens"]
    print(f"greedy output of {args.mode} under async scheduling equals native: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
