"""`vllm serve CKPT` (plugin installed, nothing else) answers OpenAI requests."""

import socket

import pytest

from vllm_loopspec import server_process
from vllm_loopspec.server_process import VllmServer, free_port


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """The server's first drawn port is one this fixture holds (as another
    process may, between the draw and the child's bind): that start fails
    and ``VllmServer`` starts again on a new port."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with socket.socket() as held, pytest.MonkeyPatch.context() as patch:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        first_draws = iter([held.getsockname()[1]])
        patch.setattr(server_process, "free_port", lambda: next(first_draws, None) or free_port())
        srv = VllmServer(tiny_checkpoint, "--dtype", "float32", "--max-model-len", "512",
                         "--enforce-eager", "--gpu-memory-utilization", "0.5", log_path=log)
        srv.held_port = held.getsockname()[1]
        srv.__enter__()
    try:
        yield srv
    finally:
        srv.__exit__(None, None, None)


@pytest.mark.slow
def test_a_port_taken_before_the_server_bound_it_is_drawn_again(server):
    assert server.start_attempts == 2 and server.port != server.held_port
    assert server.model_name()


@pytest.mark.slow
def test_streamed_completion(server, oracle, tokenizer):
    prompt = "def foo(x):"
    body = {"model": server.model_name(), "prompt": prompt, "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    chunks = list(server.stream("/v1/completions", body))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["text"]]) > 1
    expected = oracle.greedy_generate(tokenizer(prompt)["input_ids"], 12)
    assert text == tokenizer.decode(expected)
    full = server.post("/v1/completions", {**body})
    assert full["choices"][0]["text"] == text
    assert full["usage"]["completion_tokens"] == 12


@pytest.mark.slow
def test_chat_completion_uses_chat_template(server):
    body = {"model": server.model_name(), "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    out = server.post("/v1/chat/completions", body)
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == 5
    # ChatML wraps the message: more prompt tokens than the bare word.
    assert out["usage"]["prompt_tokens"] > 5
