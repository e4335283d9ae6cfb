"""plain_step_phases.py with N engines of each kind (native, loopspec held
plain), built alternately: per phase, each engine's median microseconds
per step, so that a difference between kinds can be told from one between
engines. ``wall_per_step``: generate's wall time per step (prefill included);
``outside_phases``: that minus the timed phases (scheduler, runner, output
processing): the engine core's and front end's own work.

    python benchmarks/probes/plain_step_phases_n.py N WIDTH TEMPERATURE REPEATS [OUT]"""
import json, statistics, sys, time

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts
from plain_step_phases import wrap_step_phases


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.schedule_choice import ScheduleChoice, PLAIN
    n, c, temp, reps = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    prompts = load_prompts("mixed")
    spec = {"method": "loopspec", "draft_loops": 1, "schedule": "auto"}
    engines = {}
    for i in range(n):
        engines[f"native{i}"] = LLM(CHECKPOINT, **ENGINE_ARGS)
        engines[f"plain{i}"] = LLM(CHECKPOINT, speculative_config=spec, **ENGINE_ARGS)
        model_runner(engines[f"plain{i}"]).drafter.chooser.choose = lambda *a, **k: ScheduleChoice(PLAIN, "faster", hold=32)
    acc = {e: {} for e in engines}
    for e, llm in engines.items():
        wrap_step_phases(llm, acc[e])
    params = SamplingParams(max_tokens=128, temperature=temp, ignore_eos=True)
    batch = [prompts[i % len(prompts)] for i in range(c)]
    names = list(engines)
    wall = {e: [] for e in names}
    for rep in range(reps + 1):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for e in order:
            if rep == 1:
                for v in acc[e].values():
                    v.clear()
            t = time.perf_counter()
            engines[e].generate(batch, params, use_tqdm=False)
            if rep:
                wall[e].append(time.perf_counter() - t)
    table = {}
    for e in names:
        steps = len(acc[e]["execute_model"])
        row = {k: round(statistics.median(v) * 1e6, 1) for k, v in acc[e].items()}
        row["wall_per_step"] = round(sum(wall[e]) / steps * 1e6, 1)
        inside = sum(sum(acc[e][k]) for k in ("schedule", "execute_model", "sample_tokens", "update_from_output", "process_outputs"))
        row["outside_phases"] = round((sum(wall[e]) - inside) / steps * 1e6, 1)
        row["steps"] = steps
        table[e] = row
    keys = list(table[names[0]])
    print(f"{'phase':20s}" + "".join(f"{e:>10s}" for e in names))
    for k in keys:
        print(f"{k:20s}" + "".join(f"{table[e][k]:10.1f}" for e in names))
    print("wall seconds", {e: round(sum(v), 3) for e, v in wall.items()})
    if len(sys.argv) > 5:
        (ROOT / sys.argv[5]).write_text(json.dumps({"probe": "plain_step_phases_n", "command": "python benchmarks/probes/plain_step_phases_n.py " + " ".join(sys.argv[1:]),
                                                    "when": time.strftime("%Y-%m-%d %H:%M:%S"), "us_per_step": table,
                                                    "wall_seconds": wall}, indent=1) + "\n")


if __name__ == "__main__":
    main()
