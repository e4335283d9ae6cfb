"""Registration with vLLM: the model, its config class, loopspec. Idempotent."""

from __future__ import annotations

OURO_ARCHITECTURE = "OuroForCausalLM"
OURO_MODEL_PATH = "vllm_loopspec.models.ouro:OuroForCausalLM"

_registered = False


def register() -> None:
    """Register Ouro with vLLM and transformers (safe to call repeatedly)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from vllm_loopspec import patches
    from vllm_loopspec.config import OuroConfig

    if OURO_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(OURO_ARCHITECTURE, OURO_MODEL_PATH)
    patches.register_ouro_config(OuroConfig)
    AutoConfig.register("ouro", OuroConfig, exist_ok=True)
    patches.apply()
    _registered = True
