"""`vllm serve CKPT --speculative-config loopspec` (the bare word) streams the
native greedy text, and /metrics carries vLLM's and loopspec's counters."""

import re
import time

import pytest

from vllm_loopspec.server_process import VllmServer


def _until(check, timeout: float = 60.0):
    """Call ``check()`` until it stops raising AssertionError (worker
    snapshots reach /metrics through a flush thread, so counters lag the
    response a little); re-raise its last failure after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? ([0-9.e+-]+)$"
    values = [float(m.group(2)) for m in re.finditer(pattern, text, re.M)]
    assert values, f"{name} {labels} not in /metrics"
    return sum(values)


@pytest.fixture(scope="module")
def spec_server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("spec-server") / "serve.log"
    with VllmServer(tiny_checkpoint, "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                    "--gpu-memory-utilization", "0.5", "--speculative-config", "loopspec",
                    log_path=log) as srv:
        yield srv


@pytest.mark.slow
def test_streamed_loopspec_completion_equals_native(spec_server, oracle, tokenizer):
    prompt = "class Parser:\n    def __init__(self"
    body = {"model": spec_server.model_name(), "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    expected = oracle.greedy_generate(tokenizer(prompt)["input_ids"], 20)
    chunks = [c for c in spec_server.stream("/v1/completions", body) if c["choices"]]
    streamed = [t for c in chunks for t in (c["choices"][0].get("token_ids") or [])]
    assert streamed == expected
    # Rounds emit several tokens per engine step: fewer chunks than tokens.
    assert len([c for c in chunks if c["choices"][0].get("token_ids")]) < len(expected)
    full = spec_server.post("/v1/completions", body)
    assert full["choices"][0]["token_ids"] == expected


@pytest.mark.slow
def test_metrics_endpoint_has_spec_decode_and_loopspec_counters(spec_server):
    body = {"model": spec_server.model_name(), "prompt": "import os\n", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    spec_server.post("/v1/completions", body)
    spec_server.post("/v1/completions", {**body, "logprobs": 2, "max_tokens": 4})

    def counters_agree():
        text = spec_server.metrics()
        assert _metric(text, "vllm:spec_decode_num_drafts_total") > 0
        assert _metric(text, "vllm:spec_decode_num_draft_tokens_total") == _metric(
            text, "loopspec:drafted_tokens_total")
        assert _metric(text, "loopspec:rounds_total") > 0
        rows = [_metric(text, "loopspec:rows_per_loop_total", f'loop="{u}"') for u in range(1, 5)]
        assert rows[0] > 0 and rows == [rows[0]] * 4
        assert _metric(text, "loopspec:skipped_rows_total", 'reason="logprobs"') >= 3

    _until(counters_agree)
