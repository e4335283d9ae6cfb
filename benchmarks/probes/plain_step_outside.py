"""Issue 13 diagnostic: where an "auto" engine's plain step spends its time
outside the model forward, against native's, piece by piece.

Over the committed sweeps, the auto engines' trials that ran only plain
steps were 0.980x the native trial beside them (697 trials, twelve sweeps)
where a second native engine was 0.998x; their model forward was level
(1.008x, the twin's 1.008x) and the time outside it 1.045x (60-110 us a
step). This probe times the engine step's parts in both engines with
perf_counter wrappers (a fraction of a microsecond each, the same in both):
vLLM's scheduler (schedule, update_from_output), the executor's
execute_model and sample_tokens, the model forward, post_step (the draft
hand-over), the output processor and the stats loggers.

Engines: native, and an auto engine (d1) whose chooser answers plain with a
hold from its first step (``chooser_ab.choose_plain``) or, with ``--learned``,
the committed chooser. Trials as kv_sweep.py's (prefill untimed), engines in
turn, order reversed each repeat; per engine and part the median over
repeats of microseconds per decode step.

    python benchmarks/probes/plain_step_outside.py [--repeats N] [--c 4] [--temperature 0.8]
        [--setting short] [--learned] [--bare] [--out FILE]
"""
import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _probe  # noqa: E402,F401  (environment before vLLM)
from _probe import CHECKPOINT, ENGINE_ARGS, add_and_prefill, load_prompts  # noqa: E402

PARTS = ("schedule", "execute_model", "forward", "sample_tokens", "update_from_output", "post_step",
         "process_outputs", "record_stats")
# Inside execute_model and sample_tokens: the runner's own parts.
RUNNER_PARTS = ("_update_states", "_prepare_inputs", "_build_attention_metadata",
                "_determine_batch_execution_and_padding", "_preprocess", "_sample", "_bookkeeping_sync")
DRAFTER_PARTS = ("propose", "step_started", "step_finished")  # loopspec's, in the auto engine


class PartTimer:
    """Accumulates seconds per part of ``llm``'s steps (wrappers on the instances)."""

    def __init__(self, llm) -> None:
        from vllm_loopspec.engine_internals import engine_core, model_runner

        self.seconds = dict.fromkeys(PARTS + RUNNER_PARTS + DRAFTER_PARTS + ("runner_execute_model",), 0.0)
        self.calls: dict[str, list[float]] = {}  # per call of the drafter's parts: its seconds
        core = engine_core(llm)
        engine = llm.llm_engine
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.scheduler, "update_from_output", "update_from_output")
        self._wrap(core.model_executor, "execute_model", "execute_model")
        self._wrap(core.model_executor, "sample_tokens", "sample_tokens")
        self._wrap(core, "post_step", "post_step")
        runner = model_runner(llm)
        self._wrap(runner, "_model_forward", "forward")
        for name in RUNNER_PARTS:
            self._wrap(runner, name, name)
        self._wrap(runner, "execute_model", "runner_execute_model")
        if getattr(runner, "drafter", None) is not None:
            for name in DRAFTER_PARTS:
                self._wrap(runner.drafter, name, name)
        self._wrap(engine.output_processor, "process_outputs", "process_outputs")
        if engine.logger_manager is not None:
            self._wrap(engine.logger_manager, "record", "record_stats")

    def _wrap(self, obj, name: str, part: str) -> None:
        original = getattr(obj, name)
        seconds = self.seconds
        calls = self.calls.setdefault(part, []) if part in DRAFTER_PARTS else None

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                seconds[part] += took
                if calls is not None:
                    calls.append(took)

        setattr(obj, name, timed)

    def reset(self) -> None:
        for part in self.seconds:
            self.seconds[part] = 0.0
        for calls in self.calls.values():
            calls.clear()


def trial(llm, timer: PartTimer, prompts: list[str], new_tokens: int, temperature: float) -> dict:
    engine = llm.llm_engine
    add_and_prefill(llm, prompts, new_tokens, temperature)
    timer.reset()
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    per_step = {part: s / steps * 1e6 for part, s in timer.seconds.items()}
    per_step["step"] = wall / steps * 1e6
    per_step["outside_forward"] = per_step["step"] - per_step["forward"]
    per_step["steps"] = steps
    for part, calls in timer.calls.items():
        # The typical call (a held plain step's) against the mean (decision steps included).
        per_step[f"{part} median call"] = statistics.median(calls) * 1e6 if calls else 0.0
    return per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--c", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--setting", choices=["short", "long"], default="short")
    ap.add_argument("--learned", action="store_true", help="the committed chooser, not forced plain")
    ap.add_argument("--bare", action="store_true",
                    help="the auto engine's hooks bypassed and no post_step hand-over (bare_plain_engines.py's "
                         "bare_core): what vLLM's speculative engine itself costs, part by part")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from vllm import LLM

    from vllm_loopspec.engine_internals import model_runner
    from chooser_ab import choose_plain

    prompts = load_prompts("mixed" if args.setting == "short" else "long")
    new_tokens = 128 if args.setting == "short" else 192
    args_ = {**ENGINE_ARGS, "disable_log_stats": False}
    engines = {"native": LLM(CHECKPOINT, **args_),
               "auto": LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1,
                                                           "schedule": "auto"}, **args_)}
    if not args.learned:
        chooser = model_runner(engines["auto"]).drafter.chooser
        chooser.choose = types.MethodType(choose_plain, chooser)
    if args.bare:
        from bare_plain_engines import bypass_runner_hooks
        from vllm_loopspec.engine_internals import engine_core

        bypass_runner_hooks(model_runner(engines["auto"]))
        engine_core(engines["auto"]).use_spec_decode = False
    timers = {name: PartTimer(llm) for name, llm in engines.items()}
    names = list(engines)
    for name in names:
        trial(engines[name], timers[name], prompts[:args.c], 16, args.temperature)
    runs = {name: [] for name in names}
    for rep in range(args.repeats):
        batch = [prompts[(rep * args.c + i) % len(prompts)] for i in range(args.c)]
        for name in (names if rep % 2 == 0 else names[::-1]):
            runs[name].append(trial(engines[name], timers[name], batch, new_tokens, args.temperature))
    keys = ("step", "forward", "outside_forward", *[p for p in PARTS if p != "forward"], "runner_execute_model", *RUNNER_PARTS, *DRAFTER_PARTS)
    keys += tuple(k for k in runs["auto"][0] if k.endswith("median call"))
    summary = {name: {k: statistics.median(r.get(k, 0.0) for r in runs[name]) for k in keys} for name in names}
    paired = {k: statistics.median(a.get(k, 0.0) - b.get(k, 0.0) for a, b in zip(runs["auto"], runs["native"]))
              for k in keys}
    print(f"us per decode step, median over {args.repeats} repeats ({args.setting}, c{args.c}, T{args.temperature}, "
          f"{'learned' if args.learned else 'forced plain'} chooser{', hooks bypassed' if args.bare else ''})")
    print(f"{'part':20s} {'native':>9s} {'auto':>9s} {'auto-native (paired)':>22s}")
    for k in keys:
        print(f"{k:20s} {summary['native'][k]:9.1f} {summary['auto'][k]:9.1f} {paired[k]:22.1f}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "summary": summary,
                                        "paired_difference_us": paired, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
