"""Disaggregated prefill/decode (``vllm_loopspec.disagg``): a prefill
instance, a decode instance with loopspec and the router, over vLLM's
``NixlConnector`` on 127.0.0.1.

One deployment serves the whole module, and one colocated loopspec server
started beside it (three engine starts in all, overlapped); the fault tests
use the deployment too, with vLLM's default KV lease (30 s), so that the
blocks nobody pulls are freed within the module's waits. The native
reference is the prefill instance itself: a plain vLLM server, whose
``NixlConnector`` acts only on requests that carry ``kv_transfer_params``,
so a request without them is prefilled and decoded there natively
(colocated). Every server is a child stopped by pid; every request and
wait is bounded.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import MAX_MODEL_LEN
from engine_access import until
from prompts import MEDIUM, SHORT, long_prompt

pytest.importorskip("nixl", reason="the pd extra (nixl==1.5.1) is not installed")

from vllm_loopspec.disagg import HandoffContractError, PDDeployment  # noqa: E402
from vllm_loopspec.disagg.launcher import metric_sum, prompt_tokens_by_source  # noqa: E402
from vllm_loopspec.disagg.router import prefill_body  # noqa: E402
from vllm_loopspec.server_process import free_port  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SERVE_ARGS = ("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.5",
              "--enforce-eager", "--max-num-seqs", "16", "--seed", "0")
# Prefill blocks nobody pulls are freed after this. vLLM's default; an 8 s lease
# ran out once on a loaded CI host between the prefill's answer and the decode
# side's pull, so the decode read blocks another prompt then owned (README, "Faults
# and policy"). _assert_equal_to_native names that cause if it happens again.
KV_LEASE_S = 30
STALE_READS = "vllm:nixl_num_notifications_after_expiry_total"  # pulls the prefill saw after the lease
# The decode side drafts a fixed K: the adaptive policy's decisions follow
# measured step times, so a seeded stream would differ from run to run (as
# under any change of schedule); a pinned K makes seeded streams comparable.
FIXED_K = '{"method": "loopspec", "num_speculative_tokens": 4, "adaptive": false}'
IDLE_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 120.0
OUT = 24


def _kv_usage(server) -> float:
    return metric_sum(server.metrics(), "vllm:kv_cache_usage_perc")


def _assert_kv_freed(*servers) -> None:
    def freed():
        for s in servers:
            text = s.metrics()
            assert metric_sum(text, "vllm:num_requests_running") == 0, s.url
            assert metric_sum(text, "vllm:num_requests_waiting") == 0, s.url
            assert metric_sum(text, "vllm:kv_cache_usage_perc") == 0, f"KV left on {s.url}"

    until(freed, IDLE_TIMEOUT_S)


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory):
    """The P/D deployment and a colocated loopspec server with the decode
    side's options, started together (engine starts overlap); both stopped
    by pid at the end of the module.

    The prefill instance's first side-channel port is one this fixture holds
    (as another process on the host may, between the launcher's draw and the
    child's bind): that start must fail and the launcher start again on newly
    drawn ports (``test_a_side_channel_port_taken_before_the_start_is_drawn_again``)."""
    from vllm_loopspec.disagg import launcher
    from vllm_loopspec.server_process import VllmServer

    log_dir = tmp_path_factory.mktemp("pd")
    colocated = VllmServer(tiny_checkpoint, *SERVE_ARGS, "--speculative-config", FIXED_K,
                           log_path=log_dir / "colocated.log")
    colocated.start()
    try:
        with socket.socket() as held, pytest.MonkeyPatch.context() as patch:
            held.bind(("127.0.0.1", free_port()))
            held.listen()
            first_draws = iter([held.getsockname()[1]])
            patch.setattr(launcher, "free_port", lambda: next(first_draws, None) or free_port())
            deployment = PDDeployment(tiny_checkpoint, serve_args=SERVE_ARGS, kv_lease_s=KV_LEASE_S,
                                      log_dir=log_dir, start_timeout_s=300, decode_speculative_config=FIXED_K)
            deployment.held_side_channel_port = held.getsockname()[1]
            deployment.__enter__()
        try:
            colocated.wait_healthy(300)
            yield deployment, colocated
        finally:
            deployment.__exit__(None, None, None)
    finally:
        colocated.stop()


@pytest.fixture(scope="module")
def pd(servers):
    return servers[0]


def test_a_side_channel_port_taken_before_the_start_is_drawn_again(pd):
    """The prefill instance was first given a side-channel port that another
    socket held: vLLM's listener could not bind it, the engine exited naming
    the port (patch 17; before, it waited forever, unhealthy), and the
    launcher started both instances again on newly drawn ports."""
    assert pd.start_attempts == 2
    assert pd.side_channel_ports[0] != pd.held_side_channel_port
    failed_start = (pd.log_dir / "prefill.attempt1.log").read_text()
    assert f"NIXL side channel could not listen on 127.0.0.1:{pd.held_side_channel_port}" in failed_start


@pytest.fixture(scope="module")
def colocated_fixed_k(servers):
    """A colocated loopspec server with the decode side's options."""
    return servers[1]


@pytest.fixture(scope="module")
def pd_prompts(tokenizer, pd):
    block = int(_cache_info(pd.decode)["block_size"])
    short = SHORT[:4] + MEDIUM[:1]
    long = [long_prompt(block + 40, tokenizer), long_prompt(2 * block + 9, tokenizer)[::-1]]
    lens = [len(tokenizer(p)["input_ids"]) for p in short + long]
    assert min(lens) < block < max(lens), (lens, block)  # shorter and longer than one block
    return short + long


def _stale_reads(pd) -> float:
    """Pulls the prefill instance saw after their blocks' lease ran out."""
    text = pd.prefill.metrics()
    assert f"\n{STALE_READS}{{" in text, f"the prefill instance exports no {STALE_READS}"
    return metric_sum(text, STALE_READS)


def _assert_equal_to_native(pd, stale_before: float, prompts, outs, native_greedy) -> None:
    """Token equality; a failure says whether a pull came after its lease
    ran out (the decode side then reads another prompt's KV: a fault of the
    host's load and the lease, not of loopspec)."""
    cause = ""
    if any(out != native_greedy[p] for p, out in zip(prompts, outs)):
        _completion(pd.client, prompts[0])  # an idle prefill engine reads late pulls' notices at its next step
        time.sleep(2)
        if stale := _stale_reads(pd) - stale_before:
            cause = (f" ({stale:g} pulls came after the prefill's {KV_LEASE_S} s KV lease ran out: "
                     "the host stalled longer than the lease)")
    for prompt, out in zip(prompts, outs):
        assert out == native_greedy[prompt], prompt[:40] + cause


def _cache_info(server) -> dict:
    from vllm_loopspec.disagg.contract import cache_config_info

    return cache_config_info(server.metrics())


@pytest.fixture(scope="module")
def native_greedy(pd, pd_prompts):
    """Greedy tokens of a colocated native server: the prefill instance,
    asked without ``kv_transfer_params`` (see the module docstring)."""
    return {p: _completion(pd.prefill, p) for p in pd_prompts}


def _completion(client, prompt: str, **extra) -> list[int]:
    body = {"model": client.model_name(), "prompt": prompt, "max_tokens": OUT, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    return client.post("/v1/completions", body, timeout=REQUEST_TIMEOUT_S)["choices"][0]["token_ids"]


def _streamed(client, prompt: str) -> list[int]:
    body = {"model": client.model_name(), "prompt": prompt, "max_tokens": OUT, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    return [t for c in client.stream("/v1/completions", body, timeout=REQUEST_TIMEOUT_S) if c["choices"]
            for t in (c["choices"][0].get("token_ids") or [])]


# -- greedy equality ------------------------------------------------------------------
def test_greedy_pd_equals_native_sequential(pd, pd_prompts, native_greedy):
    before, stale_before = pd.decode.metrics(), _stale_reads(pd)
    outs = [_completion(pd.client, prompt) for prompt in pd_prompts]
    streamed = _streamed(pd.client, pd_prompts[-1])
    _assert_equal_to_native(pd, stale_before, pd_prompts + pd_prompts[-1:], outs + [streamed], native_greedy)

    def decode_counters():
        after = pd.decode.metrics()
        src_b, src_a = prompt_tokens_by_source(before), prompt_tokens_by_source(after)
        assert metric_sum(after, "loopspec:rounds_total") > metric_sum(before, "loopspec:rounds_total")
        assert src_a["external_kv_transfer"] - src_b["external_kv_transfer"] > 0
        assert src_a["local_compute"] == src_b["local_compute"] == 0
        assert metric_sum(after, "vllm:nixl_xfer_time_seconds_count") > 0

    until(decode_counters, timeout=30)


def test_greedy_pd_equals_native_8_concurrent(pd, pd_prompts, native_greedy):
    batch = (pd_prompts * 2)[:8]
    stale_before = _stale_reads(pd)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: _completion(pd.client, p), batch))
    _assert_equal_to_native(pd, stale_before, batch, outs, native_greedy)
    assert prompt_tokens_by_source(pd.decode.metrics())["local_compute"] == 0
    _assert_kv_freed(pd.prefill, pd.decode)


def test_chat_streamed_through_router_equals_colocated(pd, colocated_fixed_k):
    body = {"model": None, "messages": [{"role": "user", "content": "def parse(path):"}], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}

    def text(client, stream):
        b = {**body, "model": client.model_name()}
        if stream:
            return "".join(c["choices"][0]["delta"].get("content") or "" for c in client.stream(
                "/v1/chat/completions", b, timeout=REQUEST_TIMEOUT_S) if c["choices"])
        return client.post("/v1/chat/completions", b, timeout=REQUEST_TIMEOUT_S)["choices"][0]["message"]["content"]

    colocated = text(colocated_fixed_k, stream=False)
    assert text(pd.client, stream=True) == colocated
    assert text(pd.client, stream=False) == colocated


# -- sampling -------------------------------------------------------------------------------
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def test_seeded_sampled_pd_equals_colocated_loopspec(pd, colocated_fixed_k, tokenizer):
    """Seeded sampled requests over P/D give the colocated loopspec server's
    tokens under the same schedule. The decode instance's first step
    computes the prompt's last token, and vLLM's scheduler pads such a
    one-token first step to 1 + K slots (``Scheduler.schedule``, "Pad new
    decode requests to uniform spec decoding size"), so loopspec drafts in
    it; a colocated request has the same first step when all but its last
    token hit the prefix cache. Prompts of one block + 1 token, the
    colocated cache warmed first."""
    block = int(_cache_info(pd.decode)["block_size"])
    ids = tokenizer(long_prompt(block + 8, tokenizer))["input_ids"][: block + 1]
    _completion(colocated_fixed_k, ids, max_tokens=1)  # caches the first block
    for seed in (1000, 1001, 1002):
        colocated = _completion(colocated_fixed_k, ids, seed=seed, **SAMPLED)
        assert _completion(pd.client, ids, seed=seed, **SAMPLED) == colocated, seed


def test_seeded_sampled_pd_replays(pd, pd_prompts):
    """Any prompt: a seeded sampled P/D request replays its tokens exactly
    (against a colocated server whose first step is a full prefill it is
    equal in distribution only, see above)."""
    for i, prompt in enumerate(pd_prompts[:2] + pd_prompts[-1:]):
        first = _completion(pd.client, prompt, seed=2000 + i, **SAMPLED)
        assert _completion(pd.client, prompt, seed=2000 + i, **SAMPLED) == first
        assert len(set(first)) > 1


# -- handoff contract ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_r_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint's weights with a different loop count R."""
    import shutil

    out = tmp_path_factory.mktemp("other-r") / "tiny-r3"
    shutil.copytree(tiny_checkpoint, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["total_ut_steps"] = 3
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


@pytest.mark.parametrize("case", ["loops", "block_size", "kv_dtype"])
def test_mismatched_pair_refused_before_any_engine(tiny_checkpoint, other_r_checkpoint, tmp_path, case):
    kwargs = {"loops": dict(prefill_checkpoint=other_r_checkpoint),
              "block_size": dict(prefill_args=("--block-size", "64")),
              "kv_dtype": dict(decode_args=("--kv-cache-dtype", "bfloat16"))}[case]
    named = {"loops": "total_ut_steps: prefill 3 != decode 4", "block_size": "block_size: prefill 64",
             "kv_dtype": "kv_dtype: prefill 'float32' != decode 'bfloat16'"}[case]
    deployment = PDDeployment(tiny_checkpoint, serve_args=SERVE_ARGS, log_dir=tmp_path, **kwargs)
    with pytest.raises(HandoffContractError, match="decode instance refuses") as err:
        deployment.__enter__()
    assert named in str(err.value)
    assert deployment.prefill.proc is None and deployment.decode.proc is None  # nothing was started


def test_mismatched_pair_refused_by_the_command(tiny_checkpoint, other_r_checkpoint, tmp_path):
    ports = [str(free_port()) for _ in range(3)]
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_loopspec.disagg", str(tiny_checkpoint), "--prefill-checkpoint",
         str(other_r_checkpoint), "--port", ports[0], "--prefill-port", ports[1], "--decode-port", ports[2],
         "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "total_ut_steps: prefill 3 != decode 4" in proc.stderr
    assert not (tmp_path / "prefill.log").exists() and not (tmp_path / "decode.log").exists()


# -- faults -----------------------------------------------------------------------------------
def _prefill_leg(server, prompt: str) -> dict:
    body = prefill_body({"model": server.model_name(), "prompt": prompt, "max_tokens": OUT, "temperature": 0,
                         "ignore_eos": True})
    params = server.post("/v1/completions", body, timeout=REQUEST_TIMEOUT_S)["kv_transfer_params"]
    assert params and params["remote_block_ids"], params
    return params


def test_fault_prefill_blocks_never_pulled(pd, pd_prompts):
    """A prefill answered, no decode leg comes in time: the blocks the
    prefill instance kept are freed when their KV lease runs out. A decode
    leg sent after that still pulls them (vLLM's decode side is not told),
    and the prefill side counts that late pull: the counter the greedy
    tests read (_assert_equal_to_native)."""
    _assert_kv_freed(pd.prefill, pd.decode)
    expired = metric_sum(pd.prefill.metrics(), "vllm:nixl_num_kv_expired_reqs_total")
    stale = _stale_reads(pd)
    params = _prefill_leg(pd.prefill, pd_prompts[-1])
    assert _kv_usage(pd.prefill) > 0  # held for a decode instance
    _assert_kv_freed(pd.prefill, pd.decode)  # within IDLE_TIMEOUT_S (> KV_LEASE_S)
    # vLLM counts the lease that ran out on the prefill side.
    until(lambda: _assert_more(pd.prefill, "vllm:nixl_num_kv_expired_reqs_total", expired), timeout=30)
    before = prompt_tokens_by_source(pd.decode.metrics())
    assert _completion(pd.decode, pd_prompts[-1], kv_transfer_params=params)  # served, from freed blocks
    assert _completion(pd.client, pd_prompts[0])  # both sides still serve
    # An idle prefill engine reads its notifications at its next step: the
    # request above made one.
    until(lambda: _assert_more(pd.prefill, STALE_READS, stale), timeout=30)
    after = prompt_tokens_by_source(pd.decode.metrics())
    assert after["local_compute"] == before["local_compute"]  # pulled, not recomputed
    _assert_kv_freed(pd.prefill, pd.decode)


def _assert_more(server, name: str, than: float) -> None:
    assert metric_sum(server.metrics(), name) > than


def test_fault_handshake_fails_request_recomputed(pd, pd_prompts, native_greedy):
    """The decode leg names a side channel nobody listens on: the NIXL
    handshake fails, the decode instance recomputes the prompt
    (kv_load_failure_policy=recompute) and answers with the native tokens;
    the prefill's unpulled blocks go with the lease."""
    prompt = pd_prompts[-2]
    params = {**_prefill_leg(pd.prefill, prompt), "remote_port": free_port(),
              "remote_engine_id": "no-such-engine"}
    before = prompt_tokens_by_source(pd.decode.metrics())
    out = _completion(pd.decode, prompt, kv_transfer_params=params)
    assert out == native_greedy[prompt]
    until(lambda: _assert_recomputed(pd.decode, before), timeout=30)
    _assert_kv_freed(pd.prefill, pd.decode)
    assert _completion(pd.client, pd_prompts[0]) == native_greedy[pd_prompts[0]]


def _assert_recomputed(decode, before) -> None:
    assert prompt_tokens_by_source(decode.metrics())["local_compute"] > before["local_compute"]


def _cancelled_post(url: str, body: dict, after_s: float) -> None:
    """Send a request and drop the connection ``after_s`` later."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after_s)


@pytest.mark.parametrize("after_s", [0.0, 0.05, 0.2, 0.5])
def test_fault_decode_request_cancelled_while_kv_in_flight(pd, pd_prompts, native_greedy, after_s):
    """The decode leg is cancelled before, during or just after its pull
    (several delays: the pull of a 3-block prompt takes ~0.1 s here). Both
    sides end with no KV and keep serving."""
    prompt = pd_prompts[-1]
    params = _prefill_leg(pd.prefill, prompt)
    body = {"model": pd.decode.model_name(), "prompt": prompt, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "kv_transfer_params": params}
    _cancelled_post(pd.decode.url, body, after_s)
    _assert_kv_freed(pd.prefill, pd.decode)
    assert _completion(pd.client, prompt) == native_greedy[prompt]


def test_fault_decode_cancelled_through_router_mid_stream(pd, pd_prompts, native_greedy):
    prompt = pd_prompts[-1]
    body = {"model": pd.decode.model_name(), "prompt": prompt, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    _cancelled_post(pd.url, body, 0.3)
    _assert_kv_freed(pd.prefill, pd.decode)
    assert _completion(pd.client, prompt) == native_greedy[prompt]


def test_fault_prefill_killed_before_decode_pulls(pd, pd_prompts, native_greedy):
    """The prefill instance answers, then dies (SIGKILL) before the decode
    instance pulls: the decode instance recomputes and answers with the
    native tokens (bounded by the HTTP timeout), its KV is freed, and it
    keeps serving, through the router too (which skips the dead prefill
    instance). Kills the module's prefill instance: the last test of the
    module."""
    prompt = pd_prompts[-2]
    params = _prefill_leg(pd.prefill, prompt)
    pd.prefill.kill()
    before = prompt_tokens_by_source(pd.decode.metrics())
    assert _completion(pd.decode, prompt, kv_transfer_params=params) == native_greedy[prompt]
    until(lambda: _assert_recomputed(pd.decode, before), timeout=30)
    _assert_kv_freed(pd.decode)
    assert _completion(pd.client, pd_prompts[0]) == native_greedy[pd_prompts[0]]
    assert pd.router.counts["prefill_unreachable"] >= 1
    _assert_kv_freed(pd.decode)
