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
    from vllm.transformers_utils import config as vllm_config_utils

    from vllm_loopspec.config import OuroConfig

    if OURO_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(OURO_ARCHITECTURE, OURO_MODEL_PATH)
    # vLLM resolves config classes through its own registry first; a class
    # value (not a name) is returned as is by its LazyConfigDict.
    vllm_config_utils._CONFIG_REGISTRY["ouro"] = OuroConfig
    AutoConfig.register("ouro", OuroConfig, exist_ok=True)

    from vllm_loopspec.spec import patches

    patches.apply()
    _registered = True
