"""Issue 13 check: do in-process engines of one computation run at one
speed? N native engines built one after another, then interleaved trials
(rotated order) of WIDTH ``mixed`` prompts at TEMPERATURE; each engine's
median trial seconds against the first-built one. The sweeps hold every arm
as such an engine, built in a fixed order (native first).

    python benchmarks/probes/engine_order.py N WIDTH TEMPERATURE REPEATS [OUT]"""
import json, statistics, sys, time

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts


def main():
    from vllm import LLM, SamplingParams
    n, c, temp, reps = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    prompts = load_prompts("mixed")
    batch = [prompts[i % len(prompts)] for i in range(c)]
    engines = [LLM(CHECKPOINT, **ENGINE_ARGS) for _ in range(n)]
    params = [SamplingParams(max_tokens=128, temperature=temp, ignore_eos=True, seed=i) for i in range(c)]
    for e in engines:  # warm-up
        e.generate(batch, params, use_tqdm=False)
    trials = {i: [] for i in range(n)}
    for r in range(reps):
        for j in range(n):
            i = (r + j) % n
            t = time.perf_counter()
            engines[i].generate(batch, params, use_tqdm=False)
            trials[i].append(time.perf_counter() - t)
    med = {i: statistics.median(v) for i, v in trials.items()}
    result = {"probe": "engine_order", "command": "python benchmarks/probes/engine_order.py " + " ".join(sys.argv[1:5]),
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "width": c, "temperature": temp,
              "trial_seconds": trials, "median_seconds": med,
              "speed_vs_first": {i: round(med[0] / med[i], 4) for i in med}}
    print(json.dumps(result["speed_vs_first"]), {i: round(m, 3) for i, m in med.items()})
    if len(sys.argv) > 5:
        (ROOT / sys.argv[5]).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
