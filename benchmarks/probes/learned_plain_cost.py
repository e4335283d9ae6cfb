"""Issue 13 check (thirtieth session): does an ``"auto"`` engine's plain
step cost more after the engine has learned (run rounds and pipelined
steps) than before? One d1 auto engine and one native engine in this
process. The auto engine's chooser is forced to answer plain (held, as a
settled plain verdict) in phases A and C; between them, phase B lets it
learn on the sweep's cells (greedy and T=0.8, short and long, c1-c16,
once). Per phase, short T=0.8 c8 trials interleaved with native ones:
tokens/s over the native trial beside each, and a cProfile of one trial
of each engine (the functions whose cumulative time per trial grew most
from A to C).

    python benchmarks/probes/learned_plain_cost.py REPEATS OUT"""
import cProfile, json, pstats, statistics, sys, time

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts

sys.path.insert(0, str(ROOT / "benchmarks"))


def main():
    from vllm import LLM
    from loopspec_decode import decode_trial
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative import schedule_choice as sc
    repeats, out = int(sys.argv[1]), sys.argv[2]
    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1, "schedule": "auto"},
               **ENGINE_ARGS)
    chooser = model_runner(auto).drafter.chooser
    learned_choose = chooser.choose
    forced = lambda *a, **k: sc.ScheduleChoice(sc.PLAIN, "faster", hold=sc.HOLD_STEPS)  # noqa: E731
    prompts = {"short": load_prompts("mixed"), "long": load_prompts("long")}
    batch = prompts["short"][:8]
    for llm in (native, auto):
        decode_trial(llm, batch, 16, temperature=0.8)

    def phase(name):
        chooser.choose = forced
        ratios, rates = [], {"native": [], "auto": []}
        for rep in range(repeats):
            order = [("native", native), ("auto", auto)][:: 1 if rep % 2 == 0 else -1]
            got = {}
            for label, llm in order:
                got[label] = decode_trial(llm, batch, 128, temperature=0.8)["tokens_per_s"]
                rates[label].append(got[label])
            ratios.append(got["auto"] / got["native"])
        profiles = {}
        for label, llm in (("native", native), ("auto", auto)):
            prof = cProfile.Profile()
            prof.enable()
            decode_trial(llm, batch, 128, temperature=0.8)
            prof.disable()
            stats = pstats.Stats(prof)
            profiles[label] = {f"{f[0].split('site-packages/')[-1]}:{f[2]}": (v[1], v[3])
                               for f, v in stats.stats.items()}  # (calls, cumulative seconds)
        print(name, "auto/native paired median", round(statistics.median(ratios), 3),
              [round(r, 3) for r in ratios], flush=True)
        return {"ratios": ratios, "rates": rates, "profiles": profiles}

    a = phase("A (before learning)")
    chooser.choose = learned_choose
    t0 = time.perf_counter()
    for temperature in (0.0, 0.8):
        for setting, new_tokens in (("short", 128), ("long", 192)):
            for c in (1, 4, 8, 16):
                decode_trial(auto, prompts[setting][:c], new_tokens, temperature=temperature)
    learned = {f"{arm}/{reason}": n for (arm, reason), n in sorted(chooser.decisions.items())}
    print("B (learning)", round(time.perf_counter() - t0, 1), "s", learned, flush=True)
    c = phase("C (after learning)")
    grown = []
    for fn, (calls, cum) in c["profiles"]["auto"].items():
        calls_a, cum_a = a["profiles"]["auto"].get(fn, (0, 0.0))
        grown.append((cum - cum_a, fn, calls_a, calls, cum_a, cum))
    grown.sort(reverse=True)
    for row in grown[:25]:
        print(f"{row[0] * 1e3:8.2f} ms  {row[1]}  calls {row[2]} -> {row[3]}  cum {row[4] * 1e3:.1f} -> {row[5] * 1e3:.1f} ms")
    with open(out, "w") as f:
        json.dump({"probe": "learned_plain_cost", "command": " ".join(["python", *sys.argv]),
                   "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "A": {k: a[k] for k in ("ratios", "rates")}, "C": {k: c[k] for k in ("ratios", "rates")},
                   "learning_decisions": learned,
                   "grown_ms_per_profiled_trial": [(round(r[0] * 1e3, 3), r[1], r[2], r[3]) for r in grown[:40]]},
                  f, indent=1)


if __name__ == "__main__":
    main()
