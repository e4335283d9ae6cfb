"""Issue 13 diagnostic: every pair the "auto" chooser makes (a sample of one
arm with the last sample of another a few samples before it, PAIR_GAP),
with its age in decode steps (chosen and held steps counted) and the
context buckets of its two samples. Pairs are meant to see one moment of
the machine's speed and one workload; samples are not steps (the steps
after a switch are no samples), so a few samples apart may be many steps
and, across a batch boundary, two context buckets.

One auto engine, WIDTH mixed short prompts, 128 tokens, REPEATS batches.

    python benchmarks/probes/pair_ages.py D WIDTH TEMPERATURE REPEATS
"""
import statistics
import sys

from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative import schedule_choice as sc

    d, width, temp, reps = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    prompts = load_prompts("mixed")
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": d, "schedule": "auto"},
               **ENGINE_ARGS)
    chooser = model_runner(auto).drafter.chooser
    state = {"step": 0, "held": False}
    stamps = {}  # (width bucket, mix) -> arm -> (step, context bucket) of its last sample
    made = []  # (from a held span, arm, other, age in steps, context bucket, the other's context bucket)
    choose, credit_held, pair = chooser.choose, chooser.credit_held, chooser._pair

    def counting_choose(*args, **kwargs):
        state["step"] += 1
        return choose(*args, **kwargs)

    def counting_credit_held(steps, timed=0, seconds=0.0):
        state["step"] += max(steps, 0)
        state["held"] = True
        try:
            return credit_held(steps, timed, seconds)
        finally:
            state["held"] = False

    def recording_pair(key, where, arm, rate):
        # The samples this one pairs with, read as _pair reads them (keyed
        # by width bucket and mix, or by the whole key in the reverted
        # change of the fifty-fourth session; none from a longer context
        # bucket since the fifty-fifth, which stores the bucket).
        last = chooser._last_sample.get(where) or chooser._last_sample.get(where[:2]) or {}
        for other, (when, other_rate, *context) in last.items():
            if (other != arm and chooser._clock + 1 - when <= sc.PAIR_GAP and other_rate > 0 and rate > 0
                    and all(c <= where[2] for c in context)):
                step, bucket = stamps.get(where[:2], {}).get(other, (None, None))
                made.append((state["held"], arm, other, None if step is None else state["step"] - step,
                             where[2], bucket))
        stamps.setdefault(where[:2], {})[arm] = (state["step"], where[2])
        return pair(key, where, arm, rate)

    chooser.choose, chooser.credit_held, chooser._pair = counting_choose, counting_credit_held, recording_pair
    params = SamplingParams(max_tokens=128, temperature=temp, ignore_eos=True, seed=None)
    for rep in range(reps):
        auto.generate([prompts[(rep * width + i) % len(prompts)] for i in range(width)], params, use_tqdm=False)
    print(f"pairs made: {len(made)}")
    for held in (False, True):
        rows = [m for m in made if m[0] == held]
        if not rows:
            continue
        ages = [m[3] for m in rows if m[3] is not None]
        print(f"{'held span' if held else 'observed step'}: {len(rows)} pairs; age in steps median "
              f"{statistics.median(ages) if ages else None}, over 8 steps {sum(a > 8 for a in ages)}, over 24 "
              f"{sum(a > 24 for a in ages)}; across context buckets {sum(m[4] != m[5] for m in rows)}")
        print("    (arm, other, age in steps, context bucket, the other's context bucket)")
        for m in rows:
            print("   ", m[1:])


if __name__ == "__main__":
    main()
