"""Issue 13 diagnostic: every sample the "auto" chooser takes, by arm and
key, on one cell of the sweep (an auto engine beside native, 6 repeats, new
prompts each), and what a native step costs at the same context.

Logs each ``ScheduleChooser.observe`` that counts (arm, width bucket,
context bucket, rate per request, seconds, the arm before it) and each
held span credited (``credit_held``: plain steps timed together), then per
key and arm the median rate of the samples, against native's per-step rate
at that key (native steps timed from start to next start, every step of
the decode). Prints only.

With a fifth argument, a context bucket: also every choice made and every
step observed from that context bucket on, as they happen (the choice, the
arms' rates with samples and own samples, their pairs; the observed step's
arm, the arm before it, rate and seconds, and whether it became a sample).

    python benchmarks/probes/chooser_samples_trace.py D WIDTH TEMPERATURE short|long [FROM_CONTEXT]
"""
import collections
import math
import statistics
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts, run_lengths


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.schedule_choice import _where

    d, width, temp, setting = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    prompts = load_prompts("long" if setting == "long" else "mixed")
    tokens = 192 if setting == "long" else 128
    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": d, "schedule": "auto"},
               **ENGINE_ARGS)
    chooser = model_runner(auto).drafter.chooser
    samples = collections.defaultdict(list)  # (bucket, context bucket, arm, kind) -> rates
    observe, credit = chooser.observe, chooser.credit_held

    def logged_observe(w, mix, arm, committed, seconds, context=0, after=None, declined=False, lag=0.0):
        key = chooser._key(_where(w, mix, context))
        before = {a: r.own for a, r in key.arms.items()}
        observe(w, mix, arm, committed, seconds, context, after=after, declined=declined, lag=lag)
        where = _where(w, mix, context)
        for a, r in key.arms.items():
            if r.own > before[a]:
                kind = "declined" if declined and a != arm else f"after {after}"
                samples[(where[0], where[2], a, kind)].append(committed / w / seconds)

    def logged_credit(steps, timed=0, seconds=0.0):
        if chooser._last_key is not None and timed > 0 and seconds > 0:
            where = chooser._last_where
            samples[(where[0], where[2], "plain", "held span")].append(timed / seconds)
        credit(steps, timed, seconds)

    chooser.observe, chooser.credit_held = logged_observe, logged_credit
    if len(sys.argv) > 5:
        log_choices_from(chooser, int(sys.argv[5]))
    drafter = model_runner(auto).drafter
    started = drafter.step_started
    auto_steps = []  # (arm, start, decode-only width) of every auto step

    def logged_started(scheduler_output):
        started(scheduler_output)
        n = len(scheduler_output.num_scheduled_tokens)
        # A chosen decode step's arm (speculative steps schedule drafts too); else "other".
        decode = not scheduler_output.scheduled_new_reqs and n > 0 and drafter.step_arm is not None
        auto_steps.append((drafter.step_arm if decode else "other", time.perf_counter()))

    drafter.step_started = logged_started
    native_runner = model_runner(native)
    native_steps = collections.defaultdict(list)  # (bucket, context bucket) -> per-request rates
    execute = native_runner.execute_model
    last = {}

    def timed_execute(scheduler_output, *args, **kwargs):
        now = time.perf_counter()
        if last and last["decode"] and not scheduler_output.scheduled_new_reqs:
            native_steps[last["where"]].append(1 / (now - last["t"]))
        n = len(scheduler_output.num_scheduled_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        decode = n > 0 and scheduler_output.total_num_scheduled_tokens == n and not scheduler_output.scheduled_new_reqs
        context = sum(cached.num_computed_tokens) // n if decode else 0
        where = _where(n, 2 if temp > 0 else 0, context)
        last.update(t=now, decode=decode, where=(where[0], where[2]))
        return execute(scheduler_output, *args, **kwargs)

    native_runner.execute_model = timed_execute
    params = [SamplingParams(max_tokens=tokens, temperature=temp, ignore_eos=True, seed=i if temp else None)
              for i in range(width)]
    for rep in range(6):
        batch = [prompts[(rep * width + i) % len(prompts)] for i in range(width)]
        start = time.perf_counter()
        native.generate(batch, params, use_tqdm=False)
        tn = time.perf_counter() - start
        decisions, first = dict(chooser.decisions), len(auto_steps)
        start = time.perf_counter()
        auto.generate(batch, params, use_tqdm=False)
        print(f"rep {rep}: auto over native {tn / (time.perf_counter() - start):.3f}")
        print("    decisions:", {k: v - decisions.get(k, 0) for k, v in chooser.decisions.items()
                                  if v != decisions.get(k, 0)})
        print("    arms in order (run lengths):", run_lengths(arm for arm, _ in auto_steps[first:]))
    # Plain steps of the auto engine by how many steps came since its last
    # speculative (or other) step: does a switch's slowdown fade in SWITCH_STEPS?
    since = collections.defaultdict(list)
    run = None
    for (arm, t), (_, t_next) in zip(auto_steps, auto_steps[1:]):
        if arm == "plain" or arm is None:
            run = 0 if run is None else run + 1
            if t_next > t:
                since[min(run, 12)].append(1e3 * (t_next - t))
        else:
            run = None if arm == "other" else -1
    print("auto plain steps by steps since the last speculative step (0 = right after it; 12 = 12 or more):")
    for k in sorted(since):
        print(f"    {k:2d}: {statistics.median(since[k]):.2f} ms ({len(since[k])})")
    print("per key: native steps' rate per request (median, steps); the chooser's samples by arm and kind")
    for (bucket, context), rates in sorted(native_steps.items()):
        print(f"width bucket {bucket} context bucket {context}: native {statistics.median(rates):.1f} ({len(rates)})")
        for (b, c, arm, kind), values in sorted(samples.items()):
            if (b, c) == (bucket, context):
                print(f"    {arm:12s} {kind:22s} {statistics.median(values):7.1f} ({len(values)})")
    for (b, c), key in sorted(((w[0], w[2]), k) for w, k in chooser._keys.items()):
        print(f"chooser rates at width bucket {b} context bucket {c}:",
              {a: (round(r.rate, 1), r.samples) for a, r in key.arms.items()})


def log_choices_from(chooser, context_bucket: int) -> None:
    """Print every choice and observed step of ``chooser`` at context
    buckets from ``context_bucket`` on, as they happen."""
    from vllm_loopspec.speculative.schedule_choice import _where

    choose, observe = chooser.choose, chooser.observe

    def describe(key) -> str:
        rates = {a: f"{r.rate:.0f}({r.samples}/{r.own}{'b' if r.borrowed else ''})" for a, r in key.arms.items()}
        pairs = {f"{a}/{o}": f"{math.exp(statistics.median(p)):.2f}({len(p)})"
                 for (a, o), p in key.pairs.items() if p and a < o}
        return f"rates {rates} pairs {pairs}"

    def logged_choose(width, mix, context=0, in_flight=None):
        choice = choose(width, mix, context, in_flight)
        where = _where(width, mix, context)
        if where[2] >= context_bucket:
            print(f"    choose  w{where[0]} c{where[2]}: {choice.arm}/{choice.reason} hold {choice.hold}, "
                  f"in flight {in_flight}, {describe(chooser._keys[where])}", flush=True)
        return choice

    def logged_observe(width, mix, arm, committed, seconds, context=0, after=None, declined=False, lag=0.0):
        where = _where(width, mix, context)
        key = chooser._key(where)
        before = key.arms[arm].own
        observe(width, mix, arm, committed, seconds, context, after=after, declined=declined, lag=lag)
        if where[2] >= context_bucket:
            print(f"    observe w{where[0]} c{where[2]}: {arm} after {after}, {committed / width / seconds:.0f} "
                  f"tokens/s per request, {seconds * 1e3:.1f} ms, "
                  f"{'a sample' if key.arms[arm].own > before else 'no sample'}", flush=True)

    chooser.choose, chooser.observe = logged_choose, logged_observe


if __name__ == "__main__":
    main()
