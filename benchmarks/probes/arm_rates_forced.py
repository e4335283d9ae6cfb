"""Issue 13 check: what the ``"auto"`` chooser measures for each arm when the
arms are forced in a pattern, against a native engine on the same prompts.

The sweep's chooser rated the pipelined arm 10% above the plain one at
width 3-4, long prompts, T=0.8, where fixed pipelined lost 20% to native.
This forces the steps of one ``"auto"`` engine (d=2) to a pattern, records
every ``observe`` the chooser gets (arm, seconds, committed per request) and
prints the plain arm's step time by its place after a pipelined step. A
trial's time is a makespan: rows that finish early leave the slow ones to
run at a smaller width, and the last table shows how much of it that is.

    python benchmarks/probes/arm_rates_forced.py [width] [temperature] [prompts] [reps] [-v]
"""
import collections
import statistics
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts

PATTERNS = {"all plain": ["plain"], "all pipelined": ["pipelined"],
            "pipelined, 3 plain": ["pipelined", "plain", "plain", "plain"],
            "pipelined, 7 plain": ["pipelined"] + ["plain"] * 7,
            "all policy": ["policy"], "pipelined, 3 policy": ["pipelined", "policy", "policy", "policy"],
            "chosen": None}  # the chooser's own choices


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.schedule_choice import ScheduleChoice

    patterns = {"chosen": None} if "-v" in sys.argv else PATTERNS  # -v: the chooser alone, each step listed
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    temperature = float(sys.argv[2]) if len(sys.argv) > 2 else 0.8
    prompts = load_prompts(sys.argv[3] if len(sys.argv) > 3 else "long")
    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 2, "schedule": "auto"},
               **ENGINE_ARGS)
    chooser = model_runner(auto).drafter.chooser
    choose, observe = chooser.choose, chooser.observe
    forced = {"pattern": ["plain"], "i": 0, "prev": None, "run": 0}
    seen = []  # (pattern, arm, previous arm, seconds, committed per request, place in the arm's run, width)
    log = []  # the chooser's own choices, as observed: (width, context, arm, after, ms, committed)

    def forced_choose(w, m, c=0, in_flight=None):
        chosen = choose(w, m, c, in_flight)
        pattern = forced["pattern"]
        if pattern is None:
            return chosen
        arm = pattern[forced["i"] % len(pattern)]
        forced["i"] += 1
        return ScheduleChoice(arm, "measure")

    def recording_observe(w, m, arm, committed, seconds, context=0, after=None, **kwargs):
        forced["run"] = forced["run"] + 1 if arm == forced["prev"] else 1
        seen.append((forced["name"], arm, forced["prev"], seconds, committed / max(w, 1), forced["run"], w))
        if forced["pattern"] is None:
            log.append((w, context, arm, after, round(seconds * 1e3, 2), committed))
        forced["prev"] = arm
        return observe(w, m, arm, committed, seconds, context, after=after, **kwargs)

    chooser.choose, chooser.observe = forced_choose, recording_observe
    params = SamplingParams(max_tokens=192, temperature=temperature, ignore_eos=True, seed=None)
    native_seconds = collections.defaultdict(list)
    reps = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] != "-v" else 4
    for rep in range(reps):
        batch = [prompts[(rep * width + i) % len(prompts)] for i in range(width)]
        t = time.perf_counter()
        native.generate(batch, params, use_tqdm=False)
        native_seconds["native"].append(time.perf_counter() - t)
        for name, pattern in patterns.items():
            forced.update(pattern=pattern, i=0, prev=None, run=0, name=name if rep else "warm-up")
            t = time.perf_counter()
            auto.generate(batch, params, use_tqdm=False)
            native_seconds[name].append(time.perf_counter() - t)
    print(f"trial seconds (median of {reps - 1} after warm-up):")
    for name, s in native_seconds.items():
        print(f"  {name:22s} {statistics.median(s[1:]):.3f}  {[round(x, 3) for x in s]}")
    if "-v" in sys.argv:
        print("the chooser's own steps, as observed (width, context, arm, after, ms, committed):")
        for row in log:
            print("  ", *row)
    print("observed step ms and tok/s per request, by pattern, arm and the arm before it:")
    groups = collections.defaultdict(list)
    places = collections.defaultdict(list)
    for name, arm, prev, seconds, per_request, run, _ in seen:
        if name != "warm-up":
            groups[(name, arm, prev)].append((seconds, per_request))
            places[(name, arm, min(run, 12))].append(seconds)
    for (name, arm, prev), rows in sorted(groups.items(), key=lambda kv: str(kv[0])):
        ms = statistics.median(s for s, _ in rows) * 1e3
        rate = statistics.median(c / s for s, c in rows)
        pooled = sum(c for _, c in rows) / sum(s for s, _ in rows)
        print(f"  {name:22s} {arm:10s} after {str(prev):10s} n={len(rows):4d}  {ms:7.2f} ms  {rate:7.1f} tok/s/req"
              f" (pooled {pooled:7.1f})")
    print("observed seconds as a share of the trials' seconds (after warm-up), and the share of the observed"
          " seconds at the full width (the rest: rows left behind when others finished, a trial's tail):")
    for name, s in native_seconds.items():
        rows = [(row[3], row[6]) for row in seen if row[0] == name]
        if rows:
            total = sum(sec for sec, _ in rows)
            print(f"  {name:22s} {total / sum(s[1:]):.2f}  at width {width}: "
                  f"{sum(sec for sec, w in rows if w == width) / total:.2f}")
    print("observed step ms by the step's place in its arm's run (1: after a switch, or a trial's first"
          " observed step; 12: the twelfth or later):")
    for (name, arm, run), rows in sorted(places.items()):
        print(f"  {name:22s} {arm:10s} {run:3d} n={len(rows):4d}  {statistics.median(rows) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
