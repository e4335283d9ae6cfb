"""A minimal OpenAI-API router in front of one prefill and one decode
instance (vLLM's pull-mode ``NixlConnector`` protocol).

For ``/v1/completions`` and ``/v1/chat/completions``:

1. the request goes to the prefill instance with ``max_tokens=1``, not
   streamed, and ``kv_transfer_params={"do_remote_decode": true, ...}``; the
   prefill instance computes the prompt's KV at every loop, keeps its blocks
   and answers with ``kv_transfer_params`` naming them (engine, host, port,
   block ids);
2. the original request goes to the decode instance with those
   ``kv_transfer_params``; the decode instance pulls the blocks over NIXL and
   decodes (with loopspec when started so). Its response, streamed or not, is
   relayed as is.

Both legs carry the same ``X-Request-Id``. A prefill instance that cannot be
reached (connection refused or reset) is skipped: the decode instance then
computes the prompt itself (logged; the request still succeeds). A client
that disconnects cancels the leg in flight; blocks the prefill side keeps for
a decode leg that never comes are freed by vLLM's KV lease
(``kv_lease_duration``). Requests with ``n > 1`` are refused (one
``kv_transfer_params`` per request).

Where a maintained router is available, prefer it (README, "Disaggregated
prefill/decode"); this one is kept small on purpose.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger("vllm_loopspec.disagg.router")

# vLLM's API server closes a keep-alive connection after
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default) idle; aiohttp keeps idle
# connections 15 s. A pooled connection the server is closing at the moment
# we reuse it fails the send ("Can not write request body"). Dropping idle
# connections well before the server does removes that race; the one resend
# below covers a server started with a shorter keep-alive.
BACKEND_IDLE_KEEPALIVE_S = 1.0
RESENDABLE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionResetError)

PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, KV kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError" if status < 500
                                        else "RouterError", "code": status}}, status=status)


class Router:
    """aiohttp app relaying the two legs; :meth:`start_in_thread` runs it in a
    background event loop (tests, benchmarks), :meth:`run` in the foreground."""

    def __init__(self, prefill_url: str, decode_url: str, host: str = "127.0.0.1", port: int = 8000,
                 prefill_timeout_s: float = 300.0, decode_read_timeout_s: float = 300.0) -> None:
        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        # Every leg is bounded: the prefill leg (one token) as a whole, the
        # decode leg per read (a long stream may run longer than any total).
        self.prefill_timeout = aiohttp.ClientTimeout(total=prefill_timeout_s, sock_connect=10)
        self.decode_timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=decode_read_timeout_s)
        self.timeout = aiohttp.ClientTimeout(total=60, sock_connect=10)
        self.counts = {"routed": 0, "prefill_unreachable": 0, "prefill_failed": 0, "resent": 0}
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- app -----------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        for path in ROUTED_PATHS:
            app.router.add_post(path, self._route)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        connector = aiohttp.TCPConnector(keepalive_timeout=BACKEND_IDLE_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)

    async def _close(self, _app) -> None:
        if self._session:
            await self._session.close()

    async def _models(self, _request: web.Request) -> web.Response:
        async with self._session.get(self.decode_url + "/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    async def _health(self, _request: web.Request) -> web.Response:
        status = {}
        for name, url in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                async with self._session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    status[name] = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                status[name] = None
        ok = all(v == 200 for v in status.values())
        return web.json_response(status, status=200 if ok else 503)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if (body.get("n") or 1) > 1:
            return _error(400, "n > 1 is not supported over prefill/decode disaggregation; "
                               "send n separate requests")
        path = request.path
        request_id = request.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        self.counts["routed"] += 1

        decode = dict(body)
        try:
            async with await self._post(self.prefill_url + path, prefill_body(body), headers,
                                        self.prefill_timeout) as r:
                if r.status != 200:
                    # The request itself is bad (the decode side would refuse it
                    # alike): relay prefill's answer.
                    self.counts["prefill_failed"] += 1
                    return web.Response(body=await r.read(), status=r.status, content_type="application/json")
                answer = await r.json()
            params = answer.get("kv_transfer_params")
            if not params:
                return _error(502, "the prefill instance returned no kv_transfer_params: start it with "
                                   '--kv-transfer-config \'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}\'')
            decode["kv_transfer_params"] = params
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            self.counts["prefill_unreachable"] += 1
            logger.warning("prefill instance %s unreachable (%s): request %s is computed by the decode "
                           "instance", self.prefill_url, e, request_id)

        async with await self._post(self.decode_url + path, decode, headers, self.decode_timeout) as r:
            if not decode.get("stream"):
                return web.Response(body=await r.read(), status=r.status,
                                    content_type=r.content_type or "application/json")
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get(
                "Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def _post(self, url: str, body: dict[str, Any], headers: dict[str, str],
                    timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """POST, sent a second time (on a new connection) when the first send
        fails before any response: the server closed the connection (an idle
        keep-alive it was dropping), so it never ran the request."""
        try:
            return await self._session.post(url, json=body, headers=headers, timeout=timeout)
        except RESENDABLE as e:
            self.counts["resent"] += 1
            logger.info("resending to %s after the connection dropped before any response (%s)", url, e)
            return await self._session.post(url, json=body, headers=headers, timeout=timeout)

    # -- running -------------------------------------------------------------
    def run(self) -> None:
        web.run_app(self.app(), host=self.host, port=self.port, print=None)

    def start_in_thread(self, timeout: float = 30.0) -> "Router":
        """Serve from a background thread. ``port=0`` binds a free port at
        this moment (a port picked earlier may be taken by then on a shared
        host); ``url`` names it once this returns. A failed bind is raised here."""
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._runner = web.AppRunner(self.app())
            try:
                self._loop.run_until_complete(self._runner.setup())
                self._loop.run_until_complete(web.TCPSite(self._runner, self.host, self.port).start())
                self.port = self._runner.addresses[0][1]
                self.url = f"http://{self.host}:{self.port}"
            except BaseException as e:  # noqa: BLE001 - handed to the starting thread
                failure.append(e)
                started.set()
                self._loop.run_until_complete(self._runner.cleanup())
                self._loop.close()
                return
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=serve, name="pd-router", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError(f"router did not start on {self.url} within {timeout}s")
        if failure:
            self._thread = None
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop and self._thread:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._thread = None
