"""The loopspec worker and model runner for vLLM's CPU platform
(``--worker-cls``, chosen by :func:`vllm_loopspec.patches.translate_loopspec`).

A module of its own because importing vLLM's ``vllm.v1.worker.cpu_worker``
imports ``vllm.v1.worker.cpu.shm``, which replaces parts of torch for the
whole process (``torch.cuda.Stream`` and ``Event`` by placeholders,
``Tensor.pin_memory`` by a no-op, ``torch.accelerator.get_memory_info`` by
the CPU node's memory, vLLM's ``UvaBuffer`` by the CPU one): on a CUDA host
that breaks every engine of the process (found on the first GPU run,
``benchmarks/results/findings.md``). Only a CPU engine imports this module.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_loopspec.speculative.drafter import WARM_ROW_COUNTS
from vllm_loopspec.speculative.runner import LoopSpecRunnerMixin

logger = init_logger("vllm.loopspec.cpu_worker")  # under vLLM's logger, which has the handlers


class LoopSpecCPUModelRunner(LoopSpecRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._loopspec_setup()

    def warming_up_model(self) -> None:
        """vLLM compiles the model's ``forward`` here; the round's tick is
        compiled beside it, under the same settings, and then run over the
        row counts speculative steps meet (oneDNN builds a kernel per row
        count, :meth:`~.drafter.LoopSpecDrafter.warm_up_row_counts`)."""
        from vllm.distributed import get_pp_group
        from vllm.v1.worker.cpu_model_runner import _set_global_compilation_settings

        super().warming_up_model()
        with _set_global_compilation_settings(self.vllm_config):
            self.drafter.warm_up(self.max_num_tokens)
            rows = min(self.max_num_tokens, WARM_ROW_COUNTS)
            seconds = self.drafter.warm_up_row_counts(rows, lm_head=get_pp_group().is_last_rank)
        logger.info("loopspec: row counts 1..%d warmed up in %.2f s", rows, seconds)


class LoopSpecCPUWorker(CPUWorker):
    """CPU worker whose model runner runs loopspec rounds (``--worker-cls``)."""

    def compile_or_warm_up_model(self):
        """After vLLM's warm-up (the model compiled, the KV cache bound): the
        adaptive policy's step costs seeded from the model's timed pieces."""
        times = super().compile_or_warm_up_model()
        self.model_runner.drafter.seed_costs(self.model_runner.max_num_reqs)
        return times

    def init_device(self) -> None:
        from vllm_loopspec.patches import cpu_worker_builds

        with cpu_worker_builds(LoopSpecCPUModelRunner):
            super().init_device()
