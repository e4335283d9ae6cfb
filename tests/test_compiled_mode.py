"""vLLM's default (compiled) mode on CPU: a loopspec engine's plain steps run
vLLM's compiled forward, its rounds the compiled tick (``OuroTick``, one
graph for every loop, its loop groups dispatched at run time), and greedy
output is still native's (the native engine compiled too)."""

import pytest
from vllm import SamplingParams

from conftest import make_llm
from engine_access import model_runner
from prompts import MEDIUM, SHORT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled_pair(tiny_checkpoint):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("loopspec engines run eagerly on CUDA until rounds are captured in CUDA graphs")
    native = make_llm(tiny_checkpoint, enforce_eager=False)
    spec = make_llm(tiny_checkpoint, {"method": "loopspec"}, enforce_eager=False)
    return native, spec


def test_compiled_loopspec_equals_compiled_native(compiled_pair):
    native, spec = compiled_pair
    assert spec.llm_engine.vllm_config.compilation_config.mode != 0
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = SHORT + MEDIUM
    for batch in (prompts[:8], prompts[8:16], prompts[:1], prompts[9:10]):
        want = [list(o.outputs[0].token_ids) for o in native.generate(batch, params, use_tqdm=False)]
        got = [list(o.outputs[0].token_ids) for o in spec.generate(batch, params, use_tqdm=False)]
        assert got == want
    runner = model_runner(spec)
    tick = runner.model.model.tick
    assert not tick.do_not_compile  # rounds ran the compiled tick, compiled at startup
    assert tick.compiled or getattr(tick, "aot_compiled_fn", None) is not None
    drafter = runner.drafter
    assert drafter.stats.rounds > 0 and 0 < drafter.stats.accepted_tokens < drafter.stats.drafted_tokens
    assert any(max(r.drafts, default=0) == 0 for r in drafter.controller.history)  # plain steps too
