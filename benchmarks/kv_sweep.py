"""Offline K-sweep (RFC §5.3): native decoding, loopspec at every (d, K), and
vLLM's own ``ngram`` and ``suffix`` methods, on one engine build, side by side.

    python benchmarks/kv_sweep.py                      # the full grid (~60 min here)
    python benchmarks/kv_sweep.py --settings short --concurrency 1 8 \\
        --draft-loops 2 --ks 4 --short-prompts repetitive --out benchmarks/results/kv_sweep_repetitive.json

Grid: ``--draft-loops`` d × ``--ks`` K (fixed K: ``"adaptive": false``) ×
``--concurrency`` × ``--settings`` (``short``: the ``mixed`` prompt set, 128
new tokens; ``long``: ~512-token prompts from ``long``, 192 new tokens) ×
``--temperatures``, plus ``--peers`` (``ngram`` at each ``--peer-ks``,
``suffix`` with vLLM's defaults), the native arm, and with ``--adaptive``
loopspec's adaptive policy at each d. ``--compiled`` runs every engine in
vLLM's default (compiled) mode instead of ``enforce_eager``.

``--pipelined-draft-loops`` d1 × ``--pipelined-ks`` K add the pipelined
schedule (issue 12, ``"schedule": "pipelined"``); its arms also report the
pipeline's own counters (first proposals kept, ticks and restarts per step,
model-forward ms per tick) and its ceiling at the measured acceptance
(``benchmarks/pipeline_ceiling.py``'s step price with this run's ``S``,
``P`` and ``L(1)``). The pipelined schedule is measured with:

    python benchmarks/kv_sweep.py --compiled --peers --settings short --concurrency 1 8 \
        --temperatures 0 0.8 --draft-loops 1 2 3 --ks 2 4 8 \
        --pipelined-draft-loops 1 2 --pipelined-ks 8 16 --pipelined-second-loops 2 \
        --out benchmarks/results/pipelined_sweep.json

The adaptive policy (issue 13) is measured with:

    python benchmarks/kv_sweep.py --adaptive --compiled --peers --temperatures 0 0.8 \
        --repeats 3 --out benchmarks/results/adaptive_sweep.json

Method: every engine lives in this process and stays alive, so arms
interleave (rotated order, ``--repeats`` times) under the same machine noise
(``--native-beside-auto``: native also runs just before each "auto" arm's
trial, which it is then compared with as well: arms far apart in the
rotation see this machine's speed drift between them).
Each trial adds ``c`` requests, runs engine steps until every request has
finished its prefill and produced its first token, then times decoding until
all are done (greedy unless ``--temperature``; EOS ignored: every arm
generates ``new_tokens`` per request; the tokens committed inside the timed
window are counted). Reported per arm: median and IQR of
committed tokens/s, acceptance per draft position and rows verified (from
vLLM's own scheduler, identically for every method), the per-step time split
(loopspec's profile: base shallow pass, draft passes, final fill, draft
logits, verification, and vLLM's work outside the model), and for loopspec
the cost-model ceiling of DESIGN.md §4 built from the measured terms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loopspec_decode  # noqa: E402  (shared trial machinery; sets the in-process env)
from vllm_loopspec.engine_internals import model_runner, scheduler as engine_scheduler  # noqa: E402
from host import cpu_name  # noqa: E402
from loopspec_decode import (  # noqa: E402
    RESULTS, ROOT, cost_model, counter_delta, decode_trial, load_prompts, median_profile,
    total_spec_counts,
)

SETTINGS = {"short": {"new_tokens": 128}, "long": {"new_tokens": 192}}
MAX_MODEL_LEN = 1024


# -- arms ---------------------------------------------------------------------

SECOND_NATIVE = "native (second engine)"


def beside(arm: str) -> str:
    """The name of the native trials run just before ``arm``'s
    (``--native-beside-auto``)."""
    return f"native (beside {arm})"


PER_STEP_PREFIX = "loopspec per-step "  # the arm of --auto-depths: "auto" choosing each step's depth


def per_step_arm(depths) -> str:
    return f"{PER_STEP_PREFIX}d{','.join(map(str, depths))}"


def arm_specs(args) -> dict[str, dict | None]:
    """Arm name -> vLLM ``speculative_config`` (None = native)."""
    arms: dict[str, dict | None] = {"native": None}
    if args.native_twice:
        # The same native engine built twice: how far two engines of one
        # computation differ here, the floor under any ratio to native.
        arms[SECOND_NATIVE] = None
    for d in args.draft_loops:
        for k in args.ks:
            arms[f"loopspec d{d} K{k}"] = {"method": "loopspec", "num_speculative_tokens": k, "draft_loops": d,
                                           "adaptive": False}
        if args.adaptive:
            for schedule in args.adaptive_schedules:
                # "adaptive": the policy's rounds and plain steps; "auto": those
                # or pipelined steps, chosen per step by measured rate.
                name = f"loopspec d{d} adaptive" if schedule == "round" else f"loopspec d{d} auto"
                arms[name] = {"method": "loopspec", "draft_loops": d, "schedule": schedule}
                for k_max in args.adaptive_max_ks:  # the same bounded by max_speculative_tokens
                    arms[f"{name} max{k_max}"] = arms[name] | {"max_speculative_tokens": k_max}
    if len(args.auto_depths) > 1:
        # "draft_loops" as a list: the chooser's arms at every depth, one engine.
        arms[per_step_arm(args.auto_depths)] = {"method": "loopspec", "draft_loops": list(args.auto_depths),
                                                "schedule": "auto"}
    for d in args.pipelined_draft_loops:
        for k in args.pipelined_ks:
            arms[f"pipelined d{d} K{k}"] = {"method": "loopspec", "num_speculative_tokens": k, "draft_loops": d,
                                            "schedule": "pipelined"}
            for d2 in args.pipelined_second_loops:
                if d < d2 and d2 % d == 0:
                    arms[f"pipelined d{d} K{k} s{d2}"] = arms[f"pipelined d{d} K{k}"] | {"second_proposal_loop": d2}
    if "ngram" in args.peers:
        for k in args.peer_ks:
            arms[f"ngram K{k}"] = {"method": "ngram", "num_speculative_tokens": k,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if "suffix" in args.peers:
        arms["suffix"] = {"method": "suffix", "num_speculative_tokens": args.suffix_k}
    return arms


def suffix_unavailable() -> str | None:
    try:
        import arctic_inference  # noqa: F401
    except ImportError as exc:
        return f"vLLM's suffix method needs the arctic-inference package, which is not importable here ({exc})"
    return None


# -- per-engine acceptance ------------------------------------------------------

class SchedulerSpecCounter:
    """Sum the ``SpecDecodingStats`` this engine's own scheduler produces.

    vLLM's Prometheus counters are process-wide (all in-process engines feed
    the newest one's), so the benchmark wraps ``make_spec_decoding_stats`` on
    this scheduler instance: the same numbers vLLM reports, per engine, for
    every method alike. Instrumentation of this script only."""

    def __init__(self, llm) -> None:
        self.totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [], "drafted_per_pos": []}
        scheduler = engine_scheduler(llm)
        original = scheduler.make_spec_decoding_stats

        def counted(stats, num_draft_tokens, num_accepted_tokens, *a, **kw):
            if not num_draft_tokens:  # vLLM counts nothing for these either
                return original(stats, num_draft_tokens, num_accepted_tokens, *a, **kw)
            t = self.totals
            t["drafts"] += 1
            t["draft_tokens"] += num_draft_tokens
            t["accepted"] += num_accepted_tokens
            grow = max(num_draft_tokens - len(t["per_pos"]), 0)
            t["per_pos"] += [0] * grow
            t["drafted_per_pos"] += [0] * grow
            for i in range(num_draft_tokens):
                t["drafted_per_pos"][i] += 1
            for i in range(num_accepted_tokens):
                t["per_pos"][i] += 1
            return original(stats, num_draft_tokens, num_accepted_tokens, *a, **kw)

        scheduler.make_spec_decoding_stats = counted

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.totals))


PIPELINE_COUNTERS = ("pipelined_steps", "pipelined_ticks", "pipelined_restarts", "pipelined_pruned",
                     "pipelined_second_proposals",
                     "pipelined_second_kept", "drafted_tokens", "accepted_tokens", "rounds")


def pipeline_counters(llm) -> dict | None:
    drafter = getattr(model_runner(llm), "drafter", None)
    options = getattr(drafter, "options", None)  # None: native, or a peer method's proposer
    if options is None or options.schedule not in ("pipelined", "auto"):
        return None
    stats = drafter.stats
    return {name: getattr(stats, name) for name in PIPELINE_COUNTERS}


def timed_trial(llm, counter: SchedulerSpecCounter, prompts: list[str], new_tokens: int,
                temperature: float) -> dict:
    before, pipeline_before = counter.snapshot(), pipeline_counters(llm)
    result = decode_trial(llm, prompts, new_tokens, profile=True, temperature=temperature)
    result["spec"] = counter_delta(counter.snapshot(), before)
    if pipeline_before is not None:
        after = pipeline_counters(llm)
        result["pipeline"] = {name: after[name] - pipeline_before[name] for name in PIPELINE_COUNTERS}
    return result


def pipeline_summary(runs: list[dict], native_profile: dict, round_costs: dict | None, k: int, d1: int,
                     loops: int) -> dict:
    """The pipelined arm's own counters over its trials (first proposals
    kept: loopspec's acceptance; vLLM accepts every handed chain), and its
    ceiling at that acceptance: ``pipeline_ceiling``'s step price with this
    run's S and L(1) (native profile) and P (the round arm at d1, K), rows
    of a tick costed at L(1) (a loop pass here barely grows with rows)."""
    import pipeline_ceiling

    total = {name: sum(r["pipeline"][name] for r in runs) for name in PIPELINE_COUNTERS}
    steps = max(total["rounds"], 1)
    forward = sum(r["forward_seconds"] for r in runs)
    a1 = total["accepted_tokens"] / max(total["drafted_tokens"], 1)
    drafted = max(total["drafted_tokens"], 1)
    out = {"first_proposal_acceptance": a1, "ticks_per_step": total["pipelined_ticks"] / steps,
           "second_kept_share": total["pipelined_second_kept"] / drafted,
           "second_proposals_per_step": total["pipelined_second_proposals"] / steps,
           "restarts_per_step": total["pipelined_restarts"] / steps, "pruned_per_step": total["pipelined_pruned"] / steps,
           "drafted_per_step": total["drafted_tokens"] / steps,
           "forward_ms_per_tick": forward / max(total["pipelined_ticks"], 1) * 1e3, "counts": total}
    if round_costs is not None:
        S, P, L1 = round_costs["S_ms"], round_costs["P_ms"], round_costs["L1_ms"]
        ms, ticks = pipeline_ceiling.pipelined_step_ms(k, loops, d1, None, a1, 0.0, S, P, lambda rows: L1)
        out["ceiling"] = {"S_ms": S, "P_ms": P, "L1_ms": L1, "predicted_ticks": ticks, "step_ms": ms,
                          "speedup": (S + loops * L1) / (ms / (k + 1))}
    return out


# -- summaries -------------------------------------------------------------------

def summarize(runs: list[dict]) -> dict:
    """loopspec_decode's summary plus the totals this sweep also reports."""
    total = total_spec_counts(runs)
    out = loopspec_decode.summarize(runs) | {
        "tokens": sum(r["tokens"] for r in runs), "steps": sum(r["steps"] for r in runs),
        # every verified row is a drafted position or the bonus row of a round
        "rows_verified": total["drafts"] + total["draft_tokens"], "spec_counts": total}
    if total["draft_tokens"]:
        out["drafted_per_round"] = total["draft_tokens"] / total["drafts"]
    return out


def per_step_split(profile: dict) -> dict:
    """ms per engine step: vLLM outside the model forward, then the model
    forward (for loopspec split into its phases)."""
    steps = profile["steps"]
    split = {"outside_model": (profile["seconds"] - profile["forward_seconds"]) / steps * 1e3,
             "model_forward": profile["forward_seconds"] / steps * 1e3}
    for name, seconds in profile.get("phases", {}).items():
        split[name] = seconds / steps * 1e3
    return split


def cell_name(temperature: float, setting: str) -> str:
    """Result key: the setting, with the temperature when sampling
    (greedy keys stay ``short``/``long`` as in earlier records)."""
    return setting if not temperature else f"{setting} T{temperature:g}"


def policy_snapshot(llm) -> dict:
    """The adaptive policy's state after the sweep: fitted step costs and
    the decisions it made (K of each step, by reason)."""
    controller = model_runner(llm).drafter.controller
    decisions: dict[str, int] = {}
    for record in controller.history:
        key = f"{record.reason} K{max(record.drafts, default=0)}"
        decisions[key] = decisions.get(key, 0) + 1
    costs = controller.costs
    factors = {f"width bucket {bucket} mix {mix}": {f"K{k}": [round(r.value, 3), r.samples]
                                                    for k, r in sorted(by_k.items())}
               for (bucket, mix), by_k in sorted(getattr(controller, "_ratios", {}).items())}
    calibration = {("sampled" if mode else "greedy"): [round(float(r), 3) for r in c.ratios()]
                   for mode, c in getattr(controller, "_calibration", {}).items()}
    chooser = model_runner(llm).drafter.chooser
    schedule = None if chooser is None else {
        "decisions (arm, reason)": {f"{arm} {why}": n for (arm, why), n in sorted(chooser.decisions.items())},
        "rates (tok/s per request, samples) by width bucket, mix and context": {
            f"width bucket {bucket} mix {mix} context bucket {context}": {
                arm: [round(r.rate, 1), r.samples] for arm, r in key.arms.items()}
            for (bucket, mix, context), key in sorted(chooser._keys.items())}}
    return {"costs": None if costs is None else {"plain": costs.plain, "spec": costs.spec, "context": costs.context},
            "schedule_choice": schedule,
            "time_factors (measured/predicted, samples)": factors,
            "acceptance calibration (accepted/estimated, by position)": calibration,
            "armed": controller.armed, "cap": controller.cap, "decisions_in_last_4096_steps": decisions}


def machine_load() -> list[float]:
    """1/5/15-minute load averages when the record was written: a sweep on a
    machine that other jobs share is noisier."""
    return list(os.getloadavg())


# -- main ------------------------------------------------------------------------

def vector_isa() -> str:
    """The widest x86 vector extension the CPU reports (vLLM's CPU kernels
    and oneDNN pick their paths by it), for the results' machine section."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return next((isa for flag, isa in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), "no AVX2")


def build_engines(args, specs: dict[str, dict | None]) -> dict:
    from vllm import LLM

    common = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.5,
                  enforce_eager=not args.compiled,
                  seed=0, disable_log_stats=False, max_num_seqs=max(args.concurrency),
                  max_num_batched_tokens=8192, num_gpu_blocks_override=args.kv_blocks)
    engines = {}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        engines[name] = LLM(str(args.checkpoint), speculative_config=spec, **common)
        print(f"built {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return engines


def check_kv_capacity(llm, args, prompt_tokens: int) -> dict:
    """Refuse to measure preemption: every request of the largest batch must fit."""
    cache = llm.llm_engine.vllm_config.cache_config
    need_tokens = max(args.concurrency) * (prompt_tokens + max(s["new_tokens"] for s in SETTINGS.values()) + 16)
    have_tokens = cache.num_gpu_blocks * cache.block_size
    if have_tokens < need_tokens:
        raise SystemExit(f"KV cache holds {have_tokens} tokens, the largest batch needs {need_tokens}: "
                         f"raise --kv-blocks")
    return {"block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "ouro-stdlib")
    ap.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--peers", nargs="*", default=["ngram", "suffix"], choices=["ngram", "suffix"])
    ap.add_argument("--peer-ks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--suffix-k", type=int, default=8, help="suffix's upper bound on drafted tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--settings", nargs="+", default=["short", "long"], choices=list(SETTINGS))
    ap.add_argument("--short-prompts", default="mixed")
    ap.add_argument("--long-prompts", default="long")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--temperatures", "--temperature", type=float, nargs="+", default=[0.0],
                    help="0 = greedy; > 0 samples with a per-request seed (same seeds for every arm)")
    ap.add_argument("--adaptive", action="store_true", help="add loopspec's adaptive policy at each d")
    ap.add_argument("--adaptive-schedules", nargs="+", default=["round"], choices=["round", "auto"],
                    help="the adaptive arms' schedule: round (arm 'loopspec dD adaptive') and/or auto "
                         "('loopspec dD auto': rounds, plain or pipelined steps by measured rate)")
    ap.add_argument("--adaptive-max-ks", type=int, nargs="*", default=[],
                    help="also each adaptive arm with max_speculative_tokens at these values (arm '... maxM')")
    ap.add_argument("--pipelined-draft-loops", type=int, nargs="*", default=[],
                    help="add the pipelined schedule at these d1 (with --pipelined-ks)")
    ap.add_argument("--pipelined-ks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--pipelined-second-loops", type=int, nargs="*", default=[],
                    help="also each pipelined arm with second_proposal_loop at these d2 (where d1 divides d2)")
    ap.add_argument("--auto-depths", type=int, nargs="*", default=[],
                    help="add one \"auto\" engine whose steps choose their draft depth among these "
                         "(\"draft_loops\" as a list; arm 'loopspec per-step d1,2')")
    ap.add_argument("--compiled", action="store_true", help="vLLM's default compile mode (not enforce_eager)")
    ap.add_argument("--native-twice", action="store_true",
                    help=f"add a second native engine ({SECOND_NATIVE!r}): the spread between two engines of the "
                         "same computation")
    ap.add_argument("--native-beside-auto", action="store_true",
                    help="in every repeat, also run the native engine just before each 'auto' arm's trial: the "
                         "auto arm against native free of the machine's drift between trials far apart in the "
                         "rotation (the second native engine is always next to the first)")
    ap.add_argument("--kv-blocks", type=int, default=512, help="KV blocks per engine (num_gpu_blocks_override)")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_sweep.json")
    args = ap.parse_args()

    import torch
    import vllm

    specs = arm_specs(args)
    skipped = {}
    if "suffix" in specs and (why := suffix_unavailable()):
        skipped["suffix"] = why
        del specs["suffix"]
    prompt_sets = {"short": load_prompts(args.short_prompts), "long": load_prompts(args.long_prompts)}
    engines = build_engines(args, specs)
    counters = {name: SchedulerSpecCounter(llm) for name, llm in engines.items()}
    tokenizer = engines["native"].get_tokenizer()
    prompt_tokens = max(len(tokenizer.encode(p)) for s in args.settings for p in prompt_sets[s])
    kv = check_kv_capacity(engines["native"], args, prompt_tokens)
    loops = model_runner(engines["native"]).model.num_loops
    names = list(engines)

    for name in names:  # warm every arm at every batch shape once
        for c in args.concurrency:
            decode_trial(engines[name], prompt_sets["short"][:c], 16)
    cells = [(t, s) for t in args.temperatures for s in args.settings]
    besides = ([n for n in names if n.endswith(" auto") or n.startswith(PER_STEP_PREFIX)]
               if args.native_beside_auto else [])
    runs = {cell: {c: {n: [] for n in names + [beside(a) for a in besides]} for c in args.concurrency}
            for cell in cells}
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        for temperature, setting in cells:
            prompts, new_tokens = prompt_sets[setting], SETTINGS[setting]["new_tokens"]
            for c in args.concurrency:
                batch = [prompts[(rep * c + i) % len(prompts)] for i in range(c)]
                shift = (rep + c) % len(names)
                for name in names[shift:] + names[:shift]:
                    if name in besides:
                        trial = timed_trial(engines["native"], counters["native"], batch, new_tokens, temperature)
                        runs[(temperature, setting)][c][beside(name)].append(trial | {"repeat": rep})
                    trial = timed_trial(engines[name], counters[name], batch, new_tokens, temperature)
                    runs[(temperature, setting)][c][name].append(trial | {"repeat": rep})
        print(f"repeat {rep + 1}/{args.repeats} done after {time.perf_counter() - t_start:.0f} s", flush=True)

    results = {}
    for cell in cells:
        results[cell_name(*cell)] = {}
        for c in args.concurrency:
            profiles = {n: median_profile(runs[cell][c][n]) for n in names}
            native = summarize(runs[cell][c]["native"])
            row = {"native": native | {"split_ms": per_step_split(profiles["native"])}}
            for name in names[1:]:
                summary = summarize(runs[cell][c][name])
                summary["speedup"] = summary["median_tokens_per_s"] / native["median_tokens_per_s"]
                summary["split_ms"] = per_step_split(profiles[name])
                spec = specs[name] or {"method": None}
                if spec["method"] == "loopspec" and spec.get("schedule") == "pipelined" \
                        and spec.get("second_proposal_loop") is not None:
                    summary["pipeline"] = pipeline_summary(runs[cell][c][name], profiles["native"], None, 0, 0, loops)
                elif spec["method"] == "loopspec" and spec.get("schedule") == "pipelined":
                    k, d = spec["num_speculative_tokens"], spec["draft_loops"]
                    round_arm = row.get(f"loopspec d{d} K{k}") or next(
                        (r for n, r in row.items() if n.startswith(f"loopspec d{d} K") and "cost_model" in r), None)
                    pipe = pipeline_summary(runs[cell][c][name], profiles["native"],
                                            round_arm and round_arm.get("cost_model"), k, d, loops)
                    summary["pipeline"] = pipe
                    if "ceiling" in pipe:
                        summary["speedup_over_ceiling"] = summary["speedup"] / pipe["ceiling"]["speedup"]
                elif spec["method"] == "loopspec" and spec.get("adaptive") is False:
                    k, d = spec["num_speculative_tokens"], spec["draft_loops"]
                    summary["cost_model"] = cost_model(profiles["native"], profiles[name], k, d, loops,
                                                       summary.get("acceptance", 0.0), c)
                    summary["speedup_over_ceiling"] = summary["speedup"] / summary["cost_model"]["ceiling"]
                row[name] = summary
            for name in besides:
                trials, native_trials = runs[cell][c][name], runs[cell][c][beside(name)]
                row[beside(name)] = summarize(native_trials)
                row[name]["vs_native_beside"] = statistics.median(
                    a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(trials, native_trials))
            results[cell_name(*cell)][str(c)] = row
    policies = {name: policy_snapshot(llm) for name, llm in engines.items()
                if " adaptive" in name or " auto" in name}

    record = {
        "benchmark": "kv_sweep",
        "checkpoint": str(args.checkpoint.relative_to(ROOT) if args.checkpoint.is_relative_to(ROOT) else args.checkpoint),
        "loops": loops, "arms": specs, "skipped_arms": skipped, "repeats": args.repeats,
        "settings": {s: SETTINGS[s] | {"prompts": args.short_prompts if s == "short" else args.long_prompts}
                     for s in args.settings},
        "concurrency": args.concurrency, "dtype": "float32", "temperatures": args.temperatures, "kv_cache": kv,
        "command": " ".join(["python", *sys.argv]),
        "engine": "in-process vLLM V1 (VLLM_ENABLE_V1_MULTIPROCESSING=0), "
                  + ("compiled (vLLM's default mode)" if args.compiled else "enforce_eager"),
        "machine_load": machine_load(),
        # PASSIVE makes this machine's steps 2-4x slower in one process: record it.
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset: OpenMP default)"),
        "adaptive_policies": policies,
        "vllm": vllm.__version__, "torch": torch.__version__, "cpu": cpu_name(),
        "isa": vector_isa(), "cores": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_seconds": time.perf_counter() - t_start,
        "results": results,
        "raw": {cell_name(*cell): {str(c): runs[cell][c] for c in args.concurrency} for cell in cells},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
