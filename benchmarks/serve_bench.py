"""Serving benchmark: native vs loopspec vs ngram (vs suffix) decoding behind
``vllm serve``, driven by vLLM's own client ``vllm bench serve``.

    .venv/bin/python benchmarks/serve_bench.py        # all arms, rates 1 4 inf, 32 prompts

Method. Each arm is one ``vllm serve checkpoints/ouro-stdlib`` process
(float32, eager, max-model-len 1024, max-num-seqs 16, seed 0,
VLLM_CPU_KVCACHE_SPACE=1), started after the previous one has exited, so arms
never share the CPU. Arms differ only in ``--speculative-config``:

* ``native``   no speculation;
* ``loopspec`` ``{"method":"loopspec","num_speculative_tokens":K,"draft_loops":D}``;
* ``ngram``    prompt lookup, ``num_speculative_tokens`` K_b, n-gram sizes 2..4;
* ``suffix``   suffix decoding (needs ``arctic_inference``; recorded as skipped
  when it cannot be imported).

One warm-up completion runs first; then, per request rate (Poisson arrivals at
``--rates`` req/s; ``inf`` sends everything at t=0, i.e. saturation bounded by
``--max-num-seqs``), ``vllm bench serve --backend vllm`` (``/v1/completions``,
streamed) sends the same ``--num-prompts`` prompts: a round-robin mix of
``benchmarks/prompts/{code,text,repetitive}.jsonl``, none repeated, no chat
template, greedy, exactly ``--output-len`` tokens each (EOS ignored). The
prompts go to the client as a ShareGPT-format file (``--dataset-name sharegpt``
with ``--sharegpt-output-len``): it sends the raw prompt, as ``custom`` does
with ``--skip-chat-template``, but without ``custom``'s pandas dependency,
which vllm-cpu does not install.

Per arm and rate the combined JSON keeps vLLM's throughput and TTFT / TPOT /
ITL / E2EL statistics, the per-request lists needed for latency CDFs, and two
numbers vLLM's client does not report:

* tokens per streamed chunk = output tokens / (len(itls) + 1) per request.
  Speculation commits several tokens per engine step and the server streams
  them as one chunk, so this is what a streaming user sees. vLLM's ITL is
  measured per *chunk* (a speculative ITL spans several tokens); TPOT is per
  token. Native can exceed 1 under load when the front end coalesces the
  outputs of consecutive steps before the client reads them.
* acceptance from the server's ``/metrics``
  (``vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total``),
  as the difference between scrapes just before and after the rate's run.

Outputs (``--out-dir``, default ``benchmarks/results``): ``serving.json``,
``serving.md`` and ``serving_raw/`` (the client's JSON per arm and rate, with
the generated texts dropped and times rounded to microseconds, and the prompt
file sent). Server logs go to ``--log-dir`` (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_loopspec.server_process import VllmServer, vllm_command  # noqa: E402

PROMPT_SETS = ("code", "text", "repetitive")
ARMS = ("native", "loopspec", "ngram", "suffix")
SERVER_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
               "--max-num-seqs", "16", "--gpu-memory-utilization", "0.5", "--seed", "0")
PERCENTILES = (50, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


# -- dataset -------------------------------------------------------------------
def load_prompt_set(name: str) -> list[str]:
    path = ROOT / "benchmarks" / "prompts" / f"{name}.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def mixed_prompts(n: int) -> tuple[list[str], dict[str, int]]:
    """The first ``n`` prompts of a round-robin over the prompt sets, so that any
    ``n`` gets an even mix of code, text and repetitive prompts; duplicates
    (within or across sets) are skipped so that no prompt is sent twice."""
    sets = {name: load_prompt_set(name) for name in PROMPT_SETS}
    seen: set[str] = set()
    out: list[str] = []
    mix = dict.fromkeys(PROMPT_SETS, 0)
    for i in range(max(len(s) for s in sets.values())):
        for name, prompts in sets.items():
            if i < len(prompts) and prompts[i] not in seen and len(out) < n:
                seen.add(prompts[i])
                out.append(prompts[i])
                mix[name] += 1
    if len(out) < n:
        raise SystemExit(f"--num-prompts {n}: only {len(out)} distinct prompts in benchmarks/prompts")
    return out, mix


def write_dataset(prompts: list[str], path: Path) -> None:
    """ShareGPT-format JSON for ``vllm bench serve --dataset-name sharegpt``: the
    first turn is sent as the raw prompt; the (empty) answer is ignored because
    ``--sharegpt-output-len`` fixes the output length."""
    convs = [{"id": f"p{i}", "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": ""}]}
             for i, p in enumerate(prompts)]
    path.write_text(json.dumps(convs, indent=1) + "\n")


# -- arms ----------------------------------------------------------------------
def suffix_unavailable() -> str | None:
    """None if suffix decoding can run, else why not (checked in a child process
    so that a broken install cannot take this driver down)."""
    proc = subprocess.run([sys.executable, "-c", "import arctic_inference"], capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["import failed"])[-1]
    return f"import arctic_inference failed: {last}"


def speculative_config(arm: str, args: argparse.Namespace) -> dict | None:
    if arm == "native":
        return None
    if arm == "loopspec":
        return {"method": "loopspec", "num_speculative_tokens": args.loopspec_k, "draft_loops": args.loopspec_d,
                "adaptive": False}
    if arm == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.baseline_k,
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if arm == "suffix":
        return {"method": "suffix", "num_speculative_tokens": args.baseline_k}
    raise ValueError(arm)


def server_args(spec: dict | None) -> list[str]:
    return [*SERVER_ARGS, *(["--speculative-config", json.dumps(spec)] if spec else [])]


# -- /metrics ------------------------------------------------------------------
def spec_counters(metrics_text: str) -> dict:
    """vLLM's speculative-decoding counters, summed over label sets; accepted
    tokens per draft position as a list."""
    def values(name: str) -> list[tuple[str, float]]:
        pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$"
        return [(m.group(1) or "", float(m.group(2))) for m in re.finditer(pattern, metrics_text, re.M)]

    out = {key: sum(v for _, v in values(f"vllm:spec_decode_num_{key}_total")) for key in SPEC_COUNTERS}
    per_pos: dict[int, float] = {}
    for labels, v in values("vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        pos = int(re.search(r'position="(\d+)"', labels).group(1))
        per_pos[pos] = per_pos.get(pos, 0.0) + v
    out["accepted_per_pos"] = [per_pos[p] for p in sorted(per_pos)]
    return out


def acceptance(before: dict, after: dict) -> dict | None:
    """Acceptance over one rate's run; None when nothing was drafted (native)."""
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    if d["drafts"] <= 0:
        return None
    pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0.0)
           for i, a in enumerate(after["accepted_per_pos"])]
    return {"drafts": int(d["drafts"]), "draft_tokens": int(d["draft_tokens"]),
            "accepted_tokens": int(d["accepted_tokens"]),
            "acceptance_rate": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
            "mean_accepted_length": 1 + d["accepted_tokens"] / d["drafts"],
            "accepted_per_position": [p / d["drafts"] for p in pos]}


def scrape(srv: VllmServer) -> dict:
    time.sleep(0.5)  # let the last step's stats reach the front end's counters
    return spec_counters(srv.metrics())


# -- vllm bench serve ----------------------------------------------------------
def rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def bench_command(srv: VllmServer, model: str, dataset: Path, rate: float, raw_dir: Path,
                  raw_name: str, args: argparse.Namespace) -> list[str]:
    return [vllm_command(), "bench", "serve",
            "--backend", "vllm", "--base-url", srv.url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", model,
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--disable-shuffle", "--no-oversample", "--num-prompts", str(args.num_prompts),
            "--sharegpt-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
            "--request-rate", rate_label(rate), "--seed", str(args.seed),
            "--percentile-metrics", ",".join(LATENCY_METRICS),
            "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--save-detailed", "--result-dir", str(raw_dir),
            "--result-filename", raw_name, "--disable-tqdm"]


def run_bench(cmd: list[str], log_path: Path) -> None:
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=3600)
    if proc.returncode:
        tail = log_path.read_text()[-2000:]
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}:\n{tail}")


def shrink_raw(path: Path) -> dict:
    """Drop generated texts and round times to microseconds, so the raw files
    stay small enough to commit; returns the (shrunk) result."""
    raw = json.loads(path.read_text())
    raw.pop("generated_texts", None)
    for key in ("ttfts", "latencies", "start_times", "queue_times"):
        if raw.get(key):
            raw[key] = [round(x, 6) if isinstance(x, float) else x for x in raw[key]]
    if raw.get("itls"):
        raw["itls"] = [[round(x, 6) for x in req] for req in raw["itls"]]
    path.write_text(json.dumps(raw))
    return raw


# -- summary -------------------------------------------------------------------
def latency_stats(raw: dict, metric: str) -> dict:
    return {"mean": raw.get(f"mean_{metric}_ms"),
            **{f"p{p}": raw.get(f"p{p}_{metric}_ms") for p in PERCENTILES}}


def per_request(raw: dict) -> dict:
    """Per-request lists of the successful requests (CDFs, tokens per chunk)."""
    ok = [i for i, err in enumerate(raw["errors"]) if not err]
    itls = [raw["itls"][i] for i in ok]
    out_tokens = [raw["output_lens"][i] for i in ok]
    chunks = [len(x) + 1 for x in itls]
    return {"ttft_s": [raw["ttfts"][i] for i in ok], "e2el_s": [raw["latencies"][i] for i in ok],
            "itl_s": itls, "input_tokens": [raw["input_lens"][i] for i in ok], "output_tokens": out_tokens,
            "chunks": chunks,
            "tokens_per_chunk": [t / c for t, c in zip(out_tokens, chunks)]}


def summarize(raw: dict, accept: dict | None) -> dict:
    reqs = per_request(raw)
    tpc = reqs["tokens_per_chunk"]
    return {"completed": raw["completed"], "failed": raw["failed"], "duration_s": raw["duration"],
            "request_throughput": raw["request_throughput"], "output_throughput": raw["output_throughput"],
            "total_token_throughput": raw["total_token_throughput"],
            "max_concurrent_requests": raw.get("max_concurrent_requests"),
            **{f"{m}_ms": latency_stats(raw, m) for m in LATENCY_METRICS},
            "tokens_per_chunk": {"mean": statistics.fmean(tpc) if tpc else None,
                                 "median": statistics.median(tpc) if tpc else None},
            "acceptance": accept, "per_request": reqs}


# -- driver --------------------------------------------------------------------
def warm_up(srv: VllmServer, model: str) -> None:
    """One short completion so that first-request costs stay out of the first rate."""
    srv.post("/v1/completions", {"model": model, "prompt": "def main():\n", "max_tokens": 16,
                                 "temperature": 0, "ignore_eos": True})


def run_arm(arm: str, args: argparse.Namespace, dataset: Path, raw_dir: Path, log_dir: Path) -> dict:
    """Serve one arm and run every rate against it; errors are recorded, not raised,
    so that one failing arm does not cost the others."""
    spec = speculative_config(arm, args)
    model = str(args.checkpoint)
    srv = VllmServer(model, *server_args(spec), log_path=log_dir / f"{arm}.serve.log")
    result: dict = {"speculative_config": spec, "server_command": srv.cmd,
                    "server_env": {"VLLM_CPU_KVCACHE_SPACE": srv.env["VLLM_CPU_KVCACHE_SPACE"]}, "rates": {}}
    t0 = time.time()
    try:
        with srv:
            result["startup_s"] = time.time() - t0
            warm_up(srv, model)
            for rate in args.rates:
                result["rates"][rate_label(rate)] = run_rate(srv, model, arm, rate, args, dataset, raw_dir, log_dir)
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON
        result["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        print(f"[serve_bench] {arm}: {result['error']}", file=sys.stderr)
    result["wall_s"] = time.time() - t0
    return result


def run_rate(srv: VllmServer, model: str, arm: str, rate: float, args: argparse.Namespace,
             dataset: Path, raw_dir: Path, log_dir: Path) -> dict:
    raw_name = f"{arm}_rate{rate_label(rate)}.json"
    cmd = bench_command(srv, model, dataset, rate, raw_dir, raw_name, args)
    print(f"[serve_bench] {arm} @ {rate_label(rate)} req/s ...", flush=True)
    before = scrape(srv)
    t0 = time.time()
    run_bench(cmd, log_dir / f"{arm}.bench.log")
    summary = summarize(shrink_raw(raw_dir / raw_name), acceptance(before, scrape(srv)))
    print(f"[serve_bench] {arm} @ {rate_label(rate)}: {summary['output_throughput']:.1f} tok/s, "
          f"{summary['tokens_per_chunk']['mean']:.2f} tok/chunk, "
          f"acceptance {summary['acceptance'] and round(summary['acceptance']['acceptance_rate'], 3)} "
          f"({time.time() - t0:.0f} s)", flush=True)
    return {"bench_command": cmd, "raw_file": str(Path(raw_dir.name) / raw_name),
            "wall_s": time.time() - t0, **summary}


def environment() -> dict:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"timestamp": datetime.now().isoformat(timespec="seconds"), "vllm": version("vllm"),
            "torch": version("torch"), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "platform": platform.platform()}


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"# Serving benchmark — {s['checkpoint']}", "",
             f"`vllm bench serve --backend vllm`, {s['num_prompts']} prompts "
             f"({', '.join(f'{k} {v}' for k, v in report['dataset']['mix'].items())}), "
             f"{s['output_len']} output tokens (EOS ignored), greedy; one `vllm serve` per arm "
             f"({' '.join(SERVER_ARGS)}); vLLM {report['env']['vllm']}, torch {report['env']['torch']}, "
             f"{report['env']['cpu_count']} CPUs; {report['env']['timestamp']}. "
             "Latencies in ms (p50 / p99); ITL is per streamed chunk, TPOT per token.", "",
             "| arm | rate | req/s | out tok/s | TTFT | TPOT | ITL | E2EL | tok/chunk | accept |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, res in report["arms"].items():
        if "skipped" in res or not res.get("rates"):
            note = res.get("skipped") or res.get("error", "no rates run").splitlines()[0][:120]
            lines.append(f"| {arm} | – | {note} |" + " |" * 7)
            continue
        for rate, r in res["rates"].items():
            lat = " | ".join(f"{fmt(r[f'{m}_ms']['p50'])} / {fmt(r[f'{m}_ms']['p99'])}" for m in LATENCY_METRICS)
            acc = r["acceptance"]["acceptance_rate"] if r["acceptance"] else None
            lines.append(f"| {arm} | {rate} | {fmt(r['request_throughput'], 2)} | {fmt(r['output_throughput'])} "
                         f"| {lat} | {fmt(r['tokens_per_chunk']['mean'], 2)} | {fmt(acc, 2)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--rates", nargs="+", type=float, default=[1.0, 4.0, float("inf")],
                   help="request rates in req/s; inf = all requests at t=0")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--loopspec-k", type=int, default=4, help="loopspec num_speculative_tokens")
    p.add_argument("--loopspec-d", type=int, default=2, help="loopspec draft_loops")
    p.add_argument("--baseline-k", type=int, default=4, help="num_speculative_tokens of ngram and suffix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--log-dir", type=Path, default=None, help="server and client logs (default: a temp dir)")
    args = p.parse_args(argv)
    args.checkpoint = args.checkpoint.resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    raw_dir = args.out_dir / "serving_raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="serve_bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[serve_bench] logs in {log_dir}", flush=True)

    prompts, mix = mixed_prompts(args.num_prompts)
    dataset = raw_dir / "dataset.json"
    write_dataset(prompts, dataset)
    report = {"env": environment(),
              "settings": {"checkpoint": str(args.checkpoint.relative_to(ROOT) if args.checkpoint.is_relative_to(ROOT)
                                             else args.checkpoint),
                           "num_prompts": args.num_prompts, "output_len": args.output_len,
                           "rates": [rate_label(r) for r in args.rates], "seed": args.seed,
                           "loopspec_k": args.loopspec_k, "loopspec_d": args.loopspec_d,
                           "baseline_k": args.baseline_k,
                           "server_args": list(SERVER_ARGS), "command": [sys.executable, *sys.argv]},
              "dataset": {"file": str(Path(raw_dir.name) / dataset.name), "mix": mix},
              "arms": {}}
    t0 = time.time()
    suffix_problem = suffix_unavailable() if "suffix" in args.arms else None
    for arm in args.arms:
        if arm == "suffix" and suffix_problem:
            report["arms"][arm] = {"skipped": suffix_problem}
            continue
        report["arms"][arm] = run_arm(arm, args, dataset, raw_dir, log_dir)
        report["wall_s"] = time.time() - t0
        write_outputs(report, args.out_dir)  # partial results survive a later crash
    report["wall_s"] = time.time() - t0
    write_outputs(report, args.out_dir)
    print(markdown(report))


def write_outputs(report: dict, out_dir: Path) -> None:
    (out_dir / "serving.json").write_text(json.dumps(report) + "\n")  # compact: per-request lists
    (out_dir / "serving.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
