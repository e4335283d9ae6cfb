"""Every change loopspec makes to vLLM code, in one place (the patch ledger).

vLLM 0.32 has no extension point for a new speculative method: its
``SpeculativeConfig.method`` is a closed ``Literal`` and the runner dispatches
on it. loopspec therefore rides on the built-in ``custom_class`` method (which
gives it vLLM's scheduling of speculative tokens, rejection sampler, rollback
and metrics) and translates the user's ``loopspec`` request into it. The
patches, numbered in the comments and docstrings below:

1. ``EngineArgs.add_cli_args``: the bare word ``--speculative-config loopspec``;
2. ``EngineArgs.create_speculative_config``: ``loopspec`` → ``custom_class``;
3. ``CpuPlatform.register_triton_kernel_overrides``, followed by a correct
   ``expand_kernel`` (:func:`fix_cpu_expand_kernel`);
4. ``dispatcher._rebind_kernels``, kept from crashing once numba is imported
   (:func:`guard_kernel_rebind_scan`);
5. ``topk_topp_sampler.apply_top_k_only``, made to accept an empty batch
   (:func:`fix_top_k_only_on_empty_batch`);
6. ``CPUModelRunner.sample_tokens``, so that
   ``GPUModelRunner._bookkeeping_sync`` never rewinds a CPU generator
   (:func:`keep_seeded_streams_on_discard`);
7. ``vllm.transformers_utils.config._CONFIG_REGISTRY["ouro"]``: vLLM's config
   registry has no public registration call (:func:`register_ouro_config`);
8. ``vllm.v1.worker.cpu_worker.CPUModelRunner``, swapped for the duration of
   ``CPUWorker.init_device``, which builds its runner from that module
   global (:func:`cpu_worker_builds`; the GPU worker has a method to override).
9. ``SamplingParams._validate_spec_decode``: a loopspec engine serves
   ``min_p`` and ``logit_bias`` requests (plainly, one token per step)
   instead of refusing them (:func:`serve_unverifiable_sampling`);
10. ``gpu_model_runner.build_logitsprocs``: a loopspec runner builds vLLM's
   built-in logits processors (min-p, logit bias, min tokens), which vLLM
   leaves out of every speculative engine (same function);
11. ``prometheus_client.multiprocess.MultiProcessCollector.collect`` (the
   only collector vLLM's ``/metrics`` reads when it runs several API server
   processes), so that loopspec's counters reach ``/metrics`` there too
   (:func:`expose_in_multiprocess_registry`);
12. ``CpuPlatform.ray_device_key`` and the Ray runtime env of CPU engines
   that select Ray, so that ``--distributed-executor-backend ray`` runs on CPU, each worker
   taking one unit of a declared Ray resource (:func:`run_ray_executor_on_cpu`);
13. ``NixlBaseConnectorWorker.__init__`` (``NixlConnector``'s worker side):
   on CPU it pins the calling thread, which is the worker's main thread and
   OpenMP master that runs every forward, to the last core of each NUMA node
   and never undoes it; the thread's affinity is restored after the call
   (:func:`keep_cpu_affinity_under_nixl`);
14. ``VllmConfig.__post_init__``: a loopspec engine started with
   ``--async-scheduling`` keeps it (vLLM refuses it for ``custom_class``
   methods and the CPU platform switches it off) (:func:`allow_async_loopspec`);
15. ``gpu_model_runner.update_num_computed_tokens_for_batch_change`` (the
   async path's correction after rejected drafts), run eagerly on CPU: its
   ``torch.compile`` recompiles for 1, 2 and n rows, about a minute of a
   CPU engine's first async steps, for a handful of element-wise ops
   (same function);
16. ``GPUModelRunner.num_accepted_tokens_event``, set to None in a loopspec
   runner of a model that is not hybrid: ``_prepare_inputs`` then skips the
   per-step host sync and copy of accepted counts that only hybrid (Mamba)
   models write (:func:`skip_accepted_counts_sync`);
17. ``NixlBaseConnectorScheduler.set_xfer_handshake_metadata`` and its
   ``_nixl_handshake_listener``: an engine whose NIXL side channel cannot
   bind its port fails at start with the port named, instead of waiting
   forever for a listener that died (:func:`fail_on_a_dead_nixl_listener`).

Patches 1, 2, 7, 9 and 12 are needed in every process (front end and engines);
3 to 6 fix vLLM bugs on CPU for every engine of the process, whatever its
method (ngram, suffix and native decoding hit them too); 8 is used only by
the loopspec CPU worker; 9 and 10 change behaviour only for loopspec
engines (other speculative methods keep vLLM's refusal); 11 only in the API
server processes of a server with ``--api-server-count > 1``; 12 on CPU (its
runtime-env half only in engines that select Ray); 13 in CPU engines with a
``NixlConnector`` (P/D instances); 14 only for loopspec engines that ask for
async scheduling, in every process that validates their config, and 15 with
it, on CPU; 16 in each loopspec runner; 17 in every process (it acts only
in engines with a ``NixlConnector``, P/D instances, whatever their method). The worker classes themselves are vLLM's documented
``--worker-cls`` extension point, not patches.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_loopspec.speculative.options import (
    ADDITIONAL_CONFIG_KEY,
    LoopSpecConfigError,
    is_loopspec,
    resolve_options,
)

DRAFTER_CLASS = "vllm_loopspec.speculative.drafter.LoopSpecDrafter"
# With VLLM_LOOPSPEC_DEBUG=1: the drafter with test and profiling hooks.
DEBUG_DRAFTER_CLASS = "vllm_loopspec.speculative.debug.DebugLoopSpecDrafter"
DEBUG_ENV = "VLLM_LOOPSPEC_DEBUG"
CPU_WORKER_CLASS = "vllm_loopspec.speculative.cpu_worker.LoopSpecCPUWorker"
GPU_WORKER_CLASS = "vllm_loopspec.speculative.gpu_worker.LoopSpecGPUWorker"

# Why loopspec refuses --pipeline-parallel-size > 1 and what to use instead
# (figures: benchmarks/RESULTS.md, "Beyond one device").
PIPELINE_PARALLEL_REFUSAL = (
    "loopspec does not run with pipeline parallelism (--pipeline-parallel-size > 1): every draft "
    "token of a round needs the logits of the last layer before the next draft can start on the "
    "first, so a round would cross the pipeline once per draft tick with every other stage idle. "
    "Use --tensor-parallel-size to split the model within a node and --data-parallel-size (one "
    "replica per node, --data-parallel-backend ray across nodes) to scale out. (Ouro does not run "
    "pipeline-parallel without loopspec either: its loops re-apply every layer, so each token would "
    "cross the pipeline R times, and vLLM's PP runs each stage once per step.)"
)

_applied = False
logger = init_logger(__name__)


def parse_speculative_config_arg(value: str) -> dict[str, Any] | str | None:
    """``--speculative-config`` value: JSON as vLLM parses it, or the bare word
    ``loopspec``."""
    if value in ("", "None"):
        return None
    if value.strip() == "loopspec":
        return {"method": "loopspec"}
    return json.loads(value)


def _worker_class() -> str:
    from vllm.platforms import current_platform

    return CPU_WORKER_CLASS if current_platform.is_cpu() else GPU_WORKER_CLASS


def translate_loopspec(engine_args, target_model_config, target_parallel_config) -> None:
    """Rewrite ``engine_args.speculative_config`` from loopspec to the
    ``custom_class`` method, record loopspec's options in ``additional_config``
    and select the loopspec worker. Raises :class:`LoopSpecConfigError`."""
    opts = resolve_options(
        engine_args.speculative_config,
        target_model_config.hf_config,
        getattr(target_model_config, "architectures", None),
        model_path=getattr(target_model_config, "model", None),
    )
    if target_parallel_config.pipeline_parallel_size > 1:
        raise LoopSpecConfigError(PIPELINE_PARALLEL_REFUSAL)
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("", "0"):
        raise LoopSpecConfigError(
            "loopspec runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER."
        )
    from vllm.platforms import current_platform

    if not engine_args.enforce_eager and not current_platform.is_cpu():
        # The model's forward (native steps) is compiled by vLLM, but the
        # round calls loop ranges outside vLLM's CUDA graph wrapper: until
        # captured rounds are proven on a GPU, the engine runs eagerly. On
        # CPU (no graphs) plain steps run compiled and rounds eagerly.
        logger.warning("loopspec: rounds are not captured in CUDA graphs yet; "
                       "running this engine with --enforce-eager.")
        engine_args.enforce_eager = True
        target_model_config.enforce_eager = True
    worker = _worker_class()
    if target_parallel_config.worker_cls not in ("auto", worker):
        raise LoopSpecConfigError(
            f"loopspec brings its own worker ({worker}); remove --worker-cls "
            f"{target_parallel_config.worker_cls}."
        )
    from vllm_loopspec.speculative.metrics import ENV_DIR, enable_in_frontend

    enable_in_frontend()
    if target_parallel_config.distributed_executor_backend == "ray":
        # Ray workers inherit their node's environment, not the front end's:
        # name the snapshot directory in their runtime env (it is local to
        # this node: workers on other nodes cannot reach it; see README).
        update_ray_runtime_env(target_parallel_config, env_vars={ENV_DIR: os.environ[ENV_DIR]})
    target_parallel_config.worker_cls = worker
    engine_args.worker_cls = worker
    additional = dict(engine_args.additional_config or {})
    additional[ADDITIONAL_CONFIG_KEY] = opts.as_dict()
    engine_args.additional_config = additional
    debug = os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    engine_args.speculative_config = {
        "method": "custom_class",
        "model": DEBUG_DRAFTER_CLASS if debug else DRAFTER_CLASS,
        "num_speculative_tokens": opts.draft_slots,
    }


def expand_batch_to_tokens_cpu(output, input_val, cu_num_tokens, replace_from, replace_to,
                               MAX_NUM_TOKENS=None) -> None:
    """``output[start_i:end_i] = input_val[i]`` (``replace_from`` → ``replace_to``),
    for integer and floating inputs alike."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(counts.sum())
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def fix_cpu_expand_kernel() -> None:
    """Patch 3 — CPU fallback of ``vllm.v1.sample.rejection_sampler.expand_kernel``.

    vLLM 0.32's CPU override (``vllm.utils.cpu_triton_utils._expand_kernel_impl``)
    casts its input and output to int64, so expanding the float per-request
    temperature/top-p to per-token values returns garbage (~1e-15) and every
    *sampled* speculative request on CPU, whatever the method (loopspec,
    ngram, suffix, ...), is verified against a wrong target. Register a
    correct implementation right after the platform's own
    ``CpuPlatform.register_triton_kernel_overrides`` (wrapped by
    :func:`apply`; vLLM calls it in ``WorkerBase.init_worker``, after loading
    plugins), so every engine of the process gets it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_batch_to_tokens_cpu})


def _fix_expand_after_platform_overrides() -> None:
    """Patch 3's hook: wrap ``CpuPlatform.register_triton_kernel_overrides``
    so that the fix follows every (re-)registration of vLLM's CPU kernels;
    each new engine's worker registers them again. Patch 6 rides on the same
    hook: it runs in every CPU worker, before its model runner exists, and
    keeps vLLM's model runner modules out of the front end; so does patch 13
    (before the worker builds its KV connector)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform_class = type(current_platform)
    original = platform_class.register_triton_kernel_overrides
    if getattr(original, "_loopspec_wrapped", False):
        return

    def register_triton_kernel_overrides(cls) -> None:
        original.__func__(cls)
        fix_cpu_expand_kernel()
        keep_seeded_streams_on_discard()
        keep_cpu_affinity_under_nixl()  # patch 13, in CPU workers only

    register_triton_kernel_overrides._loopspec_wrapped = True
    platform_class.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)


def guard_kernel_rebind_scan() -> None:
    """Patch 4 — ``vllm.triton_utils.dispatcher._rebind_kernels``.

    When a platform registers kernel overrides (every CPU worker start), vLLM
    0.32 scans the namespace of every imported module and calls
    ``vars(value).get(...)`` on each object with a ``__dict__``. llvmlite's
    ``binding.ffi.lib`` answers *every* attribute, ``__dict__`` included, with
    a function wrapper, so once numba is imported (vLLM's ngram proposer does
    it) the scan raises ``AttributeError`` and no further engine can start in
    that process (an ngram engine, then any other ``LLM``). Hide llvmlite's
    modules from ``sys.modules`` for the duration of the scan: they hold no
    Triton kernels, and nothing is imported meanwhile."""
    from vllm.triton_utils import dispatcher

    original = dispatcher._rebind_kernels
    if getattr(original, "_loopspec_guarded", False):
        return

    def rebind_kernels(*args, **kwargs):
        hidden = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "llvmlite"}
        try:
            return original(*args, **kwargs)
        finally:
            sys.modules.update(hidden)

    rebind_kernels._loopspec_guarded = True
    dispatcher._rebind_kernels = rebind_kernels


def apply_top_k_only_or_pass(original):
    """``original`` (vLLM's ``apply_top_k_only``), except that a batch of no
    rows is returned as it is."""

    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if k.numel() == 0:
            return logits
        return original(logits, k)

    apply_top_k_only._loopspec_original = original
    return apply_top_k_only


def fix_top_k_only_on_empty_batch() -> None:
    """Patch 5 — ``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_only``.

    Root cause (vLLM 0.32, report upstream): with any speculative method,
    ``GPUModelRunner._prepare_inputs`` builds ``SpecDecodeMetadata`` for every
    step, also for steps in which no request carries drafts (the prefill step,
    or steps where every draft list is empty), and ``_sample`` then sends the
    step through ``RejectionSampler.forward``. Its
    ``apply_sampling_constraints`` processes the *target* logits, which have
    zero rows in such a step. For a batch with some ``top_k`` and no
    ``top_p``, ``apply_top_k_top_p`` takes the PyTorch path wherever Triton
    is absent (every CPU build) and, with ``allow_cpu_sync`` (CPU), calls
    ``apply_top_k_only``, whose ``k.max()`` raises on an empty tensor
    (``max(): Expected reduction dim to be specified for input.numel() ==
    0``). The exception escapes the worker and the engine core dies: one
    valid request takes down every speculative CPU server (loopspec, ngram,
    suffix alike). Greedy batches return before top-k, and a batch with any
    ``top_p`` sorts instead, which copes with zero rows; native decoding
    never sends an empty batch. The fix: an empty batch has nothing to mask.
    Applied only where the PyTorch path is reachable (no Triton)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    if topk_topp_sampler.HAS_TRITON:
        return
    current = topk_topp_sampler.apply_top_k_only
    if getattr(current, "_loopspec_original", None) is not None:
        return
    # apply_top_k_top_p_pytorch looks the function up in its module at call
    # time, so replacing the module attribute reaches every caller.
    topk_topp_sampler.apply_top_k_only = apply_top_k_only_or_pass(current)


def sample_tokens_keeping_seeded_streams(original):
    """``original`` (vLLM's ``GPUModelRunner.sample_tokens``), with the
    generators of the requests whose sampled token this step discards set
    aside while it runs."""

    def sample_tokens(self, grammar_output):
        if self.execute_model_state is None:  # nothing was run: nothing sampled
            return original(self, grammar_output)
        generators = self.input_batch.generators  # the dict the sampler reads
        discarded = np.flatnonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])
        aside = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            return original(self, grammar_output)
        finally:
            generators.update(aside)

    sample_tokens._loopspec_original = original
    return sample_tokens


def keep_seeded_streams_on_discard() -> None:
    """Patch 6 — ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync``
    (wrapped through ``CPUModelRunner.sample_tokens``, its only caller).

    Root cause (vLLM 0.32, report upstream): a step that prefills only part
    of a prompt (chunked prefill: the prompt's uncached tokens exceed the
    step's ``max_num_batched_tokens`` budget) still samples a token for that
    request and discards it. For a request with a ``seed`` (its own
    ``torch.Generator``), ``_bookkeeping_sync`` then rewinds the generator
    with ``gen.set_offset(gen.get_offset() - 4)`` so that the discarded draw
    does not shift the request's random stream. That is the CUDA (Philox)
    generator's API; a CPU generator raises ``RuntimeError: CPU Generator
    does not use offset``, the exception escapes the worker and the engine
    core dies: one seeded sampled request with a long prompt, or arriving
    with others, takes down every CPU server, native or speculative (found by
    ``benchmarks/soak.py``). The fix: during such a step the request's
    generator is set aside, so the discarded draw comes from the global
    generator, the request's own stream is left exactly as it was (what the
    rewind intends; seeded outputs are the same with and without chunking),
    and the rewind loop finds no generator to rewind. CPU runners only: CUDA
    generators support offsets."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    current = CPUModelRunner.sample_tokens
    if getattr(current, "_loopspec_original", None) is not None:
        return
    CPUModelRunner.sample_tokens = sample_tokens_keeping_seeded_streams(current)


def register_ouro_config(config_class) -> None:
    """Patch 7 — ``vllm.transformers_utils.config._CONFIG_REGISTRY``.

    vLLM resolves a checkpoint's ``model_type`` through this registry before
    transformers' ``AutoConfig`` and offers no call to add to it; a class
    value (not a name) is returned as is by its ``LazyConfigDict``. Without
    it, a real Ouro ``config.json`` (with its ``auto_map``) would need
    ``--trust-remote-code``."""
    from vllm.transformers_utils import config as vllm_config_utils

    vllm_config_utils._CONFIG_REGISTRY["ouro"] = config_class


@contextlib.contextmanager
def cpu_worker_builds(runner_class):
    """Patch 8 — ``vllm.v1.worker.cpu_worker.CPUModelRunner``, for one call.

    ``CPUWorker.init_device`` builds its model runner by looking up the module
    global ``CPUModelRunner`` (the GPU worker has ``_make_model_runner`` to
    override instead); point it at ``runner_class`` while the loopspec CPU
    worker initialises, and restore it after."""
    import vllm.v1.worker.cpu_worker as cpu_worker

    original = cpu_worker.CPUModelRunner
    cpu_worker.CPUModelRunner = runner_class
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = original


def is_loopspec_engine(speculative_config) -> bool:
    """Whether vLLM's speculative config is loopspec's (after patch 2)."""
    return (speculative_config is not None and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) in (DRAFTER_CLASS, DEBUG_DRAFTER_CLASS))


def serve_unverifiable_sampling() -> None:
    """Patches 9 and 10 — ``vllm.sampling_params.SamplingParams._validate_spec_decode``
    and ``vllm.v1.worker.gpu_model_runner.build_logitsprocs``.

    vLLM's rejection sampler cannot apply ``min_p`` or ``logit_bias`` to the
    target distribution, so vLLM refuses such requests whenever speculation
    is on and builds no min-p / logit-bias processors in speculative runners.
    loopspec gives such a request no drafts (the drafter's ``num_drafts``):
    its token comes from vLLM's own sampler, as the bonus token of a step
    with drafts (``RejectionSampler`` samples it with ``Sampler``, which
    applies every logits processor) or from a plain step. So a loopspec
    engine accepts the request (9) and its runner builds the built-in
    processors as a non-speculative runner does (10). Custom logits
    processors are still refused, as vLLM does for every speculative
    engine."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker import gpu_model_runner

    validate = SamplingParams._validate_spec_decode
    if getattr(validate, "_loopspec_original", None) is None:
        def _validate_spec_decode(self, speculative_config):
            if is_loopspec_engine(speculative_config):
                return None
            return validate(self, speculative_config)

        _validate_spec_decode._loopspec_original = validate
        SamplingParams._validate_spec_decode = _validate_spec_decode

    build = gpu_model_runner.build_logitsprocs
    if getattr(build, "_loopspec_original", None) is None:
        def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
            if is_loopspec_engine(vllm_config.speculative_config) and not is_pooling_model \
                    and not custom_logitsprocs:
                from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

                return LogitsProcessors(ctor(vllm_config, device, is_pin_memory)
                                        for ctor in BUILTIN_LOGITS_PROCESSORS)
            return build(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)

        build_logitsprocs._loopspec_original = build
        gpu_model_runner.build_logitsprocs = build_logitsprocs


def expose_in_multiprocess_registry(collector) -> None:
    """Patch 11 — ``prometheus_client.multiprocess.MultiProcessCollector.collect``,
    in the API server processes of a server with ``--api-server-count > 1``.

    With several API server processes (vLLM's default with
    ``--data-parallel-size``), vLLM switches prometheus_client to
    multiprocess mode, and the ``/metrics`` handler it installs
    (``prometheus_fastapi_instrumentator``'s ``expose``) builds a fresh
    registry per scrape holding only a ``MultiProcessCollector``: collectors
    registered anywhere else (loopspec's) never reach ``/metrics``, and no
    vLLM hook reaches that registry. Make the multiprocess collector of this
    process also yield ``collector``'s families. Applied only where
    ``PROMETHEUS_MULTIPROC_DIR`` is set (otherwise ``/metrics`` reads the
    global registry, where :func:`metrics.enable_in_frontend` registers the
    collector)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") is None:
        return
    from prometheus_client import multiprocess

    original = multiprocess.MultiProcessCollector.collect
    if getattr(original, "_loopspec_wrapped", False):
        return

    def collect(self):
        yield from original(self)
        yield from collector.collect()

    collect._loopspec_wrapped = True
    multiprocess.MultiProcessCollector.collect = collect


# Patch 12: the Ray resource each vLLM CPU worker takes (one unit per worker);
# a CPU node offers as many as it hosts workers: ray start --resources='{"vllm_cpu_worker": 2}'.
RAY_CPU_RESOURCE = "vllm_cpu_worker"
RAY_WORKER_SETUP_HOOK = "vllm_loopspec.patches.setup_ray_cpu_worker_process"


def ray_cpu_node_and_ids(self) -> tuple[str, list[int]]:
    """``RayWorkerProc.get_node_and_physical_gpu_ids`` of a CPU worker: its
    node, and its rank as the id of the slot it holds (CPU workers pin
    threads by local rank, not by device id)."""
    import ray

    return ray.get_runtime_context().get_node_id(), [int(self._init_kwargs["rank"])]


def setup_ray_cpu_worker_process() -> None:
    """Ray ``worker_process_setup_hook`` of vLLM's CPU worker actors (patch
    12, actor side): runs when the actor's process starts, before vLLM's
    actor class is loaded in it (vLLM loads plugins only later, in the
    worker's ``init_worker``)."""
    from vllm_loopspec import register

    register()
    from vllm.v1.executor import ray_executor_v2

    ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids = ray_cpu_node_and_ids


def run_ray_executor_on_cpu() -> None:
    """Patch 12 — ``CpuPlatform.ray_device_key`` (every process), and the
    Ray runtime env of CPU engines that select Ray
    (:func:`add_ray_cpu_worker_setup_hook`, from patch 2's wrapper).

    vLLM 0.32 refuses ``--distributed-executor-backend ray`` on CPU only
    because ``CpuPlatform.ray_device_key`` is empty (``ray_utils``: "current
    platform cpu does not support ray"). Ray's own ``CPU`` resource cannot
    stand in (vLLM asks for the device key through ``resources=``, which Ray
    refuses for ``CPU``), so a CPU worker takes one unit of the custom
    resource :data:`RAY_CPU_RESOURCE`, which each CPU node declares for the
    workers it hosts. The worker actors then ask Ray for their accelerator
    ids, which custom resources do not have: their runtime env gets
    :func:`setup_ray_cpu_worker_process` as setup hook, which answers with
    the worker's rank. CPU platform only; only Ray code reads the key."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform_class = type(current_platform)
    if not platform_class.ray_device_key:
        platform_class.ray_device_key = RAY_CPU_RESOURCE


def add_ray_cpu_worker_setup_hook(parallel_config) -> None:
    """Patch 12, engine side: a CPU engine with the Ray executor runs
    :func:`setup_ray_cpu_worker_process` in each of its Ray worker processes
    (``ParallelConfig.ray_runtime_env``, which vLLM hands to ``ray.init`` and
    to its worker actors)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or parallel_config.distributed_executor_backend != "ray":
        return
    update_ray_runtime_env(parallel_config, worker_process_setup_hook=RAY_WORKER_SETUP_HOOK)


def update_ray_runtime_env(parallel_config, env_vars: dict[str, str] | None = None, **fields) -> None:
    """Add ``fields`` (kept where the user set them) and ``env_vars``
    (overriding the Ray node's environment) to the runtime env vLLM gives
    its Ray workers."""
    from ray.runtime_env import RuntimeEnv

    env = dict(parallel_config.ray_runtime_env or {})
    for key, value in fields.items():
        env.setdefault(key, value)
    if env_vars:
        env["env_vars"] = {**(env.get("env_vars") or {}), **env_vars}
    parallel_config.ray_runtime_env = RuntimeEnv(**env)


# Patch 13 — NixlBaseConnectorWorker.__init__ (vllm/distributed/kv_transfer/
# kv_connector/v1/nixl/base_worker.py) calls os.sched_setaffinity(0, [last core
# of each NUMA node]) on CPU, meaning to reserve that core for start_load_kv.
# It pins the calling thread, which is also the OpenMP master of every forward:
# with a prefill and a decode instance on one host both engines' compute threads
# land on the same core, together with the prefill's engine loop that keeps
# stepping while it holds blocks for a pull. On the 2-core CI machine that made
# a 24-token decode take 10-25 s and single 0.5 MB NIXL reads take up to 22 s
# (vllm:nixl_xfer_time_seconds), long enough for the prefill's KV lease to run
# out and its blocks to be reused for another prompt before the decode side
# read them (wrong tokens; prefill log "Potentially invalid KV blocks ...
# retrieved by a decode worker"). Restoring the thread's affinity keeps vLLM's
# OpenMP binding (VLLM_CPU_OMP_THREADS_BIND, which the P/D launcher sets per
# instance) in force.
def keep_cpu_affinity(original):
    @functools.wraps(original)
    def init(self, *args, **kwargs):
        saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        try:
            return original(self, *args, **kwargs)
        finally:
            if saved is not None and os.sched_getaffinity(0) != saved:
                os.sched_setaffinity(0, saved)

    init.__loopspec_patched__ = True
    return init


def keep_cpu_affinity_under_nixl() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    except ImportError:  # no NIXL connector in this build
        return
    cls = base_worker.NixlBaseConnectorWorker
    if not getattr(cls.__init__, "__loopspec_patched__", False):
        cls.__init__ = keep_cpu_affinity(cls.__init__)


# Patch 14 — vllm.config.vllm.VllmConfig.__post_init__. vLLM 0.32 refuses an
# explicit --async-scheduling for custom_class speculative methods
# (config/vllm.py, "only supported with EAGLE/MTP/...") and the CPU platform
# switches async off ("not required on CPU", platforms/cpu.py). loopspec
# follows vLLM's async speculative path (optimistic draft slots, the device
# correction, the hand-over of each row's next token: runner.py), so for a
# loopspec engine that asked for it the config is validated with async off
# and async is switched on after. __post_init__ runs in the front end and
# again in the engine core (after its handshake), hence the wrapper there
# rather than in the platform hook. Patch 15 — on CPU the async path's
# correction helper (v1/spec_decode/utils.py), imported by name into
# gpu_model_runner, runs eagerly: compiled it recompiles for 1, 2 and n rows.
def allow_async_loopspec() -> None:
    from vllm.config.vllm import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, "__loopspec_patched__", False):
        return

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        wants_async = (self.scheduler_config.async_scheduling is True
                       and is_loopspec_engine(self.speculative_config))
        if wants_async:
            self.scheduler_config.async_scheduling = False
        original(self, *args, **kwargs)
        if wants_async:
            self.scheduler_config.async_scheduling = True
            _run_async_correction_eagerly_on_cpu()

    post_init.__loopspec_patched__ = True
    VllmConfig.__post_init__ = post_init


def _run_async_correction_eagerly_on_cpu() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker import gpu_model_runner

    compiled = gpu_model_runner.update_num_computed_tokens_for_batch_change
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is not None:
        gpu_model_runner.update_num_computed_tokens_for_batch_change = eager


def skip_accepted_counts_sync(runner) -> None:
    """Patch 16 — ``GPUModelRunner.num_accepted_tokens_event`` (read by
    ``GPUModelRunner._prepare_inputs``). vLLM creates the event for every
    speculative engine, and each step's ``_prepare_inputs`` then waits on it
    and copies ``input_batch.num_accepted_tokens_cpu`` to the device; only
    ``_update_states_after_model_execute`` writes those counts, and only for
    hybrid models (Mamba state shifting after rejected drafts). For any
    other model they stay 1, which is what ``_prepare_inputs`` fills in
    when the event is None, as in a non-speculative engine: the same values
    without the sync and copy, a few microseconds of every step, plain
    steps included (``benchmarks/results/findings.md``, twenty-seventh
    session)."""
    if not runner.model_config.is_hybrid:
        runner.num_accepted_tokens_event = None


# Patch 17 — NixlBaseConnectorScheduler.set_xfer_handshake_metadata (vllm/
# distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py) starts the
# side-channel listener thread (_nixl_handshake_listener) and waits on its
# ready event with no timeout. A listener that cannot bind its port
# (VLLM_NIXL_SIDE_CHANNEL_PORT held by another process) dies before it sets
# the event: the engine core waits forever, `vllm serve` never answers
# /health and its log shows only the thread's traceback (a CI run's prefill
# instance hung so for 300 s on "Address already in use"). The listener is
# wrapped to record its failure and release the waiter; the caller then
# raises, so the engine exits with the port named.
_failed_nixl_listeners: dict[tuple[str, int], BaseException] = {}


def record_listener_failure(original):
    @functools.wraps(original)
    def listener(encoded_data, ready_event, stop_event, host, port, *args, **kwargs):
        try:
            return original(encoded_data, ready_event, stop_event, host, port, *args, **kwargs)
        except BaseException as exc:
            if not ready_event.is_set():  # died before listening: release the waiting engine
                _failed_nixl_listeners[(host, port)] = exc
                ready_event.set()
            raise

    listener.__loopspec_patched__ = True
    return listener


def raise_listener_failure(original):
    @functools.wraps(original)
    def set_xfer_handshake_metadata(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        failure = _failed_nixl_listeners.pop((self.side_channel_host, self.side_channel_port), None)
        if failure is not None:
            raise RuntimeError(
                f"NIXL side channel could not listen on {self.side_channel_host}:{self.side_channel_port} "
                f"({failure}): another process holds the port. Set VLLM_NIXL_SIDE_CHANNEL_PORT to a free "
                "port (each P/D instance needs its own)") from failure
        return result

    set_xfer_handshake_metadata.__loopspec_patched__ = True
    return set_xfer_handshake_metadata


def fail_on_a_dead_nixl_listener() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler
    except ImportError:  # no NIXL connector in this build
        return
    cls = base_scheduler.NixlBaseConnectorScheduler
    if getattr(cls.set_xfer_handshake_metadata, "__loopspec_patched__", False):
        return
    cls._nixl_handshake_listener = staticmethod(record_listener_failure(cls._nixl_handshake_listener))
    cls.set_xfer_handshake_metadata = raise_listener_failure(cls.set_xfer_handshake_metadata)


def apply() -> None:
    """Install the wrappers (idempotent)."""
    global _applied
    if _applied:
        return
    guard_kernel_rebind_scan()
    fix_top_k_only_on_empty_batch()
    serve_unverifiable_sampling()
    run_ray_executor_on_cpu()
    allow_async_loopspec()
    fail_on_a_dead_nixl_listener()
    _fix_expand_after_platform_overrides()
    from vllm.engine.arg_utils import EngineArgs

    # Patch 1 — vllm.engine.arg_utils.EngineArgs.add_cli_args: vLLM parses
    # --speculative-config with json.loads only, so the documented bare word
    # `--speculative-config loopspec` would fail; swap the argument's type for
    # one that also accepts it. Any other value is still parsed as JSON.
    original_add_cli_args = EngineArgs.add_cli_args

    def add_cli_args(parser, *args, **kwargs):
        parser = original_add_cli_args(parser, *args, **kwargs)
        for action in parser._actions:
            if action.dest == "speculative_config":
                action.type = parse_speculative_config_arg
        return parser

    EngineArgs.add_cli_args = staticmethod(add_cli_args)

    # Patch 2 — vllm.engine.arg_utils.EngineArgs.create_speculative_config:
    # vLLM's SpeculativeConfig forbids unknown methods and keys; translate
    # loopspec into the custom_class method before it is validated.
    original_create = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        add_ray_cpu_worker_setup_hook(target_parallel_config)  # patch 12
        if is_loopspec(self.speculative_config):
            translate_loopspec(self, target_model_config, target_parallel_config)
        return original_create(self, target_model_config, target_parallel_config)

    EngineArgs.create_speculative_config = create_speculative_config
    _applied = True
