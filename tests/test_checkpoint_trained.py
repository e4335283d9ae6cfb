"""The shipped trained checkpoint (checkpoints/ouro-stdlib): integrity and quality.

CPU only, no vLLM engine; runs in a few seconds. Set ``LOOPSPEC_TRAINED_CKPT``
to check another directory written by ``vllm_loopspec.training``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
CKPT = Path(os.environ.get("LOOPSPEC_TRAINED_CKPT", REPO / "checkpoints" / "ouro-stdlib"))
PROMPT = 'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the command line and'

pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason=f"no checkpoint at {CKPT}")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model():
    from vllm_loopspec.reference import OuroReference

    # one thread: these are small ops, and OpenMP threads that spin at barriers
    # crawl when the CPU is shared with other jobs
    torch.set_num_threads(1)
    return OuroReference.from_pretrained(CKPT, dtype=torch.float32)


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(CKPT / "tokenizer.json"))


def test_files_match_sha256_listed_in_card():
    listed = json.loads((CKPT / "sha256.json").read_text())
    shipped = {p.name for p in CKPT.iterdir() if p.is_file()} - {"sha256.json"}
    assert shipped == set(listed), f"unlisted or missing files: {shipped ^ set(listed)}"
    for name, digest in listed.items():
        assert _sha(CKPT / name) == digest, f"{name} does not match sha256.json"
    # the card's own table lists the same hashes for every other file
    card = (CKPT / "README.md").read_text()
    table = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \|$", card, flags=re.M))
    assert table == {k: v for k, v in listed.items() if k != "README.md"}


def test_config_weights_and_tokenizer(tok):
    from safetensors import safe_open

    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["model_type"] == "ouro"
    assert cfg["architectures"] == ["OuroForCausalLM"]
    assert cfg["eos_token_id"] == 0
    weights = CKPT / "model.safetensors"
    assert weights.stat().st_size <= 25 * 1024 * 1024
    with safe_open(str(weights), "pt") as f:
        for name in f.keys():
            assert f.get_slice(name).get_dtype() == "BF16", name
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.get_vocab_size() == cfg["vocab_size"]
    tcfg = json.loads((CKPT / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|endoftext|>"


def test_greedy_generation_is_not_degenerate(model, tok):
    from vllm_loopspec.training.fast import CachedGreedy

    prompt = tok.encode(PROMPT).ids
    out = model.greedy_generate(prompt, 48)
    assert len(out) == 48
    assert len(set(out)) > 8, tok.decode(out)
    # no single token repeated for the whole run (nor for its second half)
    assert len(set(out[24:])) > 1, tok.decode(out)
    # the batched KV-cached decoder the evaluation uses reproduces the oracle
    cached, _ = CachedGreedy(model).generate(torch.tensor([prompt]), 48)
    assert cached[0].tolist() == out


def _held_out_slice(tok, windows: int = 4, length: int = 193) -> torch.Tensor:
    from vllm_loopspec.training.data import split_files

    _, held = split_files()
    ids: list[int] = []
    for path in held[:6]:
        ids += tok.encode(path.read_text(encoding="utf-8")).ids + [0]
    arr = np.asarray(ids, dtype=np.int64)
    starts = np.linspace(0, arr.size - length - 1, windows).astype(np.int64)
    return torch.from_numpy(np.stack([arr[s: s + length] for s in starts]))


@torch.no_grad()
def test_last_loop_beats_first_loop_on_held_out(model, tok):
    from vllm_loopspec.training.fast import fast_trace

    w = _held_out_slice(tok)
    inputs, targets = w[:, :-1], w[:, 1:]
    trace = model.trace(inputs)
    losses = [
        float(F.cross_entropy(model.lm_head(h).float().flatten(0, 1), targets.flatten()))
        for h in trace.hidden
    ]
    assert losses[-1] < losses[0] - 0.05, losses
    # the trainer's fused forward is the oracle's computation
    for a, b in zip(trace.hidden, fast_trace(model, inputs)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_eval_json_is_consistent():
    ev = json.loads((CKPT / "eval.json").read_text())
    cfg = json.loads((CKPT / "config.json").read_text())
    R = cfg["total_ut_steps"]
    tf, gen = ev["teacher_forced"], ev["greedy_continuations"]
    assert len(tf["loss_per_loop"]) == R
    assert tf["loss_per_loop"][-1] < tf["loss_per_loop"][0]
    for d in range(1, R):
        assert 0.0 < tf["argmax_agreement_with_loop_R"][str(d)] < 1.0
        assert 0.0 < gen["argmax_agreement_with_loop_R"][str(d)] <= 1.0
    assert gen["cached_decoder_matches_oracle_greedy_generate"] is True
