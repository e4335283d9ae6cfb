"""Issue 13 A/B: two ``"schedule": "auto"`` engines per draft depth in one
process, one with the chooser's rule as committed and one with a rule of
this script's (``OLD_RULES``: the rule before a change), beside native, on
the sweep's protocol (kv_sweep.py's warm-up, cells, widths, rotated
interleaving, 5 repeats, medians). Per cell: each engine over native, and
new over old paired by repeat.

    python benchmarks/probes/chooser_ab.py RULE OUT [--draft-loops 1 2] [--repeats 5]

RULE names the old rule in ``OLD_RULES``; a few entries there are
variants rather than older rules (``half_try_share``), and ``identical``
replaces nothing: two equal engines, the A/B's own spread."""
import argparse, json, statistics, sys, time, types
from pathlib import Path

import _probe  # noqa: F401  (environment before vLLM)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, add_sweep_protocol_args, load_prompts  # noqa: E402


def _with_rule_constant(name, value, call):
    """``call()`` with ``schedule_choice.<name>`` set to ``value`` for the
    call: the committed method with one of its rules switched off."""
    from vllm_loopspec.speculative import schedule_choice as sc
    saved = getattr(sc, name)
    setattr(sc, name, value)
    try:
        return call()
    finally:
        setattr(sc, name, saved)


def fill_without_long_losers(self, key, where):
    """``_fill_from_neighbours`` before LONG_LOSER_BORROW (twenty-sixth session)."""
    return _with_rule_constant("LONG_LOSER_BORROW", 0.0,
                               lambda: type(self)._fill_from_neighbours(self, key, where))


def fill_raw(self, key, where):
    """``_fill_from_neighbours`` before borrowing relative to plain
    (twenty-seventh session): the scaling off."""
    return _with_rule_constant("_relative_to_plain", lambda *args: (1.0, 1.0),
                               lambda: type(self)._fill_from_neighbours(self, key, where))


def update_mixing_borrowed(key, arm, tokens, seconds, steps=1):
    """``_update`` before the key's own steps replaced borrowed ones and
    plain's moved the borrowed arms (twenty-seventh session)."""
    rate = key.arms[arm]
    saved, rate.borrowed = rate.borrowed, False  # no clearing on the first own step
    try:
        rate.update(tokens, seconds, steps)
    finally:
        rate.borrowed = saved


def update_keeping_stale_pairs(key, arm, tokens, seconds, steps=1):
    """``_update`` before PAIRS_STALE (thirtieth session): pairs are kept
    however far an arm's rate moved since they were made."""
    from vllm_loopspec.speculative.schedule_choice import ScheduleChooser
    return _with_rule_constant("PAIRS_STALE", float("inf"),
                               lambda: ScheduleChooser._update(key, arm, tokens, seconds, steps))


def choose_without_tries(self, key, where, in_flight):
    """``_choose`` with no try ever due (thirtieth session's check of what
    the tries cost in the sampled cells): a plain verdict then holds for
    HOLD_STEPS steps at a time."""
    return _with_rule_constant("RETRY_TIME_SHARE", 1e-12, lambda: type(self)._choose(self, key, where, in_flight))


def choose_plain(self, width, mix, context=0, in_flight=None):
    """Every step plain, held as a settled plain verdict is, from the
    engine's first step: no measuring, no tries (the twenty-eighth
    session's forced-plain engine), against an engine that learned."""
    from vllm_loopspec.speculative import schedule_choice as sc
    return sc.ScheduleChoice(sc.PLAIN, "faster", hold=sc.HOLD_STEPS)


def choose_one_try_budget(self, key, where, in_flight):
    """``_choose`` before each loser had a try budget of its own
    (thirty-first session): one budget for the losers, taken in turn, so
    only the loser in turn may be tried, once the winner's steps since any
    try afford it. Emulated on the committed method: the loser in turn sees
    the steps since any try (the least of the losers' counts, every try
    resetting the tried arm's), the others none."""
    from vllm_loopspec.speculative import schedule_choice as sc
    losers = [arm for arm in sc.ARMS if arm != sc._winner(key)]
    in_turn = losers[key.retries % len(losers)]
    saved = {arm: key.since_try[arm] for arm in losers}
    for arm in losers:
        key.since_try[arm] = min(saved.values()) if arm == in_turn else -10 ** 9
    choice = type(self)._choose(self, key, where, in_flight)
    stepped = key.since_try[losers[0] if losers[0] != in_turn else losers[-1]] != -10 ** 9
    for arm in losers:
        if choice.reason == "retry" and key.since_try[in_turn] == 0 and choice.arm == in_turn:
            key.since_try[arm] = 0  # a try restarts the one budget
        else:
            key.since_try[arm] = saved[arm] + (1 if stepped else 0)
    return choice


def observe_declined_as_policy(self, *args, declined=False, **kwargs):
    """``observe`` before a policy step that drafted nothing counted for
    plain too (thirty-first session): the policy arm's sample alone."""
    return type(self).observe(self, *args, **kwargs)


def observe_one_switch_step(self, width, mix, arm, committed, seconds, context=0, after=None, declined=False):
    """``observe`` before SWITCH_STEPS and UNCHOSEN (thirty-third session):
    only the first step after a switch of arm is no sample, and a step
    after one the chooser did not choose (a prefill) is one."""
    from vllm_loopspec.speculative import schedule_choice as sc
    after = None if after == sc.UNCHOSEN else after
    return _with_rule_constant("SWITCH_STEPS", 1, lambda: type(self).observe(
        self, width, mix, arm, committed, seconds, context, after=after, declined=declined))


def choose_one_switch_step(self, key, where, in_flight):
    """``_choose`` with tries of a short arm two steps long, as before SWITCH_STEPS."""
    return _with_rule_constant("SWITCH_STEPS", 1, lambda: type(self)._choose(self, key, where, in_flight))


def lag_charge_none(self, key, arm, width, mix, context, committed, seconds, lag):
    """``_lag_charge`` off: a speculative step rated at its committed tokens,
    as before the chooser charged the lag a step adds to its batch
    (forty-fifth session; the thirty-fifth to forty-fourth rated it by
    the rows' paces, ``DrainPaces``, since removed)."""
    return 0.0


def choose_without_plain_doubt(self, key, where, in_flight):
    """``_choose`` before PLAIN_DOUBT_STEPS (thirty-seventh session): a
    long arm's lead over plain decides without plain measured beside it."""
    return _with_rule_constant("PLAIN_DOUBT_SAMPLES", 0, lambda: type(self)._choose(self, key, where, in_flight))


def choose_without_doubt_max_lead(self, key, where, in_flight):
    """``_choose`` without PLAIN_DOUBT_MAX_LEAD (forty-ninth session: a
    leader 1.8x plain's rate or more not doubted for plain's few samples).
    The rule was reverted (``b2c7ced``); run this from a checkout of
    ``0928606``, where the constant exists."""
    return _with_rule_constant("PLAIN_DOUBT_MAX_LEAD", float("inf"),
                               lambda: type(self)._choose(self, key, where, in_flight))


def choose_half_try_share(self, key, where, in_flight):
    """``_choose`` with half of RETRY_TIME_SHARE: a variant, not an older
    rule (forty-ninth session): the "old" engines spend half the time on
    losers' tries, so new over old under 1 says the tries cost that much."""
    from vllm_loopspec.speculative.schedule_choice import RETRY_TIME_SHARE
    return _with_rule_constant("RETRY_TIME_SHARE", RETRY_TIME_SHARE / 2,
                               lambda: type(self)._choose(self, key, where, in_flight))


def time_choice_without_last_step(self, now, scheduler_output):
    """The drafter's ``_time_schedule_choice`` before a batch's last step
    was observed (``473cce5``, fifty-third session): a step followed by one
    with new requests was no sample (the engine may have idled since it
    ended, and its end was not kept)."""
    if scheduler_output.scheduled_new_reqs:
        self._choice_end = None
    return type(self)._time_schedule_choice(self, now, scheduler_output)


def credit_held_as_one_tick(self, steps, timed=0, seconds=0.0):
    """``credit_held`` before a held span's steps counted on the pairs'
    clock (fifty-fourth session): the span was one sample's tick, so it
    paired with a sample of another arm taken up to PAIR_GAP samples before
    the hold began, however many steps the hold ran."""
    if self._last_key is not None and steps > 0:
        self._clock -= steps - 1  # the committed method adds them back
    return type(self).credit_held(self, steps, timed, seconds)


CURRENT_REPEAT = 0  # set by main: the repeat being run


def choose_plain_after_learning(self, width, mix, context=0, in_flight=None):
    """The committed chooser through the first repeat (the engine learns:
    warm-up, measuring, tries), then :func:`choose_plain`: separates what a
    learned engine carries into its plain steps from what its choices
    after learning cost (thirtieth session)."""
    if CURRENT_REPEAT >= 1:
        return choose_plain(self, width, mix, context, in_flight)
    return type(self).choose(self, width, mix, context, in_flight)


def pair_from_longer_rows(self, key, where, arm, rate):
    """``_pair`` before the fifty-fifth session: a sample pairs with another
    arm's last one at a longer context bucket too (one taken before the
    batch turned over). The committed method, with each stored sample's
    bucket read as no longer than this one's for the call."""
    last = self._last_sample.get(where[:2], {})
    saved = dict(last)
    for other, (when, other_rate, context) in saved.items():
        last[other] = (when, other_rate, min(context, where[2]))
    try:
        return type(self)._pair(self, key, where, arm, rate)
    finally:
        for other, sample in saved.items():
            if other != arm:
                last[other] = sample


# rule -> the chooser methods it replaces on the "old" engines' choosers
# ("owner.method" names: an attribute of the drafter's; "drafter.method": the drafter's own)
OLD_RULES = {"long_loser_borrow": [("_fill_from_neighbours", fill_without_long_losers)],
             "relative_borrow": [("_fill_from_neighbours", fill_raw), ("_update", update_mixing_borrowed)],
             "pairs_stale": [("_update", update_keeping_stale_pairs)],
             "no_tries": [("_choose", choose_without_tries)],
             "forced_plain": [("choose", choose_plain)],
             "plain_after_learning": [("choose", choose_plain_after_learning)],
             "one_try_budget": [("_choose", choose_one_try_budget)],
             "declined_as_policy": [("observe", observe_declined_as_policy)],
             "one_switch_step": [("observe", observe_one_switch_step), ("_choose", choose_one_switch_step)],
             "no_lag_charge": [("_lag_charge", lag_charge_none)],
             "no_plain_doubt": [("_choose", choose_without_plain_doubt)],
             "no_doubt_max_lead": [("_choose", choose_without_doubt_max_lead)],
             "half_try_share": [("_choose", choose_half_try_share)],
             "no_last_step": [("drafter._time_schedule_choice", time_choice_without_last_step)],
             "held_span_one_tick": [("credit_held", credit_held_as_one_tick)],
             "pairs_from_longer_rows": [("_pair", pair_from_longer_rows)],
             # nothing replaced: two engines of the committed chooser, the A/B's own spread
             "identical": []}


def main():
    from vllm import LLM
    from loopspec_decode import decode_trial
    from vllm_loopspec.engine_internals import model_runner
    ap = argparse.ArgumentParser()
    ap.add_argument("rule", choices=sorted(OLD_RULES))
    ap.add_argument("out")
    add_sweep_protocol_args(ap)
    args = ap.parse_args()
    args_engine = ENGINE_ARGS | {"max_num_seqs": max(args.concurrency)}
    engines = {"native": LLM(CHECKPOINT, **args_engine)}
    replacements = OLD_RULES[args.rule]
    for d in args.draft_loops:
        for version in ("old", "new"):
            llm = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": d, "schedule": "auto"},
                      **args_engine)
            if version == "old":
                drafter = model_runner(llm).drafter
                for method, replacement in replacements:
                    owner, _, method = method.rpartition(".")
                    target = drafter if owner == "drafter" else getattr(drafter, owner) if owner else drafter.chooser
                    static = isinstance(type(target).__dict__.get(method), staticmethod)
                    setattr(target, method, replacement if static else types.MethodType(replacement, target))
            engines[f"d{d} {version}"] = llm
    names = list(engines)
    prompts = {"short": load_prompts("mixed"), "long": load_prompts("long")}
    new_tokens = {"short": 128, "long": 192}
    for name in names:  # kv_sweep.py's warm-up
        for c in args.concurrency:
            decode_trial(engines[name], prompts["short"][:c], 16)
    cells = [(t, s) for t in args.temperatures for s in args.settings]
    runs = {f"{s}{'' if t == 0 else f' T{t}'} c{c}": {n: [] for n in names} for t, s in cells for c in args.concurrency}
    t0 = time.perf_counter()
    global CURRENT_REPEAT
    for rep in range(args.repeats):
        CURRENT_REPEAT = rep
        for t, s in cells:
            for c in args.concurrency:
                batch = [prompts[s][(rep * c + i) % len(prompts[s])] for i in range(c)]
                shift = (rep + c) % len(names)
                cell = f"{s}{'' if t == 0 else f' T{t}'} c{c}"
                for name in names[shift:] + names[:shift]:
                    r = decode_trial(engines[name], batch, new_tokens[s], temperature=t)
                    runs[cell][name].append(r["tokens_per_s"])
        print(f"repeat {rep + 1} after {time.perf_counter() - t0:.0f} s", flush=True)
    table = {}
    for cell, by in runs.items():
        nat = statistics.median(by["native"])
        row = {n: round(statistics.median(v) / nat, 4) for n, v in by.items() if n != "native"}
        for d in args.draft_loops:
            row[f"d{d} new/old paired"] = round(statistics.median(
                a / b for a, b in zip(by[f"d{d} new"], by[f"d{d} old"])), 4)
        table[cell] = row
        print(cell, row, flush=True)
    # What each engine's chooser did over the whole run (warm-up included):
    # steps by arm and reason, the mechanism under the throughput.
    decisions = {name: {f"{arm}/{reason}": n for (arm, reason), n in sorted(
        model_runner(llm).drafter.chooser.decisions.items())} for name, llm in engines.items() if name != "native"}
    print(json.dumps(decisions, indent=1))
    Path(args.out).write_text(json.dumps({"probe": "chooser_ab", "rule": args.rule, "command": " ".join(sys.argv),
                                          "when": time.strftime("%Y-%m-%d %H:%M:%S"), "tokens_per_s": runs,
                                          "over_native": table, "decisions": decisions}, indent=1) + "\n")


if __name__ == "__main__":
    main()
