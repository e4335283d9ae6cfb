"""Issue 13 diagnostic: which of a forced-plain "auto" engine's steps cost
more than a native engine's, by what loopspec does in them.

Native and three loopspec d1 "auto" engines in one process (the chooser
holding plain from the first step, ``chooser_ab.choose_plain``), short
T=0.8, c4, 128 tokens, order rotated each repeat: ``auto`` as committed,
``thin`` (the mixin's pass-through overrides bound to vLLM's,
``bare_plain_engines.bypass_thin_wrappers``) and ``bare`` (no loopspec hook
at all, ``bare_plain_engines.bypass_runner_hooks``). Each ``engine.step()``
is timed whole (scheduler, runner, output handling), and the loopspec
engines' steps are told apart by what ran in them: ``lean`` (a held step
on the lean path, where the runner has one: ``_loopspec_lean``, built and
reverted in the forty-second session, ``0113a8b``), ``timed``
(timed for the adaptive policy's cost model), ``chosen`` (the chooser
asked), ``other``. Median and mean microseconds per kind.

    python benchmarks/probes/plain_step_kinds.py [--repeats N] [--out FILE]
"""
import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _probe  # noqa: E402,F401  (environment before vLLM)
from _probe import CHECKPOINT, ENGINE_ARGS, add_and_prefill, load_prompts  # noqa: E402


def flag_steps(drafter, flags: dict) -> None:
    """Set ``flags["timed"]`` / ``flags["chosen"]`` in steps the drafter times
    for its policy or asks its chooser in."""
    step_finished, choose = drafter.step_finished, drafter.chooser.choose

    def timed_step_finished():
        if drafter._step_shape is not None:
            flags["timed"] = True
        return step_finished()

    def flagged_choose(*args, **kwargs):
        flags["chosen"] = True
        return choose(*args, **kwargs)

    drafter.step_finished, drafter.chooser.choose = timed_step_finished, flagged_choose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from vllm import LLM

    from bare_plain_engines import bypass_runner_hooks, bypass_thin_wrappers
    from chooser_ab import choose_plain
    from vllm_loopspec.engine_internals import model_runner

    spec = {"method": "loopspec", "draft_loops": 1, "schedule": "auto"}
    engines = {"native": LLM(CHECKPOINT, **ENGINE_ARGS)}
    flags = {name: {} for name in ("auto", "thin", "bare")}
    for name in flags:
        engines[name] = LLM(CHECKPOINT, speculative_config=spec, **ENGINE_ARGS)
        runner = model_runner(engines[name])
        runner.drafter.chooser.choose = types.MethodType(choose_plain, runner.drafter.chooser)
        if name == "bare":
            bypass_runner_hooks(runner)
        else:
            flag_steps(runner.drafter, flags[name])
        if name == "thin":
            bypass_thin_wrappers(runner)
    prompts = load_prompts("mixed")
    names = list(engines)
    steps = {name: {} for name in names}
    for rep in range(args.repeats):
        batch = [prompts[(rep * 4 + i) % len(prompts)] for i in range(4)]
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in (order if rep % 2 == 0 else order[::-1]):
            llm = engines[name]
            runner = model_runner(llm) if name != "native" else None
            add_and_prefill(llm, batch, 128, 0.8)
            while llm.llm_engine.has_unfinished_requests():
                start = time.perf_counter_ns()
                llm.llm_engine.step()
                us = (time.perf_counter_ns() - start) / 1e3
                kind = "all"
                if name in flags:
                    ran = flags[name]
                    kind = ("lean" if getattr(runner, "_loopspec_lean", False)
                            else "+".join(sorted(ran)) or "other")
                    ran.clear()
                steps[name].setdefault(kind, []).append(us)
    summary = {}
    for name, kinds in steps.items():
        every = [us for v in kinds.values() for us in v]
        summary[name] = {kind: {"steps": len(v), "median_us": statistics.median(v), "mean_us": statistics.fmean(v)}
                         for kind, v in [("every step", every), *sorted(kinds.items())]}
        for kind, s in summary[name].items():
            print(f"{name:7s} {kind:14s} {s['steps']:5d} steps  median {s['median_us']:8.1f}  mean {s['mean_us']:8.1f}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "summary": summary,
                                        "steps": steps}, indent=1) + "\n")


if __name__ == "__main__":
    main()
