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


@torch.no_grad()
def test_eval_json_describes_the_shipped_weights(model):
    """eval.json's teacher-forced figures are recomputed on every 8th of its
    256 held-out windows (4 s instead of a minute); a subset estimates the
    full-set means, so the tolerances are a few standard errors wide. A file
    recorded from other weights or another split misses them."""
    from vllm_loopspec.training.data import held_out_windows
    from vllm_loopspec.training.evaluate import held_out_stream, teacher_forced

    recorded = json.loads((CKPT / "eval.json").read_text())
    tf = recorded["teacher_forced"]
    stream = held_out_stream(CKPT)
    assert stream.size == recorded["held_out"]["stream_tokens"]
    windows = torch.from_numpy(held_out_windows(stream, recorded["held_out"]["context"] + 1, 256))
    got = teacher_forced(model, windows[::8])
    assert got["loss_per_loop"] == pytest.approx(tf["loss_per_loop"], abs=0.15)
    assert got["next_token_accuracy_per_loop"] == pytest.approx(tf["next_token_accuracy_per_loop"], abs=0.02)
    assert got["mean_exit_probability_per_loop"] == pytest.approx(tf["mean_exit_probability_per_loop"], abs=0.02)
    for d, agreement in tf["argmax_agreement_with_loop_R"].items():
        assert got["argmax_agreement_with_loop_R"][d] == pytest.approx(agreement, abs=0.03), d


def test_simulated_tokens_per_round_counts_rounds():
    """The evaluation's acceptance simulation on hand-checked rows, K=2.
    Row ``1 1 0 1``: a round accepts positions 0-1 and emits 3 (the bonus
    covers position 2), the next accepts position 3 and emits 2. Row
    ``1 1 1 1`` tiles the same way: 4 rounds, 10 tokens."""
    from vllm_loopspec.training.evaluate import mean_tokens_per_round

    agree = np.array([[1, 1, 0, 1], [1, 1, 1, 1]], dtype=bool)
    assert mean_tokens_per_round(agree, 2) == pytest.approx(10 / 4)
    assert mean_tokens_per_round(np.zeros((1, 3), dtype=bool), 4) == 1.0
