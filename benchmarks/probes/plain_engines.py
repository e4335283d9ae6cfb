"""Issue 13 check: is a loopspec engine whose every step is plain (the
"auto" chooser forced to hold plain) slower than native engines, beyond
how native engines differ among themselves? N native and N forced-plain
loopspec engines (d1 "auto") in one process, built alternately, on the
sweep's sampled cells (rotated interleaving); each engine's median trial
tokens/s over the first native's, per cell.

    python benchmarks/probes/plain_engines.py N REPEATS OUT"""
import json, statistics, sys, time

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.schedule_choice import PLAIN, ScheduleChoice
    n, reps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    engines = {}
    for i in range(n):
        engines[f"native{i}"] = LLM(CHECKPOINT, **ENGINE_ARGS)
        llm = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1, "schedule": "auto"},
                  **ENGINE_ARGS)
        model_runner(llm).drafter.chooser.choose = lambda *a, **k: ScheduleChoice(PLAIN, "faster", hold=32)
        engines[f"plain{i}"] = llm
    names = list(engines)
    prompts = {"short": load_prompts("mixed"), "long": load_prompts("long")}
    new_tokens = {"short": 128, "long": 192}
    cells = [(s, c) for s in ("short", "long") for c in (4, 8, 16)]
    runs = {f"{s} c{c}": {e: [] for e in names} for s, c in cells}
    for e in names:
        engines[e].generate(prompts["short"][:16], SamplingParams(max_tokens=16, temperature=0.8, seed=1), use_tqdm=False)
    for rep in range(reps):
        for s, c in cells:
            batch = [prompts[s][(rep * c + i) % len(prompts[s])] for i in range(c)]
            params = [SamplingParams(max_tokens=new_tokens[s], temperature=0.8, ignore_eos=True, seed=1000 + i) for i in range(c)]
            shift = (rep + c) % len(names)
            for e in names[shift:] + names[:shift]:
                t = time.perf_counter()
                engines[e].generate(batch, params, use_tqdm=False)
                runs[f"{s} c{c}"][e].append(c * new_tokens[s] / (time.perf_counter() - t))
    table = {}
    for cell, by in runs.items():
        ref = statistics.median(by["native0"])
        table[cell] = {e: round(statistics.median(v) / ref, 4) for e, v in by.items()}
        print(cell, table[cell], flush=True)
    nat = [v for row in table.values() for e, v in row.items() if e.startswith("native") and e != "native0"]
    pl = [v for row in table.values() for e, v in row.items() if e.startswith("plain")]
    print("median other natives", statistics.median(nat), "median forced-plain", statistics.median(pl))
    (ROOT / out).write_text(json.dumps({"probe": "plain_engines", "command": "python benchmarks/probes/plain_engines.py " + " ".join(sys.argv[1:]),
                                        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "tokens_per_s": runs,
                                        "over_native0": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
