"""Write an Ouro-format checkpoint with random weights.

    python -m vllm_loopspec.tools.make_checkpoint --preset tiny OUT

Presets: ``tiny`` (small enough for tests; GQA on, 4 loops) and ``ouro-1.4b``
(Ouro-1.4B's exact shape, for load and cost tests; several GB of weights, so
prefer vLLM's ``load_format="dummy"`` with ``--config-only``). Weights are
drawn with scales that give well-separated logits, so greedy decoding is not
decided by rounding noise when comparing implementations.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from vllm_loopspec.config import OuroConfig
from vllm_loopspec.reference import OuroReference
from vllm_loopspec.tools.tokenizer import save_tokenizer, stdlib_files, read_texts, train_bpe

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"

PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        total_ut_steps=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    ),
    # A 16-token vocabulary: exact distributions are cheap to enumerate, for
    # statistical tests of sampled speculation. No tokenizer (pass token ids).
    "tiny-v16": dict(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        total_ut_steps=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    ),
}

# Below this size a BPE over bytes makes no sense; such presets ship no tokenizer.
MIN_TOKENIZER_VOCAB = 300


def preset_config(name: str) -> OuroConfig:
    if name in PRESETS:
        return OuroConfig(**PRESETS[name])
    path = CONFIG_DIR / f"{name}.config.json"
    if not path.exists():
        known = sorted(PRESETS) + sorted(p.name.removesuffix(".config.json") for p in CONFIG_DIR.glob("*.config.json"))
        raise SystemExit(f"unknown preset {name!r}; choose one of {known}")
    return OuroConfig.from_dict(json.loads(path.read_text()))


@torch.no_grad()
def init_random(model: OuroReference, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("layernorm_2.weight") or name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.zero_()
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name == "lm_head.weight":
            p.copy_(torch.randn(p.shape, generator=gen) * (3.0 / math.sqrt(p.shape[1])))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def make_checkpoint(out: Path, preset: str = "tiny", seed: int = 0, config_only: bool = False,
                    dtype: torch.dtype = torch.float32, tokenizer_files: int = 200) -> Path:
    cfg = preset_config(preset)
    out.mkdir(parents=True, exist_ok=True)
    if config_only:
        d = cfg.to_dict()
        d["architectures"] = ["OuroForCausalLM"]
        (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    else:
        torch.manual_seed(seed)
        model = OuroReference(cfg)
        init_random(model, seed)
        model.save_pretrained(out, dtype=dtype)
    if MIN_TOKENIZER_VOCAB <= cfg.vocab_size <= 8192:
        tok = train_bpe(read_texts(stdlib_files(tokenizer_files)), cfg.vocab_size)
        save_tokenizer(tok, out, cfg.max_position_embeddings)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--config-only", action="store_true", help="write config.json only (use with load_format=dummy)")
    args = ap.parse_args()
    make_checkpoint(args.out, args.preset, args.seed, args.config_only, getattr(torch, args.dtype))
    print(args.out)


if __name__ == "__main__":
    main()
