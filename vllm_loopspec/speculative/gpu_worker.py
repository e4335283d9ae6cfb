"""The loopspec worker and model runner for CUDA (``--worker-cls``, chosen
by :func:`vllm_loopspec.patches.translate_loopspec`). vLLM's GPU worker has
a method to override for its runner; the CPU one does not
(:mod:`vllm_loopspec.speculative.cpu_worker`)."""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_loopspec.speculative.runner import LoopSpecRunnerMixin


class LoopSpecGPUModelRunner(LoopSpecRunnerMixin, GPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._loopspec_setup()


class LoopSpecGPUWorker(Worker):
    """GPU worker whose model runner runs loopspec rounds."""

    def compile_or_warm_up_model(self):
        """After vLLM's warm-up (the model compiled, the KV cache bound): the
        adaptive policy's step costs seeded from the model's timed pieces."""
        times = super().compile_or_warm_up_model()
        self.model_runner.drafter.seed_costs(self.model_runner.max_num_reqs)
        return times

    def _make_model_runner(self):
        return LoopSpecGPUModelRunner(self.vllm_config, self.device)
