"""A plain-PyTorch Ouro: the independent oracle.

No vLLM code is used here. The model runs whole sequences (no paged cache),
so loop ``t`` of every token attends to the loop-``t`` keys and values of the
tokens before it: exactly the per-loop KV planes of fixed-depth decoding.
Tests compare the vLLM model against it, the checkpoint tool writes its
weights, and the trainer trains it. Parameter names are Hugging Face's, so its
``state_dict`` is a loadable Ouro checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_loopspec.config import OuroConfig, validate_ouro_config_dict


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """Rotary tables for neox-style rotation (rotate the two halves)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    )
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [..., T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [B, T, H]. Returns (output, (k, v)) with k, v: [B, kv_heads, T, hd]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        cos, sin = cos.to(x.device), sin.to(x.device)  # [T, hd] broadcasts over [B, heads]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.num_heads // self.num_kv_heads
        kk = k.repeat_interleave(group, dim=1)
        vv = v.repeat_interleave(group, dim=1)
        scores = (q @ kk.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = scores.float().softmax(-1).to(vv.dtype) @ vv
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Two sandwich-normed residual blocks (Ouro's layer)."""

    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor):
        attn_out, kv = self.self_attn(self.input_layernorm(h), positions)
        h = h + self.input_layernorm_2(attn_out)
        h = h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))
        return h, kv


class OuroModel(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


@dataclass
class LoopTrace:
    """Everything one full-depth pass produced, per loop ``t = 0..R-1``."""

    hidden: list[torch.Tensor]  # normed exit state of loop t: [B, T, H]
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]]  # [loop][layer] -> (k, v)


class OuroReference(nn.Module):
    """Full-sequence Ouro with logits at every loop."""

    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = OuroModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- running loops -------------------------------------------------------
    def trace(self, input_ids: torch.Tensor, num_loops: int | None = None) -> LoopTrace:
        """Run loops ``0..num_loops-1`` over ``input_ids`` ([T] or [B, T])."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        loops = num_loops or self.config.total_ut_steps
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        hidden, kvs = [], []
        for _ in range(loops):
            loop_kv = []
            for layer in self.model.layers:
                h, kv = layer(h, positions)
                loop_kv.append(kv)
            h = self.model.norm(h)
            hidden.append(h)
            kvs.append(loop_kv)
        return LoopTrace(hidden=hidden, kv=kvs)

    def loop_logits(self, input_ids: torch.Tensor, num_loops: int | None = None):
        """Logits of every loop: list of [B, T, V] (float32)."""
        return [self.lm_head(h).float() for h in self.trace(input_ids, num_loops).hidden]

    def exit_probabilities(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        """Ouro's exit distribution over loops, [R, B, T]; the last loop takes the rest."""
        lambdas = [torch.sigmoid(self.model.early_exit_gate(h).squeeze(-1).float()) for h in hidden]
        remaining = torch.ones_like(lambdas[0])
        probs = []
        for t, lam in enumerate(lambdas):
            p = remaining if t == len(lambdas) - 1 else lam * remaining
            probs.append(p)
            remaining = remaining * (1 - lam)
        return torch.stack(probs)

    @torch.no_grad()
    def greedy_generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        exit_loop: int | None = None,
    ) -> list[int]:
        """Greedy continuation at full depth (or at loop ``exit_loop``, 1-based)."""
        loops = self.config.total_ut_steps
        ids = list(prompt_ids)
        out: list[int] = []
        device = self.lm_head.weight.device
        for _ in range(max_new_tokens):
            trace = self.trace(torch.tensor(ids, device=device), loops)
            h = trace.hidden[(exit_loop or loops) - 1][0, -1]
            token = int(self.lm_head(h).float().argmax())
            out.append(token)
            ids.append(token)
            if eos_token_id is not None and token == eos_token_id:
                break
        return out

    # -- checkpoints ---------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32):
        from safetensors.torch import load_file

        path = Path(path)
        cfg_dict = json.loads((path / "config.json").read_text())
        validate_ouro_config_dict(cfg_dict)
        cfg = OuroConfig.from_dict(cfg_dict)
        model = cls(cfg)
        state = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(file)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch: missing={missing} unexpected={unexpected}")
        return model.to(dtype).eval()

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        cfg = self.config.to_diff_dict()
        cfg["model_type"] = "ouro"
        cfg["architectures"] = ["OuroForCausalLM"]
        cfg["dtype"] = cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
