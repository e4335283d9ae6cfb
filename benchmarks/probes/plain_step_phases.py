"""Issue 13 check: where a loopspec engine's plain step costs more than a
native engine's. Three engines in this process (native, a second native
engine, a loopspec "auto" engine whose chooser holds every step plain),
interleaved trials of WIDTH short requests; per phase (vLLM's EngineCore
step, scheduler, runner methods; the drafter's hooks) the median
microseconds per step. The second native engine is the floor: two engines
of one computation differ by where they sit in memory.

    python benchmarks/probes/plain_step_phases.py WIDTH TEMPERATURE REPEATS

Writes ``benchmarks/results/plain_step_phases.json``."""
import statistics, sys, time
import json

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts

def wrap(obj, name, acc, key):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc.setdefault(key, []).append(time.perf_counter() - t); return r
    setattr(obj, name, w)

def wrap_step_phases(llm, acc):
    """Time the phases every probe of a plain step reads: the scheduler's,
    the runner's and the front end's output processing."""
    from vllm_loopspec.engine_internals import engine_core, model_runner
    core, r = engine_core(llm), model_runner(llm)
    for obj, name, key in ((core.scheduler, "schedule", "schedule"),
                           (core.scheduler, "update_from_output", "update_from_output"),
                           (r, "execute_model", "execute_model"), (r, "sample_tokens", "sample_tokens"),
                           (r, "_model_forward", "forward"), (r, "_prepare_inputs", "prepare_inputs"),
                           (llm.llm_engine.output_processor, "process_outputs", "process_outputs")):
        wrap(obj, name, acc, key)


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner, engine_core
    from vllm_loopspec.speculative.schedule_choice import ScheduleChoice, PLAIN
    c = int(sys.argv[1]); temp = float(sys.argv[2]); reps = int(sys.argv[3])
    prompts = load_prompts("mixed")
    spec = {"method": "loopspec", "draft_loops": 1, "schedule": "auto", "num_speculative_tokens": 16}
    engines = {"native": LLM(CHECKPOINT, **ENGINE_ARGS), "native2": LLM(CHECKPOINT, **ENGINE_ARGS), "forced": LLM(CHECKPOINT, speculative_config=spec, **ENGINE_ARGS)}
    model_runner(engines["forced"]).drafter.chooser.choose = lambda *a, **k: ScheduleChoice(PLAIN, "faster", hold=32)
    acc = {n: {} for n in engines}
    for n, e in engines.items():
        core = engine_core(e); r = model_runner(e)
        wrap(core, "step", acc[n], "core.step")
        wrap_step_phases(e, acc[n])
        wrap(r, "_bookkeeping_sync", acc[n], "bookkeeping")
        for m in ("_update_states", "_build_attention_metadata", "_preprocess", "_sample", "_update_states_after_model_execute", "propose_draft_token_ids", "_determine_batch_execution_and_padding", "_get_cumsum_and_arange", "compute_logits"):
            if hasattr(r, m): wrap(r, m, acc[n], m)
        if n == "forced":
            d = r.drafter
            for m in ("step_started", "step_finished", "propose"):
                wrap(d, m, acc[n], "drafter." + m)
            wrap(r.model, "compute_logits", acc[n], "model.compute_logits")
        else:
            wrap(r.model, "compute_logits", acc[n], "model.compute_logits")
    params = SamplingParams(max_tokens=128, temperature=temp, ignore_eos=True)
    batch = [prompts[i % len(prompts)] for i in range(c)]
    tot = {n: [] for n in engines}
    for rep in range(reps + 1):
        names = list(engines); names = names[rep % 3:] + names[:rep % 3]
        for n in names:
            if rep == 1:
                for v in acc[n].values(): v.clear()
            t = time.perf_counter(); engines[n].generate(batch, params, use_tqdm=False)
            if rep: tot[n].append(time.perf_counter() - t)
    phases = {}
    for key in list(acc["native"]) + [k for k in acc["forced"] if k not in acc["native"]]:
        a = acc["native"].get(key, [0]); b = acc["forced"].get(key, []); c2 = acc["native2"].get(key, [0])
        ma, mb, mc = statistics.median(a) * 1e6, statistics.median(b) * 1e6 if b else 0, statistics.median(c2) * 1e6
        phases[key] = {"native": ma, "native2": mc, "loopspec held plain": mb}
        print(f"{key:24s} median us native {ma:8.1f} native2 {mc:8.1f} (+{mc-ma:6.1f}) forced {mb:8.1f} (+{mb-ma:6.1f})")
    print("trial seconds", {n: round(sum(v), 3) for n, v in tot.items()}, "ratio", sum(tot["native"]) / sum(tot["forced"]), sum(tot["native"]) / sum(tot["native2"]))
    out = ROOT / "benchmarks" / "results" / "plain_step_phases.json"
    out.write_text(json.dumps({
        "benchmark": "plain_step_phases", "command": " ".join(["python", *sys.argv]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "width": c, "temperature": temp, "repeats_timed": reps,
        "median_us_per_step": phases,
        "trial_seconds": {"native": sum(tot["native"]), "native2": sum(tot["native2"]),
                          "loopspec held plain": sum(tot["forced"])}}, indent=1))

if __name__ == "__main__":
    main()

