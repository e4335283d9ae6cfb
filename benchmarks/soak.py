"""Soak test: thousands of mixed requests against a loopspec ``vllm serve``.

    .venv/bin/python benchmarks/soak.py                                   # make soak: 2000 requests, concurrency 16
    .venv/bin/python benchmarks/soak.py --requests 100 --concurrency 8    # smoke run

Why. The tests send a few well-formed requests at a time. A server sees
thousands of mixed ones: every sampling-parameter combination, streaming
clients that hang up, a full KV cache that forces preemption, a prefix cache
that hands requests shared blocks. A sampled ``top_k`` request used to kill
the speculative engine (patch 5); crashes of that kind only show under such a
mix. This script runs one and checks what must hold.

Workload (fixed ``--seed``, so the mix is reproducible). ``--requests`` requests,
~60% ``/v1/completions`` and ~40% ``/v1/chat/completions``, half streamed, a
fifth of those closed by the client after 1-3 chunks (~10% cancelled). ~75%
start with one of ``--prefixes`` long shared prefixes (~460-token held-out
stdlib sources from ``benchmarks/prompts/long.jsonl``) followed by a varied
suffix from the code/text/repetitive sets, so the prefix cache is hit; the rest
are the short prompts alone. Sampling: temperature 0 / 0.7 / 1.2; sampled
requests get none / top_k / top_p / top_k+top_p, often a seed, sometimes n=2;
any request may get repetition/presence/frequency penalties, min_tokens, stop
strings, stop_token_ids, logprobs, ignore_eos; max_tokens 1..``--max-tokens``.
Every body asks for ``return_token_ids``.

Servers. ``vllm serve checkpoints/ouro-stdlib --speculative-config loopspec``
(float32, eager, max-model-len 1024, prefix caching on as by default,
``OMP_WAIT_POLICY=PASSIVE`` so that its OpenMP threads do not spin against
other engines on this machine) with ``--num-gpu-blocks-override`` set to
``--kv-fraction`` of the KV blocks the workload would hold at ``--concurrency``
(shared prefix blocks once, plus the private blocks of that many average
requests), so that the cache runs full and the scheduler preempts, and with
``--max-num-batched-tokens`` (512) below the longer prompts, so that prefills
are chunked (a seeded request in a chunked prefill killed every CPU engine
until patch 6). After the loopspec phase the same server without speculation
(the native server, same arguments) replays every greedy request that
completed, for the identity check.

Phases and checks.
1. Warm-up: ``--warmup`` requests from an independent mix; then the server
   is idle and RSS is sampled ("before").
2. Load: ``--requests`` at ``--concurrency``, bounded by ``--time-limit``;
   meanwhile ``/health`` is polled every second, and RSS (the ``vllm serve``
   process and all its descendants, VmRSS summed) and the scheduler gauges
   are sampled every ``--sample-every`` seconds. RSS grows over the first
   ~1500 requests (the native server's as much) and then stays flat, so
   the report gives the growth over the load's second half besides the
   before/after delta.
3. Idle: wait until no request runs or waits, send one 1-token probe (the
   scheduler's gauges are published only with engine outputs, so an abort
   as the last event would leave them stale), then read
   ``vllm:kv_cache_usage_perc`` (must be 0: freed and cached-but-unreferenced
   blocks count as free) and RSS ("after").
4. Counters over the load (difference of scrapes after 1 and after 3):
   preemptions, prefix-cache queries/hits, spec-decode acceptance, loopspec's.
5. Greedy identity: each greedy request that completed is sent again,
   unstreamed, to the native server; token ids, text and finish reason of
   every choice must be equal.

Exit status 1 on a crash (the process exited or ``/health`` answered other
than 200), any 5xx (in the status line or inside a stream), a greedy
mismatch, or leaked KV (usage or running/waiting requests not 0 when idle).
Client-side timeouts and 4xx answers are reported, not failed.

Report: ``--out`` (default ``benchmarks/results/soak_<N>x<C>.json``) with the
command line, git commit, versions and machine; server logs in ``--log-dir``
(a temporary folder by default).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve_bench import acceptance, spec_counters  # noqa: E402  (benchmarks/ is sys.path[0])
from vllm_loopspec.server_process import VllmServer  # noqa: E402

MAX_MODEL_LEN = 1024
BLOCK_SIZE = 128  # vLLM's default on CPU (platforms/cpu.py)
LOOKAHEAD = 4  # loopspec's default K: KV slots the scheduler reserves per request
COMMON_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
               "--gpu-memory-utilization", "0.5", "--seed", "0", "--disable-uvicorn-access-log")
SERVER_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "VLLM_CPU_KVCACHE_SPACE": "1"}
CHAT_TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # the checkpoint's ChatML
STOP_STRINGS = ("\n\n", "return", ":\n", "self.", ")")
STOP_TOKEN_TEXTS = ("\n", ":", "(", " =")
TOP_KS = (1, 5, 20, 50)
TOP_PS = (0.5, 0.9, 0.95)


# -- workload ------------------------------------------------------------------
@dataclass
class Spec:
    """One request of the mix: where it goes and how the client treats it.
    ``body`` has no ``model`` (added at send time, so the native server can
    replay it)."""

    index: int
    endpoint: str  # "completions" | "chat"
    stream: bool
    cancel_after: int | None  # chunks to read before closing the connection
    greedy: bool
    prefix: int | None  # shared prefix index, None for a standalone prompt
    prompt_tokens: int
    prefix_tokens: int
    body: dict = field(default_factory=dict)


def load_prompts(name: str) -> list[str]:
    path = ROOT / "benchmarks" / "prompts" / f"{name}.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def load_tokenizer(checkpoint: Path):
    """The checkpoint's fast tokenizer: prompt lengths (KV sizing) and stop ids."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))


def stop_token_ids(tokenizer) -> list[int]:
    """Ids of a few frequent code tokens, so ``stop_token_ids`` actually stops."""
    ids = {tokenizer.encode(text).ids[-1] for text in STOP_TOKEN_TEXTS}
    return sorted(ids)


def sampling_params(rng: random.Random, max_tokens: int, stop_ids: list[int]) -> tuple[dict, bool]:
    """One draw of the parameter mix; returns (params, greedy). ``n=2`` only
    when sampling: vLLM refuses it for greedy requests."""
    temperature = rng.choices((0.0, 0.7, 1.2), weights=(45, 35, 20))[0]
    greedy = temperature == 0.0
    p: dict = {"temperature": temperature, "max_tokens": rng.randint(1, max_tokens)}
    if not greedy or rng.random() < 0.2:  # greedy ignores filters: exercise that too
        kind = rng.choice(("none", "top_k", "top_p", "top_k+top_p"))
        if "top_k" in kind:
            p["top_k"] = rng.choice(TOP_KS)
        if "top_p" in kind:
            p["top_p"] = rng.choice(TOP_PS)
    if rng.random() < (0.6 if not greedy else 0.1):
        p["seed"] = rng.randrange(2**31)
    if not greedy and rng.random() < 0.15:
        p["n"] = 2
    if rng.random() < 0.2:
        penalty = rng.choice(("repetition", "presence", "frequency", "all"))
        if penalty in ("repetition", "all"):
            p["repetition_penalty"] = rng.choice((1.1, 1.3))
        if penalty in ("presence", "all"):
            p["presence_penalty"] = rng.choice((0.5, 1.0))
        if penalty in ("frequency", "all"):
            p["frequency_penalty"] = rng.choice((0.5, 1.0))
    if rng.random() < 0.15:
        p["min_tokens"] = rng.randint(1, p["max_tokens"])
    if rng.random() < 0.15:
        p["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if rng.random() < 0.1:
        p["stop_token_ids"] = rng.sample(stop_ids, rng.randint(1, len(stop_ids)))
    if rng.random() < 0.1:
        p["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        p["ignore_eos"] = True
    return p, greedy


def request_body(endpoint: str, prompt: str, params: dict) -> dict:
    """The OpenAI body for ``endpoint``: chat spells logprobs as a flag plus
    ``top_logprobs``."""
    body = {**params, "return_token_ids": True}
    if endpoint == "completions":
        return {**body, "prompt": prompt}
    if "logprobs" in body:
        body["top_logprobs"] = body.pop("logprobs")
        body["logprobs"] = True
    return {**body, "messages": [{"role": "user", "content": prompt}]}


def rendered(endpoint: str, prompt: str, head_only: bool = False) -> str:
    """The text the model sees, for lengths only (the server renders chat);
    ``head_only``: up to the end of ``prompt`` (a shared prefix)."""
    if endpoint != "chat":
        return prompt
    head, tail = CHAT_TEMPLATE.split("{}")
    return head + prompt + ("" if head_only else tail)


def make_workload(n: int, seed: int, max_tokens: int, num_prefixes: int, tokenizer) -> list[Spec]:
    """``n`` requests drawn from the mix with ``random.Random(seed)``."""
    rng = random.Random(seed)
    prefixes = load_prompts("long")[:num_prefixes]
    suffixes = [p for name in ("code", "text", "repetitive") for p in load_prompts(name)]
    stop_ids = stop_token_ids(tokenizer)
    specs = []
    for i in range(n):
        endpoint = "completions" if rng.random() < 0.6 else "chat"
        stream = rng.random() < 0.5
        cancel_after = rng.randint(1, 3) if stream and rng.random() < 0.2 else None
        prefix = rng.randrange(len(prefixes)) if rng.random() < 0.75 else None
        suffix = rng.choice(suffixes)
        prompt = suffix if prefix is None else f"{prefixes[prefix]}\n\n{suffix}"
        params, greedy = sampling_params(rng, max_tokens, stop_ids)
        prompt_tokens = len(tokenizer.encode(rendered(endpoint, prompt)).ids)
        prefix_tokens = 0 if prefix is None else \
            len(tokenizer.encode(rendered(endpoint, prefixes[prefix], head_only=True)).ids)
        specs.append(Spec(index=i, endpoint=endpoint, stream=stream, cancel_after=cancel_after, greedy=greedy,
                          prefix=prefix, prompt_tokens=prompt_tokens, prefix_tokens=prefix_tokens,
                          body=request_body(endpoint, prompt, params)))
    return specs


def workload_summary(specs: list[Spec]) -> dict:
    params = Counter(key for s in specs for key in s.body if key not in ("prompt", "messages"))
    return {"requests": len(specs),
            "endpoint": dict(Counter(s.endpoint for s in specs)),
            "streamed": sum(s.stream for s in specs),
            "cancel_planned": sum(s.cancel_after is not None for s in specs),
            "greedy": sum(s.greedy for s in specs),
            "shared_prefix": sum(s.prefix is not None for s in specs),
            "temperature": {str(k): v for k, v in sorted(Counter(s.body["temperature"] for s in specs).items())},
            "param_counts": dict(sorted(params.items())),
            "prompt_tokens": {"mean": statistics.fmean(s.prompt_tokens for s in specs),
                              "max": max(s.prompt_tokens for s in specs)},
            "max_tokens_mean": statistics.fmean(s.body["max_tokens"] for s in specs)}


# -- KV sizing -----------------------------------------------------------------
def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def kv_blocks(specs: list[Spec], concurrency: int, fraction: float) -> tuple[int, float]:
    """``--num-gpu-blocks-override`` for the load: ``fraction`` of the blocks
    the workload holds at ``concurrency`` (every shared prefix's full blocks
    once, plus ``concurrency`` requests' private blocks: prompt tail, output,
    lookahead, times n), but never less than one max-length request needs.
    Returns (blocks, estimated demand)."""
    shared: dict[tuple[str, int], int] = {}
    private = []
    for s in specs:
        cached = s.prefix_tokens // BLOCK_SIZE if s.prefix is not None else 0
        if s.prefix is not None:
            shared[(s.endpoint, s.prefix)] = cached
        total = blocks_for(s.prompt_tokens + s.body["max_tokens"] + LOOKAHEAD)
        private.append((total - cached) * s.body.get("n", 1))
    demand = sum(shared.values()) + concurrency * statistics.fmean(private)
    floor = blocks_for(MAX_MODEL_LEN) + 2
    return max(floor, round(fraction * demand)), demand


# -- HTTP client ---------------------------------------------------------------
def endpoint_path(endpoint: str) -> str:
    return "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"


def error_of(payload: dict) -> dict | None:
    """vLLM's error object, from an error response or an in-stream error event."""
    if isinstance(payload.get("error"), dict):
        return payload["error"]
    if payload.get("object") == "error":
        return payload
    return None


def error_message(text: str) -> tuple[str, str]:
    """(type, message) of an error response body, tolerant of non-JSON."""
    try:
        err = error_of(json.loads(text)) or {}
    except ValueError:
        return "non-json", text[:500]
    return str(err.get("type", "unknown")), str(err.get("message", text))[:500]


def merge_choice(choices: dict[int, dict], choice: dict) -> None:
    """Accumulate one (streamed or complete) choice: text, token ids, finish."""
    acc = choices.setdefault(choice.get("index", 0), {"text": "", "token_ids": [], "finish_reason": None})
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or choice.get("message") or {}).get("content")
    acc["text"] += text or ""
    acc["token_ids"] += choice.get("token_ids") or []
    if choice.get("finish_reason"):
        acc["finish_reason"] = choice["finish_reason"]


def outcome_for_status(status: int) -> str:
    return "4xx" if 400 <= status < 500 else "5xx" if status >= 500 else "http_other"


async def read_stream(resp: aiohttp.ClientResponse, cancel_after: int | None, result: dict) -> None:
    """Consume an SSE stream into ``result``; close the connection after
    ``cancel_after`` chunks with choices (a client that hangs up)."""
    chunks = 0
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            result["outcome"] = "ok"
            return
        payload = json.loads(data)
        if err := error_of(payload):
            code = int(err.get("code") or 500)
            result.update(outcome=outcome_for_status(code), status=code, error_type=str(err.get("type")),
                          error=str(err.get("message"))[:500], in_stream=True)
            return
        for choice in payload.get("choices") or []:
            merge_choice(result["choices"], choice)
        if payload.get("choices"):
            chunks += 1
        if cancel_after is not None and chunks >= cancel_after:
            resp.close()
            result["outcome"] = "cancelled"
            return
    result.update(outcome="conn_error", error_type="stream ended without [DONE]", error="")


async def send(session: aiohttp.ClientSession, base_url: str, model: str, spec: Spec,
               timeout: float, stream: bool | None = None) -> dict:
    """Send one request; never raises. ``stream`` overrides the spec's (the
    replay sends everything unstreamed)."""
    stream = spec.stream if stream is None else stream
    body = {**spec.body, "model": model, "stream": stream}
    result: dict = {"index": spec.index, "outcome": None, "status": None, "choices": {}}
    t0 = time.monotonic()
    try:
        async with session.post(base_url + endpoint_path(spec.endpoint), json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            result["status"] = resp.status
            if resp.status != 200:
                etype, message = error_message(await resp.text())
                result.update(outcome=outcome_for_status(resp.status), error_type=etype, error=message)
            elif stream:
                await read_stream(resp, spec.cancel_after, result)
            else:
                for choice in (await resp.json()).get("choices") or []:
                    merge_choice(result["choices"], choice)
                result["outcome"] = "ok"
    except asyncio.TimeoutError:
        result.update(outcome="timeout", error_type="client timeout", error=f"no answer within {timeout} s")
    except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
        result.update(outcome="conn_error", error_type=type(exc).__name__, error=str(exc)[:500])
    result["latency_s"] = time.monotonic() - t0
    result["output_tokens"] = sum(len(c["token_ids"]) for c in result["choices"].values())
    return result


async def run_requests(base_url: str, model: str, specs: list[Spec], concurrency: int, timeout: float,
                       deadline: float | None = None, stream: bool | None = None,
                       label: str = "") -> list[dict]:
    """Send ``specs`` from ``concurrency`` workers; past ``deadline``
    (monotonic) the rest are recorded as not sent. Results in spec order."""
    pending = iter(specs)
    results: list[dict] = []
    step = max(1, len(specs) // 20)
    t0 = time.monotonic()
    connector = aiohttp.TCPConnector(limit=concurrency + 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            for spec in pending:
                if deadline is not None and time.monotonic() > deadline:
                    results.append({"index": spec.index, "outcome": "not_sent", "choices": {}})
                    continue
                results.append(await send(session, base_url, model, spec, timeout, stream))
                if label and len(results) % step == 0:
                    print(f"[soak] {label}: {len(results)}/{len(specs)} "
                          f"{dict(Counter(r['outcome'] for r in results))} {time.monotonic() - t0:.0f} s",
                          flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r["index"])


# -- outcomes ------------------------------------------------------------------
def error_key(result: dict) -> str:
    """Groups errors by kind: outcome, status, type, and the message with its
    numbers blanked (ids and lengths differ between otherwise equal errors)."""
    message = re.sub(r"\d+", "N", result.get("error") or "")[:120]
    return f"{result['outcome']} {result.get('status')} {result.get('error_type')}: {message}"


def outcome_summary(results: list[dict]) -> dict:
    """Requests by outcome, errors by kind with an example, latencies and
    tokens of the requests that completed."""
    errors: dict[str, dict] = {}
    for r in results:
        if r["outcome"] in ("ok", "cancelled", "not_sent"):
            continue
        entry = errors.setdefault(error_key(r), {"count": 0, "example": r.get("error"), "request": r["index"]})
        entry["count"] += 1
    ok = [r for r in results if r["outcome"] == "ok"]
    latencies = sorted(r["latency_s"] for r in ok)
    return {"outcomes": dict(Counter(r["outcome"] for r in results)),
            "errors": errors,
            "output_tokens_ok": sum(r["output_tokens"] for r in ok),
            "latency_s_ok": {"p50": statistics.median(latencies), "p95": latencies[int(0.95 * (len(latencies) - 1))],
                             "max": latencies[-1]} if latencies else None}


# -- server processes and /metrics ---------------------------------------------
def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (the API server's engine core and any
    helper it spawned), from the parent ids in /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(parents.get(p, []))
    return tree


def rss_sample(pid: int, t0: float, phase: str) -> dict:
    """Resident memory of the server's process tree, per process and summed."""
    procs = {}
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        name = re.search(r"^Name:\s+(.*)$", status, re.M).group(1)
        rss = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        procs[f"{p} {name}"] = int(rss.group(1)) / 1024 if rss else 0.0
    return {"t_s": round(time.monotonic() - t0, 1), "phase": phase,
            "rss_mib": round(sum(procs.values()), 1), "processes": {k: round(v, 1) for k, v in procs.items()}}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {name: value summed over label sets}."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def loopspec_counters(text: str) -> dict[str, float]:
    """Every ``loopspec:`` sample, labels kept (per loop, position, reason)."""
    return {m.group(1) + (m.group(2) or ""): float(m.group(3))
            for m in re.finditer(r"^(loopspec:[\w:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M)}


GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
COUNTERS = ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total", "vllm:generation_tokens_total",
            "vllm:request_success_total")


def scrape(srv: VllmServer) -> dict:
    """Gauges, counters, spec-decode and loopspec counters from one /metrics."""
    text = srv.metrics()
    values = parse_metrics(text)
    return {"values": {k: values.get(k) for k in GAUGES + COUNTERS}, "spec": spec_counters(text),
            "loopspec": loopspec_counters(text)}


def counter_deltas(before: dict, after: dict) -> dict:
    """What the load did, from two scrapes: preemptions, prefix cache,
    acceptance, loopspec's counters."""
    d = {k: (after["values"][k] or 0.0) - (before["values"][k] or 0.0) for k in COUNTERS}
    queries, hits = d["vllm:prefix_cache_queries_total"], d["vllm:prefix_cache_hits_total"]
    return {"counters": d,
            "preemptions": int(d["vllm:num_preemptions_total"]),
            "prefix_cache": {"queries_tokens": int(queries), "hits_tokens": int(hits),
                             "hit_rate": hits / queries if queries else None},
            "spec_decode": acceptance(before["spec"], after["spec"]),
            "loopspec": {k: v - before["loopspec"].get(k, 0.0) for k, v in after["loopspec"].items()}}


class Watch:
    """Background checks during the load: ``/health`` every second (any
    non-200 answer or refused connection counts as a crash; a slow answer on
    this loaded machine is only recorded), the process's liveness, and every
    ``every`` seconds RSS and the scheduler's gauges."""

    def __init__(self, srv: VllmServer, every: float, t0: float) -> None:
        self.srv, self.every, self.t0 = srv, every, t0
        self.health = {"polls": 0, "failures": 0, "timeouts": 0, "max_latency_s": 0.0, "first_failure": None}
        self.exit_code: int | None = None
        self.rss: list[dict] = []
        self.gauges: list[dict] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(self._health(session), self._samples(session))

    def stop(self) -> None:
        self._stop.set()

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; True when it is time to stop."""
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False

    async def _health(self, session: aiohttp.ClientSession) -> None:
        while not await self._sleep(1.0):
            self.health["polls"] += 1
            if self.srv.proc.poll() is not None:
                self.exit_code = self.srv.proc.returncode
                self._failure(f"process exited with {self.exit_code}")
                return
            t = time.monotonic()
            try:
                async with session.get(self.srv.url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                    if r.status != 200:
                        self._failure(f"/health answered {r.status}")
            except asyncio.TimeoutError:
                self.health["timeouts"] += 1
            except aiohttp.ClientError as exc:
                self._failure(f"/health: {type(exc).__name__}: {exc}")
            self.health["max_latency_s"] = max(self.health["max_latency_s"], time.monotonic() - t)

    def _failure(self, what: str) -> None:
        self.health["failures"] += 1
        self.health["first_failure"] = self.health["first_failure"] or {
            "t_s": round(time.monotonic() - self.t0, 1), "what": what}

    async def _samples(self, session: aiohttp.ClientSession) -> None:
        while not await self._sleep(self.every):
            self.rss.append(rss_sample(self.srv.proc.pid, self.t0, "load"))
            try:
                async with session.get(self.srv.url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
                    values = parse_metrics(await r.text())
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
            self.gauges.append({"t_s": round(time.monotonic() - self.t0, 1),
                                **{k.split(":")[1]: values.get(k) for k in GAUGES},
                                "preemptions": values.get("vllm:num_preemptions_total")})


def wait_idle(srv: VllmServer, timeout: float = 300.0) -> bool:
    """Wait until the scheduler reports no running or waiting request (False:
    timed out, or the server exited)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if srv.proc.poll() is not None:
            return False
        values = scrape(srv)["values"]
        if not values["vllm:num_requests_running"] and not values["vllm:num_requests_waiting"]:
            return True
        time.sleep(1.0)
    return False


def probe(srv: VllmServer, model: str) -> None:
    """One 1-token request: refreshes the gauges, which the engine publishes
    only with outputs."""
    srv.post("/v1/completions", {"model": model, "prompt": "import os\n", "max_tokens": 1, "temperature": 0})
    time.sleep(1.0)  # the stats reach the front end after the output


def idle_kv(srv: VllmServer, model: str) -> dict:
    """KV and queue state once the server is idle; ``leaked`` if any is not 0."""
    idle = wait_idle(srv)
    probe(srv, model)
    values = scrape(srv)["values"]
    state = {k.split(":")[1]: values[k] for k in GAUGES}
    return {"became_idle": idle, **state, "leaked": not idle or any(state.values())}


# -- greedy identity -----------------------------------------------------------
def replayable(specs: list[Spec], results: list[dict]) -> list[Spec]:
    """Greedy requests that completed: deterministic, so native must match."""
    return [s for s, r in zip(specs, results) if s.greedy and r["outcome"] == "ok"]


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(spec: Spec, loopspec: dict, native: dict) -> dict | None:
    """None when every choice agrees (token ids, text, finish reason), else
    what differs, with the request so that it can be replayed alone."""
    if native["outcome"] != "ok":
        return {"request": spec.index, "native_error": f"{native['outcome']}: {native.get('error')}"}
    diffs = []
    for i in sorted(set(loopspec["choices"]) | set(native["choices"])):
        a, b = loopspec["choices"].get(i, {}), native["choices"].get(i, {})
        for key in ("token_ids", "text", "finish_reason"):
            if a.get(key) != b.get(key):
                diffs.append({"choice": i, "field": key, "loopspec": a.get(key), "native": b.get(key),
                              **({"first_difference": first_difference(a.get(key) or [], b.get(key) or [])}
                                 if key == "token_ids" else {})})
    if not diffs:
        return None
    return {"request": spec.index, "endpoint": spec.endpoint, "stream": spec.stream, "body": spec.body,
            "differences": diffs}


# -- phases --------------------------------------------------------------------
def server_args(blocks: int, batched_tokens: int, speculative: bool) -> list[str]:
    return [*COMMON_ARGS, "--num-gpu-blocks-override", str(blocks), "--max-num-batched-tokens", str(batched_tokens),
            *(["--speculative-config", "loopspec"] if speculative else [])]


def start_server(args: argparse.Namespace, blocks: int, speculative: bool,
                 name: str) -> tuple[VllmServer, float]:
    """``vllm serve`` with the soak's arguments and environment; (server, startup s)."""
    srv = VllmServer(args.checkpoint, *server_args(blocks, args.max_num_batched_tokens, speculative), env=SERVER_ENV,
                     log_path=args.log_dir / f"{name}.serve.log")
    t0 = time.monotonic()
    srv.__enter__()
    return srv, time.monotonic() - t0


def log_errors(srv: VllmServer, limit: int = 10) -> list[str]:
    """The distinct exception lines of the server's log (the root cause of a
    crash; its tail is only shutdown noise)."""
    text = srv.log_path.read_text(errors="replace") if srv.log_path else ""
    found = re.findall(r"^.*\bERROR\b.*?\] ((?:\w+\.)*\w*(?:Error|Exception): .*)$", text, re.M)
    return list(dict.fromkeys(found))[:limit]


async def load_with_watch(srv: VllmServer, model: str, specs: list[Spec], args: argparse.Namespace,
                          t0: float) -> tuple[list[dict], Watch]:
    watch = Watch(srv, args.sample_every, t0)
    watcher = asyncio.create_task(watch.run())
    try:
        results = await run_requests(srv.url, model, specs, args.concurrency, args.request_timeout,
                                     deadline=time.monotonic() + args.time_limit, label="load")
    finally:
        watch.stop()
        await watcher
    return results, watch


def memory_section(before: dict, after: dict | None, during: list[dict]) -> dict:
    """RSS before and after the load (the server idle both times), the
    delta, the growth over the second half of the load (the better leak
    signal: see the module docstring), and the series."""
    half = during[len(during) // 2:]
    return {"before": before, "after": after,
            "delta_mib": round(after["rss_mib"] - before["rss_mib"], 1) if after else None,
            "second_half_growth_mib": round(half[-1]["rss_mib"] - half[0]["rss_mib"], 1) if half else None,
            "max_during_mib": max((s["rss_mib"] for s in during), default=None),
            "series": [{k: s[k] for k in ("t_s", "rss_mib")} for s in during]}


def server_section(srv: VllmServer, watch: Watch) -> dict:
    """Crashed: the process exited or ``/health`` failed at any point."""
    exit_code = srv.proc.poll()
    if exit_code is not None and watch.health["first_failure"] is None:  # died before the first poll
        watch.health["first_failure"] = {"t_s": None, "what": f"process exited with {exit_code} before the load"}
    crashed = watch.health["failures"] > 0 or exit_code is not None
    return {"crashed": crashed, "exit_code": exit_code, "health": watch.health,
            "log": str(srv.log_path), "log_errors": log_errors(srv) if crashed else []}


def loopspec_phase(args: argparse.Namespace, specs: list[Spec], warmup: list[Spec],
                   blocks: int) -> tuple[dict, list]:
    """Warm-up, load, idle checks and counters against the loopspec server.
    Returns (report section, load results)."""
    srv, startup = start_server(args, blocks, speculative=True, name="loopspec")
    section: dict = {"server_command": srv.cmd, "startup_s": round(startup, 1)}
    t0 = time.monotonic()
    try:
        model = srv.model_name()
        print(f"[soak] loopspec server up in {startup:.0f} s; warm-up of {len(warmup)}", flush=True)
        warm = asyncio.run(run_requests(srv.url, model, warmup, args.concurrency, args.request_timeout))
        section["warmup"] = outcome_summary(warm)
        # A server that died in the warm-up still gets the load (it fails
        # fast) so that the watch records the crash and the report is written.
        before = scrape(srv) if wait_idle(srv) else None
        before_rss = rss_sample(srv.proc.pid, t0, "before")
        t_load = time.monotonic()
        results, watch = asyncio.run(load_with_watch(srv, model, specs, args, t0))
        section["load"] = {"wall_s": round(time.monotonic() - t_load, 1), **outcome_summary(results)}
        section["server"] = server_section(srv, watch)
        alive = srv.proc.poll() is None
        section["kv_idle"] = idle_kv(srv, model) if alive else {"leaked": None, "why": "server exited"}
        after_rss = rss_sample(srv.proc.pid, t0, "after") if alive else None
        section["metrics"] = counter_deltas(before, scrape(srv)) if alive and before else None
        section["gauges_series"] = watch.gauges
        section["memory"] = memory_section(before_rss, after_rss, watch.rss)
    finally:
        srv.stop()
    return section, results


def native_phase(args: argparse.Namespace, specs: list[Spec], results: list[dict], blocks: int) -> dict:
    """Replay the completed greedy requests on the native server and compare."""
    todo = replayable(specs, results)
    srv, startup = start_server(args, blocks, speculative=False, name="native")
    print(f"[soak] native server up in {startup:.0f} s; replaying {len(todo)} greedy requests", flush=True)
    try:
        model = srv.model_name()
        t0 = time.monotonic()
        native = asyncio.run(run_requests(srv.url, model, todo, args.concurrency, args.request_timeout,
                                          stream=False, label="greedy replay"))
        wall = time.monotonic() - t0
        exit_code = srv.proc.poll()
    finally:
        srv.stop()
    by_index = {r["index"]: r for r in results}
    diffs = [d for s, n in zip(todo, native) if (d := compare(s, by_index[s.index], n))]
    mismatches = [d for d in diffs if "native_error" not in d]
    return {"server_command": srv.cmd, "startup_s": round(startup, 1), "wall_s": round(wall, 1),
            "native_exit_code": exit_code, "replay": outcome_summary(native),
            "compared": len(todo) - (len(diffs) - len(mismatches)), "mismatches": len(mismatches),
            "not_compared": [d for d in diffs if "native_error" in d], "mismatch_details": mismatches[:20]}


# -- report --------------------------------------------------------------------
def environment() -> dict:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    return {"timestamp": datetime.now().isoformat(timespec="seconds"),
            "git_commit": git("rev-parse", "HEAD"),
            "git_modified": [line.split(maxsplit=1)[1] for line in git("status", "--porcelain", "-uno").splitlines()],
            "vllm": version("vllm"), "torch": version("torch"), "aiohttp": version("aiohttp"),
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu_model": model.group(1) if model else None, "cpu_count": os.cpu_count(),
            "load_avg_at_start": os.getloadavg()}


def failures(report: dict) -> list[str]:
    """Why the soak failed (empty: passed)."""
    ls, greedy = report["loopspec"], report["greedy_identity"]
    out = []
    if ls["server"]["crashed"]:
        out.append(f"server crashed: {ls['server']['health']['first_failure']}")
    fives = sum(section.get("outcomes", {}).get("5xx", 0)
                for section in (ls["warmup"], ls["load"], greedy.get("replay", {})))
    if fives:
        out.append(f"{fives} 5xx answers")
    if greedy.get("mismatches"):
        out.append(f"{greedy['mismatches']} greedy mismatches")
    if ls["kv_idle"]["leaked"] is not False:
        out.append(f"KV or requests left when idle: {ls['kv_idle']}")
    return out


def human_summary(report: dict) -> str:
    ls, greedy = report["loopspec"], report["greedy_identity"]
    m, mem = ls.get("metrics") or {}, ls["memory"]
    spec = m.get("spec_decode") or {}
    lines = [
        f"soak {report['settings']['requests']}x{report['settings']['concurrency']}: "
        f"{'PASS' if not report['failures'] else 'FAIL: ' + '; '.join(report['failures'])}",
        f"  requests: {ls['load']['outcomes']} in {ls['load']['wall_s']:.0f} s",
        *[f"  error x{e['count']}: {k}" for k, e in ls["load"]["errors"].items()],
        *[f"  server log: {line}" for line in ls["server"]["log_errors"]],
        f"  crashed: {ls['server']['crashed']} (health polls {ls['server']['health']['polls']}, "
        f"slow {ls['server']['health']['timeouts']})",
        f"  greedy identity: {greedy.get('compared')} compared, {greedy.get('mismatches')} mismatches",
        f"  idle KV: usage {ls['kv_idle'].get('kv_cache_usage_perc')}, running "
        f"{ls['kv_idle'].get('num_requests_running')}, waiting {ls['kv_idle'].get('num_requests_waiting')}",
        f"  RSS: {mem['before']['rss_mib']:.0f} MiB before, "
        f"{mem['after']['rss_mib'] if mem['after'] else float('nan'):.0f} after (delta {mem['delta_mib']}), "
        f"max {mem['max_during_mib']}, growth over the load's second half {mem['second_half_growth_mib']}",
        f"  preemptions {m.get('preemptions')}, prefix cache hit rate "
        f"{(m.get('prefix_cache') or {}).get('hit_rate')}, KV blocks {report['settings']['kv_blocks']}",
        f"  acceptance {spec.get('acceptance_rate')}, mean accepted length {spec.get('mean_accepted_length')}",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of the mix is drawn from 1..this")
    p.add_argument("--prefixes", type=int, default=4, help="shared long prefixes")
    p.add_argument("--kv-fraction", type=float, default=0.7,
                   help="KV blocks as a fraction of the estimated demand at --concurrency")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="the scheduler's token budget per step: below the prompt lengths, so prefills are chunked")
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the load; the rest is not sent")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS/gauge samples")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args(argv)
    args.checkpoint = args.checkpoint.resolve()
    args.out = args.out or ROOT / "benchmarks" / "results" / f"soak_{args.requests}x{args.concurrency}.json"
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="soak_"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    tokenizer = load_tokenizer(args.checkpoint)
    specs = make_workload(args.requests, args.seed, args.max_tokens, args.prefixes, tokenizer)
    warmup = make_workload(args.warmup, args.seed + 1, args.max_tokens, args.prefixes, tokenizer)
    blocks, demand = kv_blocks(specs, args.concurrency, args.kv_fraction)
    print(f"[soak] {args.requests} requests at concurrency {args.concurrency}; {blocks} KV blocks "
          f"(estimated demand {demand:.0f}); logs in {args.log_dir}", flush=True)
    report: dict = {
        "command": [sys.executable, *sys.argv], "env": environment(),
        "settings": {"requests": args.requests, "concurrency": args.concurrency, "warmup": args.warmup,
                     "seed": args.seed, "max_tokens": args.max_tokens, "prefixes": args.prefixes,
                     "kv_fraction": args.kv_fraction, "kv_blocks": blocks, "kv_block_size": BLOCK_SIZE,
                     "kv_demand_estimate": round(demand, 1), "max_num_batched_tokens": args.max_num_batched_tokens,
                     "time_limit_s": args.time_limit,
                     "request_timeout_s": args.request_timeout, "server_env": SERVER_ENV,
                     "log_dir": str(args.log_dir)},
        "workload": workload_summary(specs)}
    report["loopspec"], results = loopspec_phase(args, specs, warmup, blocks)
    report["greedy_identity"] = native_phase(args, specs, results, blocks)
    report["failures"] = failures(report)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["env"]["load_avg_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(human_summary(report))
    print(f"[soak] report: {args.out} ({report['wall_s']:.0f} s)")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
