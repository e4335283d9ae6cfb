"""`vllm serve CKPT --speculative-config loopspec` (the bare word) streams the
native greedy text, and /metrics carries vLLM's and loopspec's counters."""

import re
import time

import pytest

from engine_access import until
from vllm_loopspec.server_process import VllmServer


def _metric_or_zero(text: str, name: str, labels: str = "") -> float:
    """Counters before this server's first request (a labelled one appears
    on /metrics only once its label was counted) read as 0."""
    try:
        return _metric(text, name, labels)
    except AssertionError:
        return 0.0


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? ([0-9.e+-]+)$"
    values = [float(m.group(2)) for m in re.finditer(pattern, text, re.M)]
    assert values, f"{name} {labels} not in /metrics"
    return sum(values)


@pytest.fixture(scope="module")
def spec_server(loopspec_server):
    return loopspec_server


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
    """Counters move together over this test's own requests (deltas: the
    server is shared, and drafts of requests aborted mid-round are counted
    by loopspec's rounds but not by vLLM's scheduler)."""
    names = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "loopspec:drafted_tokens_total", "loopspec:rounds_total", "loopspec:pipelined_steps_total"]
    rows_names = [("loopspec:rows_per_loop_total", f'loop="{u}"') for u in range(1, 5)]
    skipped = ("loopspec:skipped_rows_total", 'reason="logprobs"')

    def snapshot():
        text = spec_server.metrics()
        return ({n: _metric_or_zero(text, n) for n in names}, [_metric_or_zero(text, *r) for r in rows_names],
                _metric_or_zero(text, *skipped))

    def idle():  # earlier traffic (other tests share the server) has drained and been flushed
        text = spec_server.metrics()
        assert _metric(text, "vllm:num_requests_running") == 0 and _metric(text, "vllm:num_requests_waiting") == 0
        first = snapshot()
        time.sleep(0.5)  # > the workers' flush period
        assert snapshot() == first

    until(idle, timeout=300)
    before, rows_before, skipped_before = snapshot()
    body = {"model": spec_server.model_name(), "prompt": "import os\n", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    spec_server.post("/v1/completions", body)
    # Alone in its batch, the logprobs request decodes plainly in every step
    # after its prefill, each counted under its reason (the chooser of
    # "auto" is not asked for a batch none of whose requests may draft).
    spec_server.post("/v1/completions", {**body, "logprobs": 2, "max_tokens": 16})

    def counters_agree():
        after, rows_after, skipped_after = snapshot()
        delta = {n: after[n] - before[n] for n in names}
        assert delta["vllm:spec_decode_num_drafts_total"] > 0
        assert delta["vllm:spec_decode_num_draft_tokens_total"] == delta["loopspec:drafted_tokens_total"]
        assert delta["loopspec:rounds_total"] > 0
        rows = [a - b for a, b in zip(rows_after, rows_before)]
        assert rows[0] > 0
        if delta["loopspec:pipelined_steps_total"] == 0:
            assert rows == [rows[0]] * 4  # a round: every scheduled row through every loop
        else:
            # The default schedule ("auto") took pipelined steps: a token
            # pruned in flight stops before the deepest loops.
            assert all(a >= b for a, b in zip(rows, rows[1:])) and rows[-1] > 0, rows
        assert skipped_after - skipped_before >= 15

    until(counters_agree)
