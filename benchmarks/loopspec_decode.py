"""Native vs loopspec decode throughput on one engine build: K sweep,
concurrency 1 and 8, interleaved trials, cost-model ceilings.

    python benchmarks/loopspec_decode.py [--checkpoint DIR] [--ks 1 2 4 8] [--repeats 5]

Method (RFC §5.3): every request's prefill completes before the timed window;
each arm generates exactly ``--new-tokens`` tokens per request (greedy, EOS
ignored) from the same prompts (``benchmarks/prompts/code.jsonl``); arms run
interleaved, in rotated order, ``--repeats`` times; throughput is committed
tokens / decode wall time. All engines live in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that idle engines cost nothing and
the runner can be profiled; a served engine adds IPC to every step alike.

Every timed trial is also profiled (a few perf_counter calls per pass): a
step splits into vLLM overhead ``S`` (everything outside the model forward),
the shallow passes (base pass over ``A``, draft passes, final fill), draft
logits/sampling, and verification. Per-step medians over the repeats give the
cost-model terms ``L(r)`` and ``P`` and the ceiling (DESIGN.md §4) printed
beside each measured speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_LOOPSPEC_DEBUG", "1")  # the drafter with the profiling hook

from vllm_loopspec.engine_internals import model_runner  # noqa: E402
from host import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def load_prompts(name: str) -> list[str]:
    path = ROOT / "benchmarks" / "prompts" / f"{name}.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def spec_counters(llm) -> dict:
    """This engine's acceptance counters (loopspec's per-runner stats: vLLM's
    Prometheus counters are process-wide and belong to the newest engine)."""
    drafter = getattr(model_runner(llm), "drafter", None)
    stats = getattr(drafter, "stats", None)
    if stats is None:
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [], "drafted_per_pos": []}
    return {"drafts": stats.speculating_rows, "draft_tokens": stats.drafted_tokens,
            "accepted": stats.accepted_tokens, "per_pos": list(stats.accepted_per_pos),
            "drafted_per_pos": list(stats.drafted_per_pos)}


def counter_delta(after: dict, before: dict) -> dict:
    def vec(key):
        return [a - (before[key][i] if i < len(before[key]) else 0) for i, a in enumerate(after[key])]

    return ({k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
            | {"per_pos": vec("per_pos"), "drafted_per_pos": vec("drafted_per_pos")})


def decode_trial(llm, prompts: list[str], new_tokens: int, profile: bool = False, temperature: float = 0.0) -> dict:
    """Prefill all requests, then time decoding until every one is done."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    tag = uuid.uuid4().hex[:6]
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True,
                                seed=1000 + i if temperature > 0 else None)
        engine.add_request(f"{tag}-{i}", p, params)
    produced: dict[str, int] = {}
    while len(produced) < len(prompts):
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    runner = model_runner(llm)
    forward_time = [0.0]
    original_forward = runner._model_forward
    if profile:
        if hasattr(getattr(runner, "drafter", None), "profile"):
            runner.drafter.profile = {}

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original_forward(*args, **kwargs)
            finally:
                forward_time[0] += time.perf_counter() - start

        runner._model_forward = timed_forward
    before = spec_counters(llm)
    start_tokens = sum(produced.values())
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    result = {
        "seconds": wall,
        "steps": steps,
        "tokens": len(prompts) * new_tokens - start_tokens,
        "spec": counter_delta(spec_counters(llm), before),
    }
    result["tokens_per_s"] = result["tokens"] / wall
    if profile:
        runner._model_forward = original_forward
        result["forward_seconds"] = forward_time[0]
        if hasattr(getattr(runner, "drafter", None), "profile"):
            result["phases"] = runner.drafter.profile
            runner.drafter.profile = None
    return result


def median_profile(runs: list[dict]) -> dict:
    """Per-step medians over the repeats of the timed trials (all profiled:
    the timers add a few perf_counter calls per pass), as one pseudo-trial."""
    def med(values):
        return statistics.median(values)

    steps = med([r["steps"] for r in runs])
    out = {"steps": steps,
           "seconds": med([r["seconds"] / r["steps"] for r in runs]) * steps,
           "forward_seconds": med([r["forward_seconds"] / r["steps"] for r in runs]) * steps}
    if runs and "phases" in runs[0]:
        names = {k for r in runs for k in r["phases"]}
        out["phases"] = {k: med([r["phases"].get(k, 0.0) / r["steps"] for r in runs]) * steps for k in names}
    return out


def cost_model(native_prof: dict, spec_prof: dict, k: int, d: int, loops: int, acceptance: float, rows: int) -> dict:
    """DESIGN.md §4 with measured S, P, L(rows) and L(rows*(K+1))."""
    s = (native_prof["seconds"] - native_prof["forward_seconds"]) / native_prof["steps"]
    l1 = native_prof["forward_seconds"] / native_prof["steps"] / loops
    phases = spec_prof["phases"]
    steps = spec_prof["steps"]
    shallow = phases.get("base", 0) + phases.get("draft", 0) + phases.get("final_fill", 0)
    shallow_per_pass = shallow / steps / (k + 1)
    p = max(shallow_per_pass - d * l1, 0.0) + phases.get("draft_logits", 0) / steps / k
    l_verify = phases.get("verify", 0) / steps / (loops - d)
    e = 1 + k * acceptance
    native_step = s + loops * l1
    round_cost = s + k * p + d * (k + 1) * l1 + (loops - d) * l_verify
    return {
        "S_ms": s * 1e3, "L1_ms": l1 * 1e3, "P_ms": p * 1e3, "L_verify_ms": l_verify * 1e3,
        "rows": rows, "E": e,
        "ceiling": e * native_step / round_cost,
        "ceiling_no_P_flat_L": e * native_step / (s + d * (k + 1) * l1 + (loops - d) * l1),
        "ceiling_weight_bound": loops * e / (d * (k + 1) + loops - d),
        "spec_S_ms": (spec_prof["seconds"] - spec_prof["forward_seconds"]) / steps * 1e3,
        "spec_phase_ms_per_step": {name: v / steps * 1e3 for name, v in phases.items()},
    }


def total_spec_counts(runs: list[dict]) -> dict:
    """Sum the trials' speculation counters (per-position lists padded)."""
    spec = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [], "drafted_per_pos": []}
    for r in runs:
        for key in ("drafts", "draft_tokens", "accepted"):
            spec[key] += r["spec"][key]
        for key in ("per_pos", "drafted_per_pos"):
            values = r["spec"][key]
            spec[key] += [0] * max(0, len(values) - len(spec[key]))
            for i, v in enumerate(values):
                spec[key][i] += v
    return spec


def summarize(runs: list[dict]) -> dict:
    tps = sorted(r["tokens_per_s"] for r in runs)
    q = statistics.quantiles(tps, n=4) if len(tps) >= 2 else [tps[0]] * 3
    spec = total_spec_counts(runs)
    out = {"median_tokens_per_s": statistics.median(tps), "q1": q[0], "q3": q[2], "min": tps[0], "max": tps[-1]}
    if spec["draft_tokens"]:
        out["acceptance"] = spec["accepted"] / spec["draft_tokens"]
        # P(draft j accepted | position j was drafted); acceptance is a prefix,
        # so this already includes every earlier position being accepted.
        out["acceptance_per_pos"] = [a / d for a, d in zip(spec["per_pos"], spec["drafted_per_pos"]) if d]
        out["tokens_per_round"] = 1 + spec["accepted"] / spec["drafts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", default="code")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy; > 0 samples (seeded per request), drafts from the processed q")
    ap.add_argument("--out", type=Path, default=RESULTS / "loopspec_decode.json")
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM

    prompts = load_prompts(args.prompts)
    common = dict(dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5, enforce_eager=True,
                  seed=0, disable_log_stats=False, max_num_seqs=16)
    arms = {"native": LLM(str(args.checkpoint), **common)}
    for k in args.ks:
        arms[f"K{k}"] = LLM(str(args.checkpoint), speculative_config={
            "method": "loopspec", "num_speculative_tokens": k, "draft_loops": args.draft_loops, "adaptive": False}, **common)
    loops = model_runner(arms["native"]).model.num_loops
    names = list(arms)
    runs = {c: {n: [] for n in names} for c in args.concurrency}
    for name in names:  # warm up every arm at every concurrency
        for c in args.concurrency:
            decode_trial(arms[name], prompts[:c], 16)
    for rep in range(args.repeats):
        for c in args.concurrency:
            batch = [prompts[(rep * c + i) % len(prompts)] for i in range(c)]
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                runs[c][name].append(decode_trial(arms[name], batch, args.new_tokens, profile=True,
                                                  temperature=args.temperature) | {"repeat": rep})
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    profiles = {c: {n: median_profile(runs[c][n]) for n in names} for c in args.concurrency}

    results = {}
    for c in args.concurrency:
        native = summarize(runs[c]["native"])
        results[str(c)] = {"native": native | {"profile": profiles[c]["native"]}}
        for k in args.ks:
            name = f"K{k}"
            summary = summarize(runs[c][name])
            summary["speedup"] = summary["median_tokens_per_s"] / native["median_tokens_per_s"]
            summary["profile"] = profiles[c][name]
            summary["cost_model"] = cost_model(profiles[c]["native"], profiles[c][name], k, args.draft_loops, loops,
                                               summary.get("acceptance", 0.0), c)
            summary["speedup_over_ceiling"] = summary["speedup"] / summary["cost_model"]["ceiling"]
            results[str(c)][name] = summary
    record = {
        "benchmark": "loopspec_decode",
        "checkpoint": str(args.checkpoint.relative_to(ROOT) if args.checkpoint.is_relative_to(ROOT) else args.checkpoint),
        "draft_loops": args.draft_loops, "loops": loops, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "prompts": args.prompts, "dtype": "float32",
        "temperature": args.temperature,
        "engine": "in-process vLLM V1 (VLLM_ENABLE_V1_MULTIPROCESSING=0), enforce_eager",
        "vllm": vllm.__version__, "torch": torch.__version__, "cpu": cpu_name(),
        "cores": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "results": results, "raw": {str(c): runs[c] for c in args.concurrency},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    md = args.out.with_suffix(".md")
    md.write_text(render_markdown(record))
    print(md.read_text())


def render_markdown(rec: dict) -> str:
    lines = [f"# loopspec decode throughput — {rec['checkpoint']} (d={rec['draft_loops']}, D={rec['loops']})", "",
             f"{rec['new_tokens']} new tokens per request, "
             f"{'greedy' if not rec['temperature'] else 'temperature ' + str(rec['temperature']) + ' (seeded)'}, "
             f"prompts `{rec['prompts']}`, "
             f"{rec['repeats']} interleaved repeats; vLLM {rec['vllm']}, torch {rec['torch']}, "
             f"{rec['cores']} cores; {rec['engine']}; {rec['when']}.", "",
             "| conc. | arm | tok/s median [IQR] | speedup | accept a | tokens/round | share of rounds accepting draft position 1..K "
             "| ceiling (measured S,P,L) | measured/ceiling | weight-bound ceiling |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, arms in rec["results"].items():
        for name, r in arms.items():
            row = f"| {c} | {name} | {r['median_tokens_per_s']:.1f} [{r['q1']:.1f}–{r['q3']:.1f}] |"
            if name == "native":
                lines.append(row + " 1.00 | – | 1 | – | – | – | – |")
                continue
            cm = r["cost_model"]
            pos = ", ".join(f"{v:.2f}" for v in r.get("acceptance_per_pos", []))
            lines.append(row + f" {r['speedup']:.2f} | {r.get('acceptance', 0):.2f} | {r.get('tokens_per_round', 1):.2f} "
                         f"| {pos} | {cm['ceiling']:.2f} | {r['speedup_over_ceiling']:.2f} | {cm['ceiling_weight_bound']:.2f} |")
    lines += ["", "Cost-model terms per arm (ms): S = native step outside the model, L1 = one loop over the "
              "native rows, P = fixed cost per draft pass (metadata, forward context, lm_head, sampling), "
              "L_verify = one deep loop over the verified rows; spec S = loopspec step outside the model.", "",
              "| conc. | arm | S | L1 | P | L_verify | spec S | phases per step (ms) |", "|---|---|---|---|---|---|---|---|"]
    for c, arms in rec["results"].items():
        for name, r in arms.items():
            if name == "native":
                continue
            cm = r["cost_model"]
            ph = ", ".join(f"{k}: {v:.2f}" for k, v in cm["spec_phase_ms_per_step"].items())
            lines.append(f"| {c} | {name} | {cm['S_ms']:.2f} | {cm['L1_ms']:.2f} | {cm['P_ms']:.2f} | "
                         f"{cm['L_verify_ms']:.2f} | {cm['spec_S_ms']:.2f} | {ph} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
