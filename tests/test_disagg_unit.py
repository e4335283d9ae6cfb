"""The P/D router's prefill leg and the handoff contract's comparison, without
an engine (the end-to-end behaviour is tests/test_disagg.py)."""

from vllm_loopspec.disagg.contract import HandoffContractError, check_pair, mismatches
from vllm_loopspec.disagg.launcher import kv_transfer_config
from vllm_loopspec.disagg.router import prefill_body

import pytest

CONTRACT = {"model": "/ckpt", "architecture": "OuroForCausalLM", "total_ut_steps": 4, "num_hidden_layers": 2,
            "num_kv_heads": 2, "head_dim": 64, "block_size": 128, "kv_dtype": "float32"}


def test_prefill_leg_is_one_unstreamed_token_with_kv_kept_for_remote_decode():
    body = {"model": "m", "prompt": "x", "max_tokens": 64, "max_completion_tokens": 64, "min_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}, "seed": 3, "temperature": 0.7}
    leg = prefill_body(body)
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream" not in leg and "stream_options" not in leg and "min_tokens" not in leg
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["kv_transfer_params"]["do_remote_prefill"] is False
    assert (leg["seed"], leg["temperature"]) == (3, 0.7)
    assert body["max_tokens"] == 64 and body["stream"] is True  # the decode leg's body is untouched


def test_contract_names_every_mismatch():
    other = {**CONTRACT, "total_ut_steps": 3, "kv_dtype": "bfloat16"}
    assert mismatches(CONTRACT, CONTRACT) == []
    assert mismatches(CONTRACT, other) == ["total_ut_steps: prefill 4 != decode 3",
                                           "kv_dtype: prefill 'float32' != decode 'bfloat16'"]
    with pytest.raises(HandoffContractError, match="total_ut_steps: prefill 4 != decode 3; kv_dtype"):
        check_pair(CONTRACT, other, "test")


def test_kv_transfer_configs():
    assert kv_transfer_config("kv_producer", cuda=False) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    consumer = kv_transfer_config("kv_consumer", cuda=True, lease_s=8)
    assert consumer["kv_load_failure_policy"] == "recompute" and consumer["kv_buffer_device"] == "cuda"
    assert consumer["kv_connector_extra_config"] == {"kv_lease_duration": 8}


def test_instances_get_disjoint_openmp_cores_on_cpu(monkeypatch):
    """Two engines whose OpenMP teams share cores stall each other (launcher.split_cpus)."""
    from vllm_loopspec.disagg.launcher import instance_env, split_cpus

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert split_cpus([0, 1]) == ("0", "1")
    assert split_cpus([4, 1, 2, 3]) == ("1,2", "3,4")
    assert split_cpus([0]) == (None, None)
    assert instance_env(5600, cuda=False, devices="1")["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in instance_env(5600, cuda=False)
    assert instance_env(5600, cuda=False)["UCX_KEEPALIVE_INTERVAL"] == "2s"
    assert instance_env(5600, cuda=True, devices="1")["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert split_cpus([0, 1]) == (None, None)  # the user's binding wins


def test_nixl_worker_init_leaves_the_thread_affinity_alone():
    """Patch 13: NIXL's CPU path pins the calling thread (the OpenMP master) to
    the last core; the wrapper restores the affinity the thread had."""
    import os
    import threading

    from vllm_loopspec.patches import keep_cpu_affinity

    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs 2 cores")
    seen = {}

    def pinning_init(self):
        os.sched_setaffinity(0, {max(allowed)})
        seen["inside"] = os.sched_getaffinity(0)

    def run():
        keep_cpu_affinity(pinning_init)(None)
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=run)  # a thread of its own: the test process keeps its cores
    t.start()
    t.join()
    assert seen["inside"] == {max(allowed)} and seen["after"] == allowed


def test_router_binds_a_free_port_when_it_starts_and_raises_a_failed_bind():
    """A port picked before the engines start (a minute) may be taken by then
    on a shared host: port 0 binds at start; a taken port raises at once."""
    from vllm_loopspec.disagg.router import Router

    router = Router("http://127.0.0.1:1", "http://127.0.0.1:2", port=0).start_in_thread()
    try:
        assert router.port > 0 and router.url.endswith(f":{router.port}")
        with pytest.raises(OSError):
            Router("http://127.0.0.1:1", "http://127.0.0.1:2", port=router.port).start_in_thread()
    finally:
        router.stop()


def test_router_resends_when_a_backend_drops_a_reused_connection_before_answering():
    """vLLM's server closes idle keep-alive connections; a request sent on one
    it is closing never reaches the engine. The router sends it again on a new
    connection instead of failing it (CI saw a 500 from exactly this)."""
    import asyncio
    import json
    import threading
    import urllib.request

    from vllm_loopspec.disagg.router import Router

    answered = []

    async def handle(reader, writer):
        # Each connection answers its first request, then drops the next one
        # unanswered, as a server closing an idle keep-alive connection does.
        for turn in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")][0])
            await reader.readexactly(length)
            if turn == 1:
                break
            answered.append(head.split(b" ")[1].decode())
            body = json.dumps({"choices": [{"text": "x", "token_ids": [1]}],
                               "kv_transfer_params": {"remote_block_ids": [0]}}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    backend = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    router = Router(backend, backend, port=0).start_in_thread()
    try:
        for _ in range(3):
            req = urllib.request.Request(router.url + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "a", "max_tokens": 2}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200 and json.load(r)["choices"][0]["token_ids"] == [1]
        assert len(answered) == 6 and router.counts["prefill_unreachable"] == 0
        assert router.counts["resent"] >= 1
    finally:
        router.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_nixl_descriptor_counts_match_the_recorded_vllm_pulls():
    """benchmarks/nixl_descriptors.py's arithmetic: vLLM posts one descriptor per KV
    layer per block, NIXL merges a layer's adjacent blocks, a cross-layer row is one."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "nixl_descriptors.py"
    spec = importlib.util.spec_from_file_location("nixl_descriptors", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # imports nothing from nixl at module level
    assert bench.descriptor_counts(2, 4, blocks=8) == {"posted": 64, "after_merge": 8, "cross_layer": 1}
    assert bench.descriptor_counts(24, 4, blocks=8, block_runs=3) == {"posted": 768, "after_merge": 288,
                                                                      "cross_layer": 3}
    shapes = {(r["shape"].split()[0], r["prompt_tokens"]): r for r in bench.pull_shapes()}
    # benchmarks/results/pd_transfer.json: the bundled checkpoint moved 1, 1, 4, 8 MiB in 8 descriptors
    assert [shapes["bundled", n]["mib"] for n in (16, 128, 512, 1024)] == [1, 1, 4, 8]
    assert {shapes["bundled", n]["after_merge"] for n in (16, 128, 512, 1024)} == {8}
    assert shapes["Ouro-1.4B", 16]["mib"] == 192 and shapes["Ouro-1.4B", 16]["after_merge"] == 96
    assert bench.layout(1000, 64, 4, gapped=True) == [(1000, 16), (1032, 16), (1064, 16), (1096, 16)]
    assert bench.cases([1], [1, 8, 512], contiguous=True) == [(1, 1, False, True), (1, 1, True, True),
                                                               (1, 8, False, True), (1, 8, True, True),
                                                               (1, 8, False, False)]


def test_free_ports_are_drawn_below_the_ephemeral_range_and_bind():
    """A port handed to a server to bind later must not be one that any
    socket bound to port 0 (vLLM's ZMQ sockets) may take meanwhile."""
    import socket

    from vllm_loopspec.server_process import _ephemeral_low, free_port

    ports = {free_port() for _ in range(8)}
    assert all(1024 <= p < _ephemeral_low() for p in ports), ports
    assert len(ports) > 1  # drawn at random, not the range's first free port
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _scheduler_on(port: int):
    """vLLM's NIXL scheduler side with only what starting its side-channel
    listener reads (a real one needs an engine's config)."""
    import threading

    base_scheduler = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler")
    scheduler = object.__new__(base_scheduler.NixlBaseConnectorScheduler)
    scheduler._nixl_handshake_listener_t = None
    scheduler._stop_event = threading.Event()
    scheduler.side_channel_host, scheduler.side_channel_port = "127.0.0.1", port
    return scheduler


def _start_listener(scheduler, within_s: float = 20.0):
    """Call set_xfer_handshake_metadata in a thread (unpatched, it never
    returns when the port is taken); return what it raised, or None."""
    import threading

    outcome = {}

    def start():
        try:
            scheduler.set_xfer_handshake_metadata({})
            outcome["raised"] = None
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome["raised"] = exc

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(within_s)
    assert "raised" in outcome, "the listener's start waited forever on a port it could not bind"
    return outcome["raised"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the listener's own traceback
def test_a_nixl_side_channel_on_a_taken_port_fails_the_start_with_the_port_named():
    """Patch 17: vLLM waits without a timeout for its side-channel listener,
    which dies when its port is taken; the engine hung unhealthy (CI, prefill
    instance, "Address already in use"). Now the start raises, naming the port."""
    import socket

    from vllm_loopspec import patches
    from vllm_loopspec.server_process import free_port

    patches.fail_on_a_dead_nixl_listener()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        raised = _start_listener(_scheduler_on(port))
    assert isinstance(raised, RuntimeError), raised
    assert f"127.0.0.1:{port}" in str(raised) and "VLLM_NIXL_SIDE_CHANNEL_PORT" in str(raised)

    scheduler = _scheduler_on(free_port())  # a free port: the listener starts and serves as before
    assert _start_listener(scheduler) is None
    assert scheduler._nixl_handshake_listener_t.is_alive()
    scheduler._stop_event.set()
    scheduler._nixl_handshake_listener_t.join(10)
    assert not scheduler._nixl_handshake_listener_t.is_alive()


class _Instance:
    """Stands in for a ``VllmServer`` child in the launcher's start logic."""

    def __init__(self, failures: list) -> None:
        self.failures, self.started, self.stopped = failures, 0, 0
        self.log_path = None

    def start(self) -> None:
        self.started += 1

    def stop(self) -> None:
        self.stopped += 1

    def wait_healthy(self, timeout: float) -> None:
        if self.failures:
            raise self.failures.pop(0)


def _deployment_with(prefill_failures: list, **ports):
    from vllm_loopspec.disagg import launcher

    deployment = object.__new__(launcher.PDDeployment)
    deployment.start_timeout_s, deployment.log_dir = 1.0, "logs"
    deployment.given_ports = {"router": None, "prefill": None, "decode": None, "prefill_side_channel": None,
                              "decode_side_channel": None, **ports}
    built = []

    def build() -> None:
        deployment.prefill = _Instance(prefill_failures)
        deployment.decode = _Instance([])
        built.append((deployment.prefill, deployment.decode))

    deployment._build_instances = build
    build()
    return deployment, built


def test_a_start_that_lost_a_drawn_port_is_retried_on_new_ports():
    """A port the launcher drew may be taken before the child binds it: the
    start is retried on newly drawn ports; other failures, and losing a port
    the caller gave, are raised at once."""
    from vllm_loopspec.disagg.launcher import START_ATTEMPTS
    from vllm_loopspec.server_process import PortInUse

    deployment, built = _deployment_with([PortInUse("taken")])
    deployment._start_instances()
    assert len(built) == 2  # drawn again once
    assert built[0][0].stopped == built[0][1].stopped == 1 and built[1][0].started == 1

    deployment, built = _deployment_with([PortInUse("taken")] * START_ATTEMPTS)
    with pytest.raises(PortInUse):
        deployment._start_instances()
    assert len(built) == START_ATTEMPTS

    deployment, built = _deployment_with([RuntimeError("bad checkpoint")])
    with pytest.raises(RuntimeError, match="bad checkpoint"):
        deployment._start_instances()
    assert len(built) == 1

    deployment, built = _deployment_with([PortInUse("taken")], prefill=8100, decode=8200,
                                         prefill_side_channel=5600, decode_side_channel=5601)
    with pytest.raises(PortInUse):
        deployment._start_instances()
    assert len(built) == 1  # every port was the caller's: nothing to redraw
