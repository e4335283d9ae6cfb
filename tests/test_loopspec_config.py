"""How users turn loopspec on, and the setups it refuses (with what to do),
all before an engine starts."""

import json
import os
import subprocess
import sys

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm.platforms import current_platform

from vllm_loopspec.patches import (
    CPU_WORKER_CLASS,
    GPU_WORKER_CLASS,
    DEBUG_DRAFTER_CLASS,
    DRAFTER_CLASS,
    parse_speculative_config_arg,
)

# The loopspec worker of this host's platform (vLLM's CPU or GPU worker underneath).
EXPECTED_WORKER = CPU_WORKER_CLASS if current_platform.is_cpu() else GPU_WORKER_CLASS
# The suite runs engines with the debug drafter (tests/conftest.py).
EXPECTED_DRAFTER = DEBUG_DRAFTER_CLASS if os.environ.get("VLLM_LOOPSPEC_DEBUG") == "1" else DRAFTER_CLASS


def _config(ckpt, spec, **kw):
    args = dict(model=str(ckpt), dtype="float32", max_model_len=256, speculative_config=spec)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def test_bare_word_and_json_translate_to_vllm_custom_class(tiny_checkpoint):
    """vLLM reserves the most drafts a step can make: K when the policy is
    pinned (a round), max_speculative_tokens when it adapts (default 16:
    the default schedule "auto" pipelines up to that many slots)."""
    for spec, slots, d, adaptive in [
            ({"method": "loopspec"}, 16, 2, True),
            ({"method": "loopspec", "num_speculative_tokens": 8, "draft_loops": 3}, 16, 3, True),
            ({"method": "loopspec", "num_speculative_tokens": 12}, 16, 2, True),
            ({"method": "loopspec", "schedule": "round"}, 8, 2, True),
            ({"method": "loopspec", "num_speculative_tokens": 2, "max_speculative_tokens": 6}, 6, 2, True),
            ({"method": "loopspec", "num_speculative_tokens": 4, "adaptive": False}, 4, 2, False),
            ({"method": "loopspec", "draft_loops": "auto"}, 16, 2, True),
            ({"method": "loopspec", "schedule": "auto"}, 16, 2, True),
            ("loopspec", 16, 2, True)]:
        cfg = _config(tiny_checkpoint, spec)
        assert cfg.speculative_config.method == "custom_class"
        assert cfg.speculative_config.model == EXPECTED_DRAFTER
        assert cfg.speculative_config.num_speculative_tokens == slots
        assert cfg.additional_config["loopspec"]["draft_loops"] == d
        assert cfg.additional_config["loopspec"]["adaptive"] is adaptive
        schedule = spec.get("schedule", "auto" if adaptive else "round") if isinstance(spec, dict) else "auto"
        assert cfg.additional_config["loopspec"]["schedule"] == schedule
        assert cfg.parallel_config.worker_cls == EXPECTED_WORKER


def test_auto_schedule_defaults_its_second_proposal_where_the_model_allows_one(tiny_checkpoint):
    """With "auto" a pipelined step refines at 2 d where 2 d < R (R = 4 here)."""
    for spec, d2 in [({"schedule": "auto", "draft_loops": 1}, 2),
                     ({"schedule": "auto", "draft_loops": 1, "second_proposal_loop": 3}, 3),
                     ({"schedule": "auto", "draft_loops": 2}, None),
                     ({"schedule": "pipelined", "draft_loops": 1}, None)]:
        options = _config(tiny_checkpoint, {"method": "loopspec", **spec}).additional_config["loopspec"]
        assert options["second_proposal_loop"] == d2
        assert options["adaptive"] is (spec["schedule"] == "auto")


def test_draft_loops_as_a_list_lets_auto_choose_each_steps_depth(tiny_checkpoint):
    """A list of depths: sorted, the smallest is draft_loops, and each
    depth's pipelined steps refine at 2 d where 2 d < R (R = 4 here)."""
    options = _config(tiny_checkpoint, {"method": "loopspec", "draft_loops": [2, 1]}).additional_config["loopspec"]
    assert options["schedule"] == "auto" and options["draft_loops"] == 1
    assert list(options["draft_depths"]) == [1, 2]
    assert list(options["depth_second_proposal_loops"]) == [2, None]
    assert options["second_proposal_loop"] is None


def test_loopspec_engines_keep_vllms_compile_mode_on_cpu(tiny_checkpoint):
    """On CPU a loopspec engine compiles like a native one (its plain steps
    run vLLM's compiled forward; rounds run their loop ranges eagerly). On
    CUDA it is configured eager (with a warning) until rounds are captured
    in CUDA graphs."""
    from vllm.platforms import current_platform

    native = EngineArgs(model=str(tiny_checkpoint), dtype="float32", max_model_len=256).create_engine_config()
    assert not native.model_config.enforce_eager and native.compilation_config.mode != 0
    spec = _config(tiny_checkpoint, "loopspec")
    if current_platform.is_cpu():
        assert not spec.model_config.enforce_eager
        assert spec.compilation_config.mode == native.compilation_config.mode
    else:
        assert spec.model_config.enforce_eager and spec.compilation_config.mode == 0


def test_async_scheduling_is_kept_for_loopspec_and_off_by_default(tiny_checkpoint):
    """vLLM refuses --async-scheduling for custom_class methods and the CPU
    platform switches it off; a loopspec engine that asks for it keeps it
    (patch 14), one that does not stays synchronous."""
    from vllm.config import VllmConfig

    config = _config(tiny_checkpoint, "loopspec", async_scheduling=True)
    assert config.scheduler_config.async_scheduling is True
    assert config.scheduler_config.get_scheduler_cls().__name__ == "AsyncScheduler"
    VllmConfig.__post_init__(config)  # the engine core validates again after its handshake
    assert config.scheduler_config.async_scheduling is True
    assert not _config(tiny_checkpoint, "loopspec").scheduler_config.async_scheduling


def test_cli_parses_bare_word():
    assert parse_speculative_config_arg("loopspec") == {"method": "loopspec"}
    assert parse_speculative_config_arg('{"method":"loopspec","draft_loops":1}') == {
        "method": "loopspec", "draft_loops": 1}
    assert parse_speculative_config_arg('{"method":"ngram","num_speculative_tokens":3}')["method"] == "ngram"


@pytest.mark.parametrize(
    "spec, kwargs, words",
    [
        ({"method": "loopspec", "num_speculative_tokens": 0}, {}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "loopspec", "num_speculative_tokens": 129}, {}, "exceeds vLLM's rejection sampler limit"),
        ({"method": "loopspec", "draft_loops": 4}, {}, "1 <= draft_loops < total_ut_steps (4)"),
        ({"method": "loopspec", "draft_loops": "deep"}, {}, 'must be "auto" or an integer'),
        ({"method": "loopspec", "adaptive": "yes"}, {}, "adaptive must be true or false"),
        ({"method": "loopspec", "num_speculative_tokens": 6, "max_speculative_tokens": 4}, {},
         "num_speculative_tokens (6) <= max_speculative_tokens"),
        ({"method": "loopspec", "max_speculative_tokens": 129}, {}, "max_speculative_tokens <= 128"),
        ({"method": "loopspec", "adaptive": False, "max_speculative_tokens": 8}, {},
         "drop max_speculative_tokens or set \"adaptive\": true"),
        ({"method": "loopspec", "draft_loops": 0}, {}, "1 <= draft_loops < total_ut_steps (4)"),
        ({"method": "loopspec", "K": 4}, {}, "unknown loopspec option(s) ['K']"),
        ({"method": "loopspec", "schedule": "wavefront"}, {},
         "schedule must be one of ['round', 'pipelined', 'auto']"),
        ({"method": "loopspec", "schedule": "auto", "adaptive": False}, {},
         'drop "adaptive": false, or pin a schedule'),
        ({"method": "loopspec", "schedule": "auto", "draft_loops": 2, "second_proposal_loop": 3}, {},
         "must be a multiple of draft_loops (2)"),
        ({"method": "loopspec", "schedule": "pipelined", "adaptive": True}, {},
         'drop "adaptive" (or set it to false) with "pipelined"'),
        ({"method": "loopspec", "schedule": "round", "second_proposal_loop": 3}, {}, 'add "schedule": "pipelined"'),
        ({"method": "loopspec", "schedule": "pipelined", "draft_loops": 2, "second_proposal_loop": 3}, {},
         "must be a multiple of draft_loops (2)"),
        ({"method": "loopspec", "schedule": "round", "adaptive": False, "draft_loops": [1, 2]}, {},
         'with "schedule": \'round\' give one integer'),
        ({"method": "loopspec", "draft_loops": [1, 1]}, {}, "distinct integers with 1 <= d < total_ut_steps (4)"),
        ({"method": "loopspec", "draft_loops": [1, 4]}, {}, "distinct integers with 1 <= d < total_ut_steps (4)"),
        ({"method": "loopspec", "draft_loops": [1, 2], "second_proposal_loop": 2}, {},
         "drop second_proposal_loop, or give draft_loops as one integer"),
        ({"method": "loopspec"}, {"worker_cls": "some.other.Worker"}, "remove --worker-cls"),
        ({"method": "loopspec"}, {"hf_overrides": {"early_exit_threshold": 0.5}}, "needs fixed-depth decoding"),
    ],
)
def test_refused_setups_say_what_to_change(tiny_checkpoint, spec, kwargs, words):
    with pytest.raises(Exception) as err:
        _config(tiny_checkpoint, spec, **kwargs)
    assert words in str(err.value)


def test_non_ouro_model_is_refused(tmp_path):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 512}))
    with pytest.raises(Exception) as err:
        _config(llama, {"method": "loopspec"})
    assert "loopspec needs an Ouro looped model" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value)


@pytest.mark.slow
def test_vllm_serve_refuses_before_listening(tiny_checkpoint):
    """The CLI exits with the message, without binding a port."""
    from vllm_loopspec.server_process import free_port, vllm_command

    port = free_port()
    out = subprocess.run(
        [vllm_command(), "serve", str(tiny_checkpoint), "--port", str(port),
         "--speculative-config", '{"method":"loopspec","draft_loops":7}'],
        capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "1 <= draft_loops < total_ut_steps (4)" in out.stderr + out.stdout
    assert "Uvicorn running" not in out.stderr + out.stdout


def test_cpu_expand_kernel_fix_handles_floats_and_ints():
    """vLLM 0.32's CPU fallback returns garbage for float inputs (see
    patches.fix_cpu_expand_kernel); ours expands both."""
    import torch

    from vllm_loopspec.patches import expand_batch_to_tokens_cpu

    out = torch.empty(5)
    expand_batch_to_tokens_cpu(out, torch.tensor([0.7, -1.0, 1.3]), torch.tensor([2, 4, 5]), -1, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.3])
    out_i = torch.empty(4, dtype=torch.int64)
    expand_batch_to_tokens_cpu(out_i, torch.tensor([5, 0]), torch.tensor([1, 4]), 0, 9)
    assert out_i.tolist() == [5, 9, 9, 9]
