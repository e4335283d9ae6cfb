"""Disaggregated prefill/decode benchmark: P/D with loopspec decode against
colocated loopspec and colocated native, and the cost of the KV transfer.

    .venv/bin/python benchmarks/pd_bench.py serving     # TTFT / ITL / E2EL at fixed request rates
    .venv/bin/python benchmarks/pd_bench.py transfer    # KV transfer time vs prompt length and layers

``serving``. Three arms, one after the other (never sharing the CPU with
each other): ``pd_loopspec`` (``vllm_loopspec.disagg.PDDeployment``: a
prefill instance, a decode instance with
``{"method":"loopspec","num_speculative_tokens":K,"draft_loops":d}`` and the
router), ``loopspec`` and ``native`` (one colocated ``vllm serve``). Every
instance has the flags of ``benchmarks/serve_bench.py`` (float32, eager,
max-model-len 1024, max-num-seqs 16, seed 0, VLLM_CPU_KVCACHE_SPACE=1).
vLLM's own client ``vllm bench serve`` sends the same prompts (the mixed
code/text/repetitive set of serve_bench, streamed ``/v1/completions``,
greedy, EOS ignored) at each fixed Poisson rate to the router or the
server. On a 2-core machine the prefill and decode instances share the
cores that one colocated server has to itself: P/D here measures the
protocol's overhead (two legs, a KV pull per request), not the isolation
P/D buys on separate devices.

``transfer``. One P/D deployment per model shape (native decode; the
transfer does not depend on it), sequential requests with token-id prompts
of several lengths, ``max_tokens=1`` on the decode leg. Per request, from
the decode instance's ``/metrics`` deltas: NIXL transfer time
(``vllm:nixl_xfer_time_seconds``), bytes and descriptors, and the router's
two legs timed by the client. Shapes: the bundled checkpoint (N=2, R=4)
and Ouro-1.4B's width (hidden 2048, 16 KV heads x 128, R=4) with
``load_format=dummy`` and N cut by ``--hf-overrides`` (the full N=24 needs
192 MiB of KV per 128-token block in fp32, more memory than this shared
machine has for two instances).

Outputs: ``benchmarks/results/pd_serving.json`` (+ ``pd_serving_raw/``, the
client's JSON per arm and rate) and ``benchmarks/results/pd_transfer.json``.
Both record that the machine was shared (``--shared-note``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_bench as sb  # noqa: E402
from report import pd_serving_table as serving_markdown  # noqa: E402
from report import pd_transfer_table as transfer_markdown  # noqa: E402

from vllm_loopspec.disagg.contract import cache_config_info  # noqa: E402
from vllm_loopspec.disagg.launcher import PDDeployment, metric_sum  # noqa: E402
from vllm_loopspec.server_process import VllmServer  # noqa: E402

ARMS = ("pd_loopspec", "loopspec", "native")
SHARED_NOTE = ("machine shared with two other engineers' vLLM engines during the run (2 cores): "
               "absolute figures are noisy")


# -- serving -------------------------------------------------------------------------------
def run_serving_arm(arm: str, args, dataset: Path, raw_dir: Path, log_dir: Path) -> dict:
    spec = None if arm == "native" else {"method": "loopspec", "num_speculative_tokens": args.loopspec_k,
                                         "draft_loops": args.loopspec_d}
    model = str(args.checkpoint)
    result: dict = {"speculative_config": spec, "rates": {}}
    t0 = time.time()
    try:
        if arm == "pd_loopspec":
            ctx = PDDeployment(model, serve_args=sb.SERVER_ARGS, decode_speculative_config=json.dumps(spec),
                               log_dir=log_dir / arm)
            result["prefill_command"], result["decode_command"] = ctx.prefill.cmd, ctx.decode.cmd
        else:
            ctx = VllmServer(model, *sb.server_args(spec), log_path=log_dir / f"{arm}.serve.log")
            result["server_command"] = ctx.cmd
        with ctx:
            result["startup_s"] = time.time() - t0
            front = ctx.client if arm == "pd_loopspec" else ctx
            metrics_of = ctx.decode if arm == "pd_loopspec" else ctx
            sb.warm_up(front, model)
            for rate in args.rates:
                raw_name = f"{arm}_rate{sb.rate_label(rate)}.json"
                cmd = sb.bench_command(front, model, dataset, rate, raw_dir, raw_name, args)
                print(f"[pd_bench] {arm} @ {sb.rate_label(rate)} req/s ...", flush=True)
                before = sb.scrape(metrics_of)
                before_text = metrics_of.metrics()
                sb.run_bench(cmd, log_dir / f"{arm}.bench.log")
                after_text = metrics_of.metrics()
                summary = sb.summarize(sb.shrink_raw(raw_dir / raw_name), sb.acceptance(before, sb.scrape(metrics_of)))
                summary["decode_prompt_tokens"] = {
                    s: metric_sum(after_text, "vllm:prompt_tokens_by_source_total", f'source="{s}"')
                    - metric_sum(before_text, "vllm:prompt_tokens_by_source_total", f'source="{s}"')
                    for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
                result["rates"][sb.rate_label(rate)] = {"bench_command": cmd,
                                                        "raw_file": f"{raw_dir.name}/{raw_name}", **summary}
                r = summary
                print(f"[pd_bench] {arm} @ {sb.rate_label(rate)}: TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
                      f"ITL p50 {r['itl_ms']['p50']:.0f} ms, E2EL p50 {r['e2el_ms']['p50']:.0f} ms", flush=True)
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON
        result["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        print(f"[pd_bench] {arm}: {result['error']}", file=sys.stderr)
    result["wall_s"] = time.time() - t0
    return result


def serving(args) -> dict:
    raw_dir = args.out_dir / "pd_serving_raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="pd_bench_"))
    prompts, mix = sb.mixed_prompts(args.num_prompts)
    dataset = raw_dir / "dataset.json"
    sb.write_dataset(prompts, dataset)
    report = {"env": {**sb.environment(), "shared_machine": args.shared_note},
              "settings": {"checkpoint": str(args.checkpoint), "num_prompts": args.num_prompts,
                           "output_len": args.output_len, "rates": [sb.rate_label(r) for r in args.rates],
                           "loopspec_k": args.loopspec_k, "loopspec_d": args.loopspec_d,
                           "server_args": list(sb.SERVER_ARGS), "command": ["python", *sys.argv]},
              "dataset": {"file": f"{raw_dir.name}/{dataset.name}", "mix": mix}, "arms": {}}
    for arm in args.arms:
        report["arms"][arm] = run_serving_arm(arm, args, dataset, raw_dir, log_dir)
        (args.out_dir / "pd_serving.json").write_text(json.dumps(report) + "\n")
    print(serving_markdown(report))
    shutil.rmtree(log_dir, ignore_errors=True)
    return report


# -- transfer ------------------------------------------------------------------------------
def transfer_shapes(args) -> list[dict]:
    from vllm_loopspec.tools.make_checkpoint import make_checkpoint

    shapes = [] if args.skip_bundled else [{"label": "bundled (N=2, R=4, 2 KV heads x 64)",
                                            "checkpoint": str(args.checkpoint), "extra_args": [], "kv_cache_gib": 1}]
    if args.ouro_1p4b_layers:
        ckpt = make_checkpoint(args.work_dir / "ouro-1.4b-config", preset="ouro-1.4b", config_only=True)
        for n in args.ouro_1p4b_layers:
            shapes.append({"label": f"Ouro-1.4B width, N={n}, R=4 (dummy weights)", "checkpoint": str(ckpt),
                           # the bundled tokenizer (4096 ids < the model's vocabulary): text warm-up
                           "extra_args": ["--load-format", "dummy", "--tokenizer", str(args.checkpoint),
                                          "--hf-overrides",
                                          json.dumps({"num_hidden_layers": n})],
                           "kv_cache_gib": args.ouro_kv_gib})
    return shapes


def transfer(args) -> dict:
    args.work_dir.mkdir(parents=True, exist_ok=True)
    report = {"env": {**sb.environment(), "shared_machine": args.shared_note},
              "settings": {"prompt_lens": args.prompt_lens, "repeats": args.repeats,
                           "command": ["python", *sys.argv]}, "shapes": []}
    out = args.out_dir / "pd_transfer.json"
    if args.append and out.exists():
        earlier = json.loads(out.read_text())
        report["shapes"] = earlier["shapes"]
        report["settings"]["earlier_commands"] = [earlier["settings"]["command"],
                                                  *earlier["settings"].get("earlier_commands", [])]
    for shape in transfer_shapes(args):
        print(f"[pd_bench] transfer: {shape['label']}", flush=True)
        entry = {**shape, "rows": []}
        report["shapes"].append(entry)
        serve = list(sb.SERVER_ARGS)
        serve[serve.index("--max-model-len") + 1] = str(max(max(args.prompt_lens) + 64, 1024))
        serve += shape["extra_args"]
        try:
            with PDDeployment(shape["checkpoint"], serve_args=serve, decode_speculative_config=None,
                              log_dir=args.work_dir / "logs", env={"VLLM_CPU_KVCACHE_SPACE": str(shape["kv_cache_gib"])},
                              warmup=True) as pd:
                model = pd.decode.model_name()
                entry["block_size"] = int(cache_config_info(pd.decode.metrics())["block_size"])
                for n in args.prompt_lens:
                    entry["rows"].append(measure_length(pd, model, n, args.repeats))
                    print(f"[pd_bench]   {n} tokens: {entry['rows'][-1]['summary']}", flush=True)
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
            print(f"[pd_bench] {shape['label']}: {entry['error']}", file=sys.stderr)
        (args.out_dir / "pd_transfer.json").write_text(json.dumps(report, indent=1) + "\n")
    print(transfer_markdown(report))
    return report


def measure_length(pd: PDDeployment, model: str, n: int, repeats: int) -> dict:
    from vllm_loopspec.disagg.router import prefill_body

    names = ("vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count",
             "vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_descriptors_sum")
    samples = []
    for r in range(repeats):
        ids = [(7 + 13 * i + 101 * r + n) % 400 + 5 for i in range(n)]  # distinct per repeat: no prefix hits
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        before = {k: metric_sum(pd.decode.metrics(), k) for k in names}
        t0 = time.perf_counter()
        params = pd.prefill.post("/v1/completions", prefill_body(body))["kv_transfer_params"]
        t1 = time.perf_counter()
        pd.decode.post("/v1/completions", {**body, "kv_transfer_params": params})
        t2 = time.perf_counter()
        time.sleep(0.3)
        after = {k: metric_sum(pd.decode.metrics(), k) for k in names}
        d = {k: after[k] - before[k] for k in names}
        if d["vllm:nixl_xfer_time_seconds_count"] < 1:
            samples.append({"error": "no transfer recorded"})
            continue
        samples.append({"prefill_leg_ms": 1e3 * (t1 - t0), "decode_leg_ms": 1e3 * (t2 - t1),
                        "xfer_ms": 1e3 * d["vllm:nixl_xfer_time_seconds_sum"],
                        "transfers": d["vllm:nixl_xfer_time_seconds_count"],
                        "mib": d["vllm:nixl_bytes_transferred_sum"] / 2**20,
                        "descriptors": d["vllm:nixl_num_descriptors_sum"]})
    ok = [s for s in samples if "error" not in s]
    med = {k: statistics.median(s[k] for s in ok) for k in ok[0]} if ok else {}
    if med:
        med["gib_per_s"] = med["mib"] / 1024 / (med["xfer_ms"] / 1e3) if med["xfer_ms"] else None
    return {"prompt_tokens": n, "samples": samples, "summary": med}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("serving", "transfer"))
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--rates", nargs="+", type=float, default=[0.5, 1.0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--loopspec-k", type=int, default=4)
    p.add_argument("--loopspec-d", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-lens", nargs="+", type=int, default=[16, 128, 256, 512, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ouro-1p4b-layers", nargs="*", type=int, default=[1, 2, 4])
    p.add_argument("--ouro-kv-gib", type=int, default=2)
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "pd_bench")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--shared-note", default=SHARED_NOTE)
    p.add_argument("--skip-bundled", action="store_true", help="transfer: only the Ouro-1.4B-width shapes")
    p.add_argument("--append", action="store_true", help="transfer: add to the shapes of pd_transfer.json")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    args.checkpoint = args.checkpoint.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    serving(args) if args.mode == "serving" else transfer(args)


if __name__ == "__main__":
    main()
