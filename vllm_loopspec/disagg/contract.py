"""The P→D handoff contract: what a prefill and a decode instance must agree
on before the decode side may pull the prefill side's KV.

Ouro's KV is ``N×R`` attention layers per block (layer ``i`` at loop ``u`` is
``model.layers.{u*N+i}``); the decode side writes the pulled bytes into its own
layers by index. So both sides must serve the same model, with the same loop
count ``R`` (``total_ut_steps``), layer count ``N``, KV head shape, block size
and KV dtype. vLLM's ``NixlConnector`` checks a hash of most of these, but only
at the first request's handshake, and its hash counts ``N`` alone (not ``R``).
The launcher checks the contract twice before the first user request:

1. from the arguments each side is started with (:func:`contract_from_args`,
   vLLM's own argument parser and model-config resolution; no engine), before
   any engine starts;
2. from the running servers (:func:`contract_from_server`: the served
   ``config.json`` and ``vllm:cache_config_info`` on ``/metrics``), then one
   warm-up handoff whose KV must arrive by transfer.

The decode side's loopspec options are its own: they are not in the contract.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

# The fields, in the order a refusal names them.
FIELDS = ("model", "architecture", "total_ut_steps", "num_hidden_layers", "num_kv_heads", "head_dim",
          "block_size", "kv_dtype")


class HandoffContractError(RuntimeError):
    """Prefill and decode cannot be paired; the message names each mismatch."""


def _model_identity(model: str) -> str:
    """A local checkpoint by its resolved path, a hub model by its name."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def _from_hf_config(cfg: Any) -> dict[str, Any]:
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    heads = get("num_attention_heads")
    return {
        "architecture": (get("architectures") or ["?"])[0],
        "total_ut_steps": get("total_ut_steps"),
        "num_hidden_layers": get("num_hidden_layers"),
        "num_kv_heads": get("num_key_value_heads") or heads,
        "head_dim": get("head_dim") or (get("hidden_size") // heads if heads else None),
    }


def contract_from_args(model: str, serve_args: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The contract of ``vllm serve MODEL SERVE_ARGS``, resolved the way vLLM
    resolves it (dtype ``auto``, hf overrides), without starting an engine.
    ``block_size`` is ``None`` when left to the platform's default (the same
    on both sides of one launcher)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_loopspec import register

    register()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", str(model), *serve_args]))
    model_config = engine_args.create_model_config()
    kv_dtype = engine_args.kv_cache_dtype
    if kv_dtype in (None, "auto"):
        kv_dtype = str(model_config.dtype).removeprefix("torch.")
    return {"model": _model_identity(str(model)), **_from_hf_config(model_config.hf_config),
            "block_size": engine_args.block_size, "kv_dtype": kv_dtype}


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def cache_config_info(metrics_text: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (vLLM's CacheConfig as a gauge)."""
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", metrics_text, re.M)
    if not m:
        raise HandoffContractError("the server's /metrics has no vllm:cache_config_info; start it without "
                                   "--disable-log-stats")
    return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))


def contract_from_server(url: str) -> dict[str, Any]:
    """The contract a running ``vllm serve`` reports: ``/v1/models`` names the
    served checkpoint (its ``root``), whose ``config.json`` gives the shape;
    ``/metrics`` gives the block size and KV cache dtype. A KV dtype of
    ``auto`` (the model's dtype) is reported as ``auto``: the argument check
    resolves it."""
    card = json.loads(_get(url + "/v1/models"))["data"][0]
    root = card.get("root") or card["id"]
    cfg_path = Path(root) / "config.json"
    shape = _from_hf_config(json.loads(cfg_path.read_text())) if cfg_path.exists() else {}
    info = cache_config_info(_get(url + "/metrics").decode())
    return {"model": _model_identity(root), **shape, "block_size": int(info["block_size"]),
            "kv_dtype": info.get("cache_dtype", "auto")}


def mismatches(prefill: dict[str, Any], decode: dict[str, Any]) -> list[str]:
    return [f"{k}: prefill {prefill.get(k)!r} != decode {decode.get(k)!r}" for k in FIELDS
            if k in prefill and k in decode and prefill[k] != decode[k]]


def check_pair(prefill: dict[str, Any], decode: dict[str, Any], where: str) -> None:
    """Raise :class:`HandoffContractError` naming every field that differs."""
    bad = mismatches(prefill, decode)
    if bad:
        raise HandoffContractError(
            f"the decode instance refuses this prefill instance ({where}): "
            + "; ".join(bad)
            + ". Ouro's KV moves as N x R layers per block, so both sides must serve the same checkpoint "
              "with the same --dtype/--kv-cache-dtype/--block-size (loopspec options may differ).")
