"""P/D with the decode instance under vLLM's async scheduler (issue 15):
the prompt's KV arrives over NIXL, loopspec rounds run under async, greedy
output equals native. A deployment of its own (module scope), started
after test_disagg.py's has stopped."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import MAX_MODEL_LEN
from engine_access import until
from prompts import MEDIUM, SHORT, long_prompt

pytest.importorskip("nixl", reason="the pd extra (nixl==1.5.1) is not installed")

from test_disagg import FIXED_K, KV_LEASE_S, SERVE_ARGS, _assert_kv_freed, _completion  # noqa: E402
from vllm_loopspec.disagg import PDDeployment  # noqa: E402
from vllm_loopspec.disagg.launcher import metric_sum, prompt_tokens_by_source  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd_async(tiny_checkpoint, tmp_path_factory):
    with PDDeployment(tiny_checkpoint, serve_args=SERVE_ARGS, kv_lease_s=KV_LEASE_S,
                      log_dir=tmp_path_factory.mktemp("pd-async"), start_timeout_s=300,
                      decode_speculative_config=FIXED_K, decode_args=("--async-scheduling",),
                      env={"VLLM_LOGGING_LEVEL": "INFO"}) as deployment:  # for loopspec's startup line
        yield deployment


def test_greedy_pd_with_async_decode_equals_native(pd_async, tokenizer):
    pd = pd_async
    prompts = SHORT[:3] + MEDIUM[:1] + [long_prompt(180, tokenizer)]
    native = {p: _completion(pd.prefill, p) for p in prompts}  # the prefill instance, asked plainly
    before = pd.decode.metrics()
    for p in prompts:
        assert _completion(pd.client, p) == native[p], p[:40]
    batch = (prompts * 2)[:8]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: _completion(pd.client, p), batch))
    assert outs == [native[p] for p in batch]

    def decode_counters():
        after = pd.decode.metrics()
        assert metric_sum(after, "loopspec:rounds_total") > metric_sum(before, "loopspec:rounds_total")
        assert prompt_tokens_by_source(after)["external_kv_transfer"] > 0
        assert prompt_tokens_by_source(after)["local_compute"] == 0

    until(decode_counters, timeout=30)
    _assert_kv_freed(pd.prefill, pd.decode)
    assert "loopspec: draft loops" in pd.decode.log_path.read_text()  # the line is there...
    assert "async scheduling on" in pd.decode.log_path.read_text()  # ...and says the decode side is async
