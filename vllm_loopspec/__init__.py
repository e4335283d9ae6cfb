"""vllm-loopspec: serve Ouro looped transformers in vLLM and speculate with
their own shallow loops.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every
process it starts (front end, engine core, workers), possibly more than once,
so it only registers lazily and idempotently.
"""

from vllm_loopspec.plugin import register

__all__ = ["register"]
