"""The plugin loads through its entry point and vLLM sees N*R KV layers."""

import subprocess
import sys

import pytest

from engine_access import engine_core, served_model


def _passes_in_fresh_process(code: str) -> None:
    """Run ``code`` in a new interpreter; it must exit 0 and print ``ok`` last."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_entry_point_registers_in_fresh_process():
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm import ModelRegistry\n"
        "from transformers import AutoConfig\n"
        "assert 'OuroForCausalLM' in ModelRegistry.get_supported_archs()\n"
        "from vllm.transformers_utils.config import _CONFIG_REGISTRY\n"
        "assert _CONFIG_REGISTRY['ouro'].__name__ == 'OuroConfig'\n"
        "load_general_plugins()  # idempotent\n"
        "print('ok')\n"
    )
    _passes_in_fresh_process(code)


def test_loopspec_modules_leave_torch_unpatched_outside_cpu_engines():
    """vLLM's CPU worker module patches torch for the whole process when it is
    imported (``vllm.v1.worker.cpu.shm``: CUDA streams and events become
    placeholders, ``pin_memory`` a no-op, device memory the CPU's). On a CUDA
    host a process that imported it could run no CUDA engine (the first GPU
    run, 2026-12-04): only the CPU worker's own module may import it."""
    code = (
        "import sys, torch\n"
        "pin = torch.Tensor.pin_memory\n"
        "from vllm_loopspec import register\n"
        "register()\n"
        "import vllm_loopspec.patches, vllm_loopspec.speculative.runner, vllm_loopspec.speculative.drafter\n"
        "import vllm_loopspec.speculative.debug, vllm_loopspec.speculative.gpu_worker\n"
        "assert 'vllm.v1.worker.cpu_worker' not in sys.modules, 'imported vLLM CPU worker'\n"
        "assert torch.Tensor.pin_memory is pin\n"
        "import vllm_loopspec.speculative.cpu_worker\n"
        "assert torch.Tensor.pin_memory is not pin  # the check sees the patch\n"
        "print('ok')\n"
    )
    _passes_in_fresh_process(code)


def test_register_is_idempotent():
    """vLLM calls the entry point in every process, possibly more than once:
    a second call must leave the registrations and every patched vLLM
    function as they are (a re-wrapped patch would run twice per call)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs
    from vllm.transformers_utils.config import _CONFIG_REGISTRY
    from vllm.triton_utils import dispatcher
    from vllm.v1.sample.ops import topk_topp_sampler

    from vllm_loopspec import register
    from vllm_loopspec.config import OuroConfig

    def patched():
        return (EngineArgs.add_cli_args, EngineArgs.create_speculative_config, dispatcher._rebind_kernels,
                topk_topp_sampler.apply_top_k_only)

    register()
    before = patched()
    register()
    register()
    assert patched() == before
    assert "OuroForCausalLM" in ModelRegistry.get_supported_archs()
    assert _CONFIG_REGISTRY["ouro"] is OuroConfig
    assert AutoConfig.for_model("ouro").__class__ is OuroConfig


def test_engine_allocates_one_kv_layer_per_loop_and_layer(native_llm, tiny_checkpoint):
    cfg = served_model(native_llm).config
    n, r = cfg.num_hidden_layers, cfg.total_ut_steps
    kv_cfg = engine_core(native_llm).scheduler.kv_cache_config
    names = sorted(
        name for group in kv_cfg.kv_cache_groups for name in group.layer_names
    )
    expected = sorted(f"model.layers.{u * n + i}.self_attn.attn" for u in range(r) for i in range(n))
    assert names == expected
    assert len(kv_cfg.kv_cache_groups) == 1, "all loops must share one KV group"


def test_engines_start_after_an_ngram_engine_imported_numba(tiny_checkpoint, native_llm):
    """Patch 4: vLLM's kernel-override scan crashed on llvmlite's ``lib`` once
    numba was imported, so no engine could start after an ngram engine.
    Patch 3 reaches non-loopspec engines too: after the ngram engine's worker
    registered the CPU kernel overrides, vLLM's own ``expand_batch_to_tokens``
    (per-token temperature/top-p of the rejection sampler) expands floats."""
    import torch
    from conftest import make_llm
    from vllm import SamplingParams
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    ngram = make_llm(tiny_checkpoint, {"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert "llvmlite" in sys.modules
    expanded = expand_batch_to_tokens(torch.tensor([0.7, 1.3]), torch.tensor([2, 5]), 5)
    assert expanded.tolist() == pytest.approx([0.7, 0.7, 1.3, 1.3, 1.3])
    after = make_llm(tiny_checkpoint)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["a b c a b c a b", "def f(x):\n    return"]
    expected = [o.outputs[0].token_ids for o in native_llm.generate(prompts, params, use_tqdm=False)]
    for llm in (ngram, after):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
