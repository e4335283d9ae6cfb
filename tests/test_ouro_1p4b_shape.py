"""Ouro-1.4B's exact shape loads in vLLM (random weights) and generates.

The size check counts each linear layer by its declared input and output
sizes: on AVX-512 CPUs vLLM hands linear weights to oneDNN and leaves empty
``weight`` parameters behind, so ``parameters()`` would measure vLLM's kernel
choice instead of the model."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

SCRIPT = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.linear import LinearBase
from vllm_loopspec.engine_internals import model_runner


def declared_parameters(model):
    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            total += module.input_size * module.output_size
            total += module.output_size if getattr(module, "bias", None) is not None else 0
        else:
            total += sum(p.numel() for p in module.parameters(recurse=False))
    return total


if __name__ == "__main__":
    llm = LLM(sys.argv[1], load_format="dummy", dtype="bfloat16", max_model_len=128,
              max_num_seqs=2, skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=0.5)
    runner = model_runner(llm)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}],
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                      detokenize=False), use_tqdm=False)
    print("RESULT " + json.dumps({"tokens": list(out[0].outputs[0].token_ids),
                                  "kv_layers": len(runner.kv_caches),
                                  "params": declared_parameters(runner.model)}))
"""


@pytest.mark.slow
def test_ouro_1p4b_shape_generates(tmp_path):
    ckpt = tmp_path / "ouro-1.4b"
    ckpt.mkdir()
    shutil.copy(CONFIGS / "ouro-1.4b.config.json", ckpt / "config.json")
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(ckpt)], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert len(result["tokens"]) == 4
    assert result["kv_layers"] == 24 * 4
    assert 1.3e9 < result["params"] < 1.5e9
