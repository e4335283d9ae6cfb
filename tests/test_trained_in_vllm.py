"""The shipped trained checkpoint in vLLM: greedy output equals the oracle's,
and loopspec on it equals native decoding with real (non-trivial) acceptance."""

from pathlib import Path

import pytest
from vllm import SamplingParams

from conftest import make_llm
from engine_access import model_runner

CKPT = Path(__file__).resolve().parents[1] / "checkpoints" / "ouro-stdlib"
PROMPTS = [
    'def read_config(path):\n    """Read',
    "class Config:\n    def __init__(self, path):\n        self.",
    "        if not isinstance(value, str):\n            raise TypeError(",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
]

pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no trained checkpoint")


@pytest.fixture(scope="module")
def trained_native():
    llm = make_llm(CKPT)
    return llm


@pytest.fixture(scope="module")
def trained_loopspec():
    llm = make_llm(CKPT, {"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2, "adaptive": False})
    return llm


def test_vllm_equals_oracle_on_trained_checkpoint(trained_native):
    import torch
    from transformers import AutoTokenizer

    from vllm_loopspec.reference import OuroReference

    oracle = OuroReference.from_pretrained(CKPT, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(CKPT))
    outs = trained_native.generate(PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                   use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == oracle.greedy_generate(tok(prompt)["input_ids"], 24)


def test_loopspec_equals_native_on_trained_checkpoint(trained_native, trained_loopspec):
    params = SamplingParams(max_tokens=61, temperature=0)  # EOS allowed: natural stops
    native = [list(o.outputs[0].token_ids) for o in trained_native.generate(PROMPTS, params, use_tqdm=False)]
    spec = [list(o.outputs[0].token_ids) for o in trained_loopspec.generate(PROMPTS, params, use_tqdm=False)]
    assert spec == native
    stats = model_runner(trained_loopspec).drafter.stats
    # A trained model's shallow loops agree with its deep ones often, not always.
    assert 0.3 < stats.accepted_tokens / stats.drafted_tokens < 0.98
