"""One command for a disaggregated deployment: a prefill instance, a decode
instance (loopspec by default) and the router, each a child process or
thread of this one, stopped by pid on exit.

    python -m vllm_loopspec.disagg checkpoints/ouro-stdlib --port 8000
    vllm-loopspec-pd checkpoints/ouro-stdlib --speculative-config '{"method":"loopspec","num_speculative_tokens":4}'

Settings it makes right (see DESIGN.md, "P/D over NIXL"):

* both instances: ``NixlConnector``, pull mode; ``kv_role`` ``kv_producer`` on
  prefill and ``kv_consumer`` on decode; each its own ``--port`` and
  ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (host 127.0.0.1);
* CPU hosts: ``kv_buffer_device="cpu"``, ``UCX_NET_DEVICES=lo``,
  ``UCX_TLS=tcp,self``, ``UCX_KEEPALIVE_INTERVAL=2s`` (a read from a
  prefill instance that died fails in seconds, not minutes), half the cores
  each for the instances' OpenMP threads (:func:`split_cpus`) and
  ``OMP_WAIT_POLICY=PASSIVE`` (two engines' spinning
  OpenMP threads otherwise starve each other: a 64-token decode took 30-90 s
  instead of 1-3 s on 2 cores). CUDA hosts: ``kv_buffer_device="cuda"``, UCX
  left to choose its transports, one GPU per instance
  (``--prefill-devices``/``--decode-devices``, ``CUDA_VISIBLE_DEVICES``);
* the decode side's ``kv_load_failure_policy`` is ``recompute`` (flag
  ``--kv-load-failure-policy``): when the KV cannot be pulled (prefill
  instance gone, handshake refused, transfer error) the decode instance
  recomputes the prompt and the request succeeds, with the same tokens as a
  colocated server. vLLM's default, ``fail``, ends such a request with an
  error although the decode instance could serve it; with one prefill
  instance and no retrying client, failing would turn every prefill crash
  into failed user requests. Choose ``fail`` when a decode node must never
  spend time on prompts (SLO-bound decode pools behind a retrying router);
* prefill's blocks that no decode instance pulls are freed when their KV
  lease runs out (vLLM 0.32's ``kv_connector_extra_config.kv_lease_duration``,
  30 s by default, renewed by the decode side's heartbeats while a pull is
  pending; this replaced ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``). ``--kv-lease-s``
  sets it on both sides.

Before the first request the launcher checks the handoff contract
(:mod:`vllm_loopspec.disagg.contract`) from the arguments, before any engine
starts, then from the running servers, and sends one warm-up request whose
KV must reach the decode instance by transfer; any mismatch stops both
instances with a message naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_loopspec.disagg.contract import (
    HandoffContractError,
    check_pair,
    contract_from_args,
    contract_from_server,
)
from vllm_loopspec.disagg.router import Router
from vllm_loopspec.server_process import (START_ATTEMPTS, ServerClient, VllmServer, free_port,
                                          start_drawing_ports_again)

DEFAULT_SERVE_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.5",
                      "--enforce-eager")
KV_LOAD_FAILURE_POLICY = "recompute"
INSTANCE_PORTS = ("prefill", "decode", "prefill_side_channel", "decode_side_channel")


def is_cuda_host() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, no CUDA
        return False


def kv_transfer_config(role: str, cuda: bool, policy: str = KV_LOAD_FAILURE_POLICY,
                       lease_s: int | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": role,
                           "kv_buffer_device": "cuda" if cuda else "cpu"}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = policy
    if lease_s is not None:
        cfg["kv_connector_extra_config"] = {"kv_lease_duration": int(lease_s)}
    return cfg


def split_cpus(cpus: list[int] | None = None) -> tuple[str | None, str | None]:
    """Disjoint OpenMP core lists for the prefill and decode instance of one
    CPU host (``VLLM_CPU_OMP_THREADS_BIND``): the first half of the allowed
    cores and the rest, or ``(None, None)`` (vLLM's own binding) with fewer
    than 2 cores or when ``VLLM_CPU_OMP_THREADS_BIND`` is set.

    Two engines whose OpenMP teams share cores stall each other: a parallel
    region ends only when every thread of its team ran, and the other engine
    holds the core. On the 2-core CI machine that (with NIXL's pinning, patch
    13) made a 24-token decode take 10-25 s instead of ~1 s."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return None, None
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def instance_env(side_channel_port: int, cuda: bool, devices: str | None = None) -> dict[str, str]:
    """Environment of one instance; ``devices`` is ``CUDA_VISIBLE_DEVICES`` on
    CUDA hosts and ``VLLM_CPU_OMP_THREADS_BIND`` (a core list) on CPU hosts."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    if cuda:
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
    else:
        env["UCX_NET_DEVICES"] = os.environ.get("UCX_NET_DEVICES", "lo")
        env["UCX_TLS"] = os.environ.get("UCX_TLS", "tcp,self")
        # A read posted to a prefill instance that just died (before UCX saw
        # its socket close) waits for UCX's keepalive to fail the endpoint:
        # ~140 s at UCX's default interval, ~25 s at 2 s (then recompute).
        env["UCX_KEEPALIVE_INTERVAL"] = os.environ.get("UCX_KEEPALIVE_INTERVAL", "2s")
        if devices is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = devices
    return env


def metric_sum(text: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples whose labels contain ``labels`` (0 if none)."""
    pattern = rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? ([0-9.e+-]+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M))


def prompt_tokens_by_source(metrics_text: str) -> dict[str, float]:
    return {s: metric_sum(metrics_text, "vllm:prompt_tokens_by_source_total", f'source="{s}"')
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


class PDDeployment:
    """Prefill + decode ``vllm serve`` children and the router (a thread);
    a context manager. ``decode_speculative_config=None`` decodes natively."""

    def __init__(self, checkpoint: str | Path, *, serve_args: tuple[str, ...] | list[str] = DEFAULT_SERVE_ARGS,
                 prefill_args: tuple[str, ...] | list[str] = (), decode_args: tuple[str, ...] | list[str] = (),
                 decode_speculative_config: str | None = "loopspec", prefill_checkpoint: str | Path | None = None,
                 port: int | None = None, prefill_port: int | None = None, decode_port: int | None = None,
                 prefill_side_channel_port: int | None = None, decode_side_channel_port: int | None = None,
                 kv_load_failure_policy: str = KV_LOAD_FAILURE_POLICY, kv_lease_s: int | None = None,
                 prefill_devices: str | None = None, decode_devices: str | None = None,
                 log_dir: str | Path | None = None, env: dict[str, str] | None = None,
                 warmup: bool = True, start_timeout_s: float = 600.0) -> None:
        self.cuda = is_cuda_host()
        self.checkpoint = str(checkpoint)
        self.prefill_checkpoint = str(prefill_checkpoint or checkpoint)
        spec = [] if decode_speculative_config in (None, "none") else ["--speculative-config",
                                                                      decode_speculative_config]
        self.prefill_args = [*serve_args, *prefill_args, "--kv-transfer-config",
                             json.dumps(kv_transfer_config("kv_producer", self.cuda, lease_s=kv_lease_s))]
        self.decode_args = [*serve_args, *decode_args, *spec, "--kv-transfer-config",
                            json.dumps(kv_transfer_config("kv_consumer", self.cuda, kv_load_failure_policy,
                                                          kv_lease_s))]
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="loopspec-pd-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.devices = (prefill_devices, decode_devices)
        if prefill_devices is None and decode_devices is None:
            self.devices = ("0", "1") if self.cuda else split_cpus()
        self.given_ports = {"router": port, "prefill": prefill_port, "decode": decode_port,
                            "prefill_side_channel": prefill_side_channel_port,
                            "decode_side_channel": decode_side_channel_port}
        self.env = env or {}
        self.warmup = warmup
        self.start_timeout_s = start_timeout_s
        self._build_instances()

    def _build_instances(self) -> None:
        """The two ``vllm serve`` children and the router, on the ports given
        or on ports drawn now (drawn again for a start that lost one)."""
        given = self.given_ports
        self.side_channel_ports = (given["prefill_side_channel"] or free_port(),
                                   given["decode_side_channel"] or free_port())
        self.prefill = VllmServer(self.prefill_checkpoint, *self.prefill_args, port=given["prefill"],
                                  log_path=self.log_dir / "prefill.log",
                                  env={**instance_env(self.side_channel_ports[0], self.cuda, self.devices[0]),
                                       **self.env})
        self.decode = VllmServer(self.checkpoint, *self.decode_args, port=given["decode"],
                                 log_path=self.log_dir / "decode.log",
                                 env={**instance_env(self.side_channel_ports[1], self.cuda, self.devices[1]),
                                      **self.env})
        # port None: the router binds a free port when it starts (see Router.start_in_thread).
        self.router = Router(self.prefill.url, self.decode.url, port=given["router"] or 0)

    @property
    def url(self) -> str:
        """The router's URL (its port is known once the deployment started)."""
        return self.router.url

    @property
    def client(self) -> ServerClient:
        """The OpenAI API through the router."""
        return ServerClient(self.router.url)

    # -- lifecycle -------------------------------------------------------------
    def check_args(self) -> None:
        """Contract from the arguments: before any engine starts."""
        check_pair(contract_from_args(self.prefill_checkpoint, self.prefill_args),
                   contract_from_args(self.checkpoint, self.decode_args), "from their arguments")

    def __enter__(self) -> "PDDeployment":
        self.check_args()
        try:
            self._start_instances()
            check_pair(contract_from_server(self.prefill.url), contract_from_server(self.decode.url),
                       "as the running servers report it")
            self.router.start_in_thread()
            if self.warmup:
                self.warmup_handoff()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_instances(self, attempts: int = START_ATTEMPTS) -> None:
        """Start both instances and wait for them. A port this launcher drew
        can be taken by another process before the child binds it (the HTTP
        port, or the NIXL side channel: patch 17 makes that one exit too);
        such a start is retried on newly drawn ports, ``attempts`` in all.
        Ports the caller gave are not redrawn: their failure is raised."""
        def start_both() -> None:
            self.prefill.start()
            self.decode.start()
            self.prefill.wait_healthy(self.start_timeout_s)
            self.decode.wait_healthy(self.start_timeout_s)

        def stop_both() -> None:
            self.decode.stop()
            self.prefill.stop()

        def draw_again(attempt: int) -> bool:
            if all(self.given_ports[name] is not None for name in INSTANCE_PORTS):
                return False
            for server in (self.prefill, self.decode):  # kept for a look at what failed
                if server.log_path and server.log_path.exists():
                    server.log_path.rename(server.log_path.with_suffix(f".attempt{attempt}.log"))
            print(f"P/D launcher: an instance lost a port at start (logs kept as *.attempt{attempt}.log "
                  f"in {self.log_dir}); starting again on new ports, attempt {attempt + 1} of {attempts}",
                  file=sys.stderr)
            self._build_instances()
            return True

        self.start_attempts = start_drawing_ports_again(start_both, stop_both, draw_again, attempts)

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.router.stop()
        self.decode.stop()
        self.prefill.stop()

    def warmup_handoff(self, attempts: int = 3, timeout_s: float = 120.0) -> None:
        """One short request through the router; its prompt must reach the
        decode instance by transfer (NIXL's own handshake checks run here, so
        the first user request is not the one that finds out). A handshake
        can time out on an overloaded host (vLLM waits 5 s for the side
        channel's answer): up to ``attempts`` tries, then refuse."""
        for attempt in range(1, attempts + 1):
            delta = self._one_warmup(timeout_s)
            if delta["external_kv_transfer"] > 0 and delta["local_compute"] == 0:
                return
            log = self.decode.log_path.read_text()
            if "compatibility hash mismatch" in log:
                break  # a real incompatibility: retrying cannot help
        errors = [line for line in self.decode.log_path.read_text().splitlines()
                  if "NIXL" in line and ("mismatch" in line or "rror" in line or "ailed" in line)][-5:]
        raise HandoffContractError(
            f"the warm-up request's KV did not reach the decode instance by transfer in {attempt} tries "
            f"(prompt tokens on the decode side: {delta}); decode log ({self.decode.log_path}):\n"
            + "\n".join(errors))

    def _one_warmup(self, timeout_s: float) -> dict[str, float]:
        before = prompt_tokens_by_source(self.decode.metrics())
        body = {"model": self.decode.model_name(), "prompt": "warm-up handoff", "max_tokens": 2,
                "temperature": 0}
        self.client.post("/v1/completions", body, timeout=timeout_s)
        deadline = time.monotonic() + 10
        while True:
            after = prompt_tokens_by_source(self.decode.metrics())
            delta = {k: after[k] - before[k] for k in after}
            if (delta["external_kv_transfer"] > 0 and delta["local_compute"] == 0) or time.monotonic() > deadline:
                return delta
            time.sleep(0.2)

    def idle_kv_usage(self) -> tuple[float, float]:
        return (metric_sum(self.prefill.metrics(), "vllm:kv_cache_usage_perc"),
                metric_sum(self.decode.metrics(), "vllm:kv_cache_usage_perc"))


# -- command line --------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vllm-loopspec-pd", description="Disaggregated prefill/decode for Ouro: a prefill instance, a "
        "decode instance (loopspec) and an OpenAI-API router, on one host.")
    ap.add_argument("checkpoint", nargs="?", default=None,
                    help="checkpoint served by both instances (default: the bundled checkpoints/ouro-stdlib)")
    ap.add_argument("--prefill-checkpoint", default=None, help="a different checkpoint for the prefill side "
                    "(it must satisfy the handoff contract)")
    ap.add_argument("--port", type=int, default=8000, help="router port (OpenAI API)")
    ap.add_argument("--prefill-port", type=int, default=8100)
    ap.add_argument("--decode-port", type=int, default=8200)
    ap.add_argument("--prefill-side-channel-port", type=int, default=5600)
    ap.add_argument("--decode-side-channel-port", type=int, default=5610)
    ap.add_argument("--speculative-config", default="loopspec",
                    help="decode side: loopspec (default), loopspec JSON, or none")
    ap.add_argument("--serve-args", default=shlex.join(DEFAULT_SERVE_ARGS),
                    help="vllm serve arguments for both instances (one string)")
    ap.add_argument("--prefill-args", default="", help="extra vllm serve arguments for the prefill instance")
    ap.add_argument("--decode-args", default="", help="extra vllm serve arguments for the decode instance")
    ap.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"), default=KV_LOAD_FAILURE_POLICY)
    ap.add_argument("--kv-lease-s", type=int, default=None,
                    help="seconds prefill keeps blocks no decode instance pulls (vLLM default 30)")
    ap.add_argument("--prefill-devices", default=None, help="CUDA_VISIBLE_DEVICES of the prefill instance "
                    "(CPU hosts: its VLLM_CPU_OMP_THREADS_BIND core list; default: half the cores each)")
    ap.add_argument("--decode-devices", default=None, help="CUDA_VISIBLE_DEVICES of the decode instance "
                    "(CPU hosts: its VLLM_CPU_OMP_THREADS_BIND core list)")
    ap.add_argument("--log-dir", default=".cache/pd", help="instance logs")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--router-only", action="store_true",
                    help="only the router, in front of running instances at --prefill-url/--decode-url")
    ap.add_argument("--prefill-url", default=None)
    ap.add_argument("--decode-url", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.router_only:
        if not (args.prefill_url and args.decode_url):
            print("--router-only needs --prefill-url and --decode-url", file=sys.stderr)
            return 2
        try:
            check_pair(contract_from_server(args.prefill_url), contract_from_server(args.decode_url),
                       "as the running servers report it")
        except HandoffContractError as e:
            print(f"vllm-loopspec-pd: {e}", file=sys.stderr)
            return 2
        print(f"[pd] router on http://127.0.0.1:{args.port} -> prefill {args.prefill_url}, decode {args.decode_url}",
              flush=True)
        Router(args.prefill_url, args.decode_url, port=args.port).run()
        return 0
    from vllm_loopspec.demo import default_checkpoint

    ckpt = args.checkpoint or str(default_checkpoint())
    deployment = PDDeployment(
        ckpt, serve_args=shlex.split(args.serve_args), prefill_args=shlex.split(args.prefill_args),
        decode_args=shlex.split(args.decode_args), decode_speculative_config=args.speculative_config,
        prefill_checkpoint=args.prefill_checkpoint, port=args.port, prefill_port=args.prefill_port,
        decode_port=args.decode_port, prefill_side_channel_port=args.prefill_side_channel_port,
        decode_side_channel_port=args.decode_side_channel_port,
        kv_load_failure_policy=args.kv_load_failure_policy, kv_lease_s=args.kv_lease_s,
        prefill_devices=args.prefill_devices, decode_devices=args.decode_devices, log_dir=args.log_dir,
        start_timeout_s=args.start_timeout_s)
    print(f"[pd] prefill {deployment.prefill.url}, decode {deployment.decode.url} "
          f"({'speculative-config ' + args.speculative_config}); logs in {deployment.log_dir}", flush=True)
    for name, srv in (("prefill", deployment.prefill), ("decode", deployment.decode)):
        env = " ".join(f"{k}={v}" for k, v in srv.env.items() if k.startswith(("VLLM_NIXL", "UCX_", "OMP_W", "CUDA_V", "VLLM_CPU_OMP")))
        print(f"[pd] {name}: {env} {shlex.join(srv.cmd)}", flush=True)
    stop = {"now": False}

    def on_signal(signum, _frame):
        stop["now"] = True

    try:
        with deployment:
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
            print(f"[pd] ready: OpenAI API at {deployment.url} (handoff contract checked, warm-up KV "
                  "transferred); Ctrl-C stops all", flush=True)
            while not stop["now"]:
                if deployment.prefill.proc.poll() is not None or deployment.decode.proc.poll() is not None:
                    print("[pd] an instance exited; stopping", file=sys.stderr)
                    return 1
                time.sleep(1.0)
    except HandoffContractError as e:
        print(f"vllm-loopspec-pd: {e}", file=sys.stderr)
        return 2
    return 0
