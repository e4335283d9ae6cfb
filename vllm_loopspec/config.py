"""Ouro's Hugging Face config class, registered so checkpoints load without
``trust_remote_code``.

Real Ouro checkpoints carry an ``auto_map`` to remote code; we ignore it and
read the fields ourselves. Loading goes through :meth:`OuroConfig.from_dict`,
which checks the fields the model cannot do without and names the one that is
missing or malformed, so a broken ``config.json`` fails before any engine
process starts.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

# field -> (accepted python types, must be positive)
_REQUIRED_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "total_ut_steps",
)
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "early_exit_threshold")


class OuroConfigError(ValueError):
    """A checkpoint's config.json is missing a field or has a bad value."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_ouro_config_dict(cfg: dict[str, Any]) -> None:
    """Raise :class:`OuroConfigError` naming the first bad field of ``cfg``."""
    for name in _REQUIRED_INT_FIELDS:
        if name not in cfg or cfg[name] is None:
            raise OuroConfigError(
                f"Ouro config.json is missing required field '{name}' "
                f"(a positive integer); add it to the checkpoint's config.json."
            )
    for name in _REQUIRED_INT_FIELDS + _OPTIONAL_INT_FIELDS:
        if cfg.get(name) is None:
            continue
        if not _is_int(cfg[name]) or cfg[name] <= 0:
            raise OuroConfigError(
                f"Ouro config.json field '{name}' must be a positive integer, "
                f"got {cfg[name]!r}."
            )
    for name in _OPTIONAL_FLOAT_FIELDS:
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise OuroConfigError(
                f"Ouro config.json field '{name}' must be a non-negative number, "
                f"got {value!r}."
            )
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise OuroConfigError(
            f"Ouro config.json field 'num_key_value_heads' ({kv_heads}) must "
            f"divide 'num_attention_heads' ({heads})."
        )
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise OuroConfigError(
            f"Ouro config.json field 'hidden_size' ({cfg['hidden_size']}) must be "
            f"a multiple of 'num_attention_heads' ({heads}), or set 'head_dim'."
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise OuroConfigError(
            f"Ouro config.json field 'hidden_act' must be 'silu', got {act!r}."
        )
    threshold = cfg.get("early_exit_threshold")
    if threshold is not None and threshold > 1.0:
        raise OuroConfigError(
            f"Ouro config.json field 'early_exit_threshold' must be in [0, 1], "
            f"got {threshold!r}."
        )


class OuroConfig(PretrainedConfig):
    """Configuration of an Ouro looped decoder (``model_type: "ouro"``)."""

    model_type = "ouro"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 49152,
        hidden_size: int = 2048,
        intermediate_size: int = 5632,
        num_hidden_layers: int = 24,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 65536,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1000000.0,
        rope_scaling: dict | None = None,
        total_ut_steps: int = 4,
        early_exit_threshold: float = 1.0,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.total_ut_steps = total_ut_steps
        self.early_exit_threshold = early_exit_threshold
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        # Remote-code pointers of real checkpoints are meaningless here.
        kwargs.pop("auto_map", None)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        validate_ouro_config_dict(config_dict)
        return super().from_dict(config_dict, **kwargs)
