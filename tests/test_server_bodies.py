"""Issue 10 over HTTP: `vllm serve CKPT --speculative-config loopspec` answers
every request body with a 2xx or with a 4xx that carries an error message,
never a 5xx, and keeps serving. Among the bodies: the sampled ``top_k``
request that used to kill every speculative CPU server (the engine core died
in vLLM's top-k-only mask; patch 5), its risky relatives (seeded, penalties,
n=2, streamed, chat), and malformed ones (wrong types, out-of-range values,
unknown fields, no JSON at all)."""

from __future__ import annotations

import json

import pytest
import requests

from vllm_loopspec.server_process import VllmServer

pytestmark = pytest.mark.slow

FATAL = {"prompt": "def foo(x):", "max_tokens": 30, "temperature": 0.9, "top_k": 20}
CHAT = {"messages": [{"role": "user", "content": "def foo(x):"}], "max_tokens": 20}

# (name, path, body): served, a 2xx is expected.
SERVED = [
    ("top_k_only", "/v1/completions", FATAL),
    ("top_k_only_seeded", "/v1/completions", {**FATAL, "seed": 7}),
    ("top_k_with_penalties", "/v1/completions",
     {**FATAL, "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2}),
    ("top_k_n2", "/v1/completions", {**FATAL, "n": 2, "temperature": 1.0}),
    ("top_k_streamed", "/v1/completions", {**FATAL, "stream": True}),
    ("top_k_streamed_n2_seeded", "/v1/completions", {**FATAL, "stream": True, "n": 2, "seed": 3}),
    ("top_k_logprobs", "/v1/completions", {**FATAL, "logprobs": 5}),
    ("top_k_min_tokens_stop", "/v1/completions", {**FATAL, "min_tokens": 5, "stop": ["\n", "a"]}),
    ("top_k_tiny_temperature", "/v1/completions", {**FATAL, "temperature": 1e-3}),
    ("top_k_above_vocab", "/v1/completions", {**FATAL, "top_k": 100000}),
    ("top_k_top_p", "/v1/completions", {**FATAL, "top_p": 0.9}),
    ("top_k_choice", "/v1/completions", {**FATAL, "structured_outputs": {"choice": ["yes", "no"]}}),
    ("token_id_prompt", "/v1/completions", {**FATAL, "prompt": [464, 288, 81]}),
    # vLLM refuses these with any other speculative method; loopspec decodes
    # them one token per step (their sampling cannot be verified).
    ("min_p_with_speculation", "/v1/completions", {**FATAL, "min_p": 0.1}),
    ("logit_bias_with_speculation", "/v1/completions", {**FATAL, "logit_bias": {"5": 3.0}}),
    ("chat_top_k_only", "/v1/chat/completions", {**CHAT, "temperature": 0.9, "top_k": 20}),
    ("chat_top_k_streamed", "/v1/chat/completions", {**CHAT, "temperature": 0.9, "top_k": 20, "stream": True}),
    ("chat_top_k_n2_seeded", "/v1/chat/completions", {**CHAT, "temperature": 0.9, "top_k": 20, "n": 2, "seed": 1}),
    ("chat_json_object", "/v1/chat/completions",
     {**CHAT, "temperature": 0.9, "top_k": 20, "response_format": {"type": "json_object"}}),
    ("chat_top_logprobs", "/v1/chat/completions",
     {**CHAT, "temperature": 0.9, "top_k": 20, "logprobs": True, "top_logprobs": 3}),
]

# Refused, a 4xx is expected. Raw bytes are sent as they are.
REFUSED = [
    ("max_tokens_string", "/v1/completions", {**FATAL, "max_tokens": "ten"}),
    ("temperature_string", "/v1/completions", {**FATAL, "temperature": "hot"}),
    ("negative_temperature", "/v1/completions", {**FATAL, "temperature": -1}),
    ("top_p_above_one", "/v1/completions", {**FATAL, "top_p": 2}),
    ("negative_top_k", "/v1/completions", {**FATAL, "top_k": -5}),
    ("max_tokens_huge", "/v1/completions", {**FATAL, "max_tokens": 10**9}),
    ("negative_max_tokens", "/v1/completions", {**FATAL, "max_tokens": -3}),
    ("n_zero", "/v1/completions", {**FATAL, "n": 0}),
    ("stop_not_a_string", "/v1/completions", {**FATAL, "stop": 5}),
    ("seed_string", "/v1/completions", {**FATAL, "seed": "abc"}),
    ("missing_prompt", "/v1/completions", {"max_tokens": 3}),
    ("out_of_vocab_prompt", "/v1/completions", {**FATAL, "prompt": [600, 700]}),
    ("logprobs_far_too_high", "/v1/completions", {**FATAL, "logprobs": 1000}),
    ("invalid_regex", "/v1/completions", {**FATAL, "structured_outputs": {"regex": "(["}}),
    ("not_json", "/v1/completions", b"{not json"),
    ("empty_body", "/v1/completions", b""),
    ("json_list", "/v1/completions", b"[1, 2]"),
    ("chat_messages_string", "/v1/chat/completions", {**CHAT, "messages": "hi"}),
    ("chat_missing_messages", "/v1/chat/completions", {"max_tokens": 3}),
    ("chat_top_logprobs_far_too_high", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 1000}),
    ("chat_negative_top_k", "/v1/chat/completions", {**CHAT, "temperature": 0.9, "top_k": -5}),
]

# Either answer is fine (vLLM may ignore what it does not know), never a 5xx.
EITHER = [
    ("unknown_field", "/v1/completions", {**FATAL, "frobnicate": 1}),
    ("chat_unknown_field", "/v1/chat/completions", {**CHAT, "frobnicate": {"a": 1}}),
]


@pytest.fixture(scope="module")
def server(loopspec_server):
    return loopspec_server


def send(server, path: str, body) -> tuple[int, object]:
    """POST ``body`` (a dict as JSON, bytes as they are); returns (status,
    JSON body or text). A streamed reply is read to its end and returned as
    the list of its events."""
    if isinstance(body, dict):
        body = {"model": server.model_name(), **body}
        data = json.dumps(body).encode()
    else:
        data = body
    streamed = isinstance(body, dict) and body.get("stream") is True
    r = requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"},
                      timeout=600, stream=streamed)
    if streamed and r.status_code == 200:
        # Split on b"\n" only: iter_lines(decode_unicode=True) uses str.splitlines,
        # which also breaks inside JSON strings holding U+2028, U+0085 or \x1c
        # (sampled text can: vLLM writes them unescaped).
        lines = (raw.decode() for raw in r.iter_lines(delimiter=b"\n"))
        events = [line[len("data:"):].strip() for line in lines if line.startswith("data:")]
        return r.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def error_message(reply) -> str:
    """The message of vLLM's error body ({"error": {"message": ...}}), or of
    FastAPI's validation body ({"detail": ...})."""
    if isinstance(reply, dict):
        if isinstance(reply.get("error"), dict):
            return str(reply["error"].get("message") or "")
        if reply.get("detail"):
            return json.dumps(reply["detail"])
        if reply.get("message"):
            return str(reply["message"])
    return ""


def assert_still_serving(server) -> None:
    assert server.proc.poll() is None, f"vllm serve exited:\n{server.log.read_text()[-3000:]}"
    assert requests.get(server.url + "/health", timeout=60).status_code == 200


def check_served(path: str, body: dict, status: int, reply) -> None:
    assert status == 200, f"{status}: {reply}"
    n = body.get("n", 1)
    if body.get("stream"):
        assert reply and reply[-1] == "[DONE]", reply
        chunks = reply[:-1]
        assert not [c for c in chunks if "error" in c], chunks
        indices = {ch["index"] for c in chunks for ch in c.get("choices", [])}
        assert indices == set(range(n))
        finished = [ch for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
        assert len(finished) == n and all(ch["finish_reason"] in ("stop", "length") for ch in finished)
        return
    assert len(reply["choices"]) == n
    for choice in reply["choices"]:
        assert choice["finish_reason"] in ("stop", "length"), choice
        text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
        assert isinstance(text, str)
        if body.get("structured_outputs", {}).get("choice") and choice["finish_reason"] == "stop":
            assert text in body["structured_outputs"]["choice"]
    assert 1 <= reply["usage"]["completion_tokens"] <= n * body["max_tokens"]


@pytest.mark.parametrize("name,path,body", SERVED, ids=[b[0] for b in SERVED])
def test_sampled_bodies_are_served(server, name, path, body):
    status, reply = send(server, path, body)
    check_served(path, body, status, reply)
    assert_still_serving(server)


@pytest.mark.parametrize("name,path,body", REFUSED, ids=[b[0] for b in REFUSED])
def test_malformed_bodies_get_a_4xx_with_a_message(server, name, path, body):
    status, reply = send(server, path, body)
    assert 400 <= status < 500, f"{status}: {reply}"
    assert error_message(reply).strip(), f"{status} without an error message: {reply}"
    assert_still_serving(server)


@pytest.mark.parametrize("name,path,body", EITHER, ids=[b[0] for b in EITHER])
def test_unknown_fields_never_get_a_5xx(server, name, path, body):
    status, reply = send(server, path, body)
    if status == 200:
        check_served(path, body, status, reply)
    else:
        assert 400 <= status < 500 and error_message(reply).strip(), f"{status}: {reply}"
    assert_still_serving(server)


def test_greedy_text_after_all_bodies(server, oracle, tokenizer):
    """Runs last in this module: the server still answers 200 on /health and
    greedy decoding still returns the model's text."""
    assert_still_serving(server)
    prompt = "class Parser:\n    def __init__(self"
    status, reply = send(server, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                      "ignore_eos": True})
    assert status == 200, reply
    expected = oracle.greedy_generate(tokenizer(prompt)["input_ids"], 16)
    assert reply["choices"][0]["text"] == tokenizer.decode(expected)
