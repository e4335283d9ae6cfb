"""Issue 13 diagnostic: is an "auto" engine's ~2% plain-step cost over
native's in loopspec's hooks, or in running a speculative engine at all?

Five engines in this process, decoding the same batches in turn (order
rotated each repeat), every step plain:

* ``native``: no speculative config;
* ``auto``: loopspec d1 "auto", its chooser holding plain from the first
  step (``chooser_ab.choose_plain``), hooks as committed;
* ``bare_runner``: the same engine with the runner's loopspec hooks
  bypassed (``execute_model`` / ``sample_tokens`` / ``take_draft_token_ids``
  and the step-metadata overrides go straight to vLLM's runner, with
  ``speculative_config`` set aside for the step as the committed plain path
  does; no drafter call at all);
* ``thin_off``: ``auto`` with only the mixin's thin overrides
  (``_prepare_inputs``, ``_build_attention_metadata``, ``_model_forward``,
  and the async-only ``_update_states``, ``_bookkeeping_sync``,
  ``_copy_draft_token_ids_to_cpu``) bound to vLLM's own: the drafter's hooks
  still run;
* ``bare_core``: ``bare_runner`` plus ``EngineCore.use_spec_decode`` off, so
  ``post_step`` asks for no draft hand-over: what is left is vLLM's
  scheduler and runner built for a speculative config.

Trials as plain_step_outside.py's (prefill untimed); per engine the median
over repeats of microseconds per decode step, and each engine's median
paired ratio of native's step to its own.

    python benchmarks/probes/bare_plain_engines.py [--repeats N] [--c 4 8] [--temperature 0.8]
        [--setting short] [--engines auto thin_off bare_runner bare_core] [--out FILE]
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


THIN_WRAPPERS = ("_prepare_inputs", "_build_attention_metadata", "_model_forward", "_update_states",
                 "_bookkeeping_sync", "_copy_draft_token_ids_to_cpu")


def bypass_thin_wrappers(runner) -> None:
    """vLLM's own methods for the mixin's thin overrides (every step runs
    through them; in a plain synchronous step they only pass through)."""
    from vllm_loopspec.speculative.runner import LoopSpecRunnerMixin

    base = super(LoopSpecRunnerMixin, runner)
    for name in THIN_WRAPPERS:
        setattr(runner, name, getattr(base, name))


def bypass_runner_hooks(runner) -> None:
    """Every step of ``runner`` as vLLM's own runner's, speculative config
    set aside from execute_model to the end of sample_tokens."""
    from vllm_loopspec.speculative.runner import LoopSpecRunnerMixin

    base = super(LoopSpecRunnerMixin, runner)
    config = runner.speculative_config

    def execute_model(scheduler_output, *args, **kwargs):
        runner.speculative_config = None
        out = base.execute_model(scheduler_output, *args, **kwargs)
        if out is not None or runner.execute_model_state is None:
            runner.speculative_config = config
        return out

    def sample_tokens(*args, **kwargs):
        try:
            return base.sample_tokens(*args, **kwargs)
        finally:
            runner.speculative_config = config

    runner.execute_model = execute_model
    runner.sample_tokens = sample_tokens
    runner.take_draft_token_ids = lambda: None
    bypass_thin_wrappers(runner)


def trial(llm, prompts: list[str], new_tokens: int, temperature: float) -> float:
    """Microseconds per decode step."""
    engine = llm.llm_engine
    add_and_prefill(llm, prompts, new_tokens, temperature)
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--c", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--setting", choices=["short", "long"], default="short")
    ap.add_argument("--engines", nargs="+", default=["auto", "thin_off", "bare_runner", "bare_core"],
                    help="the loopspec engines to build beside native (fewer: a smaller process)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from vllm import LLM

    from vllm_loopspec.engine_internals import engine_core, model_runner
    from chooser_ab import choose_plain

    prompts = load_prompts("mixed" if args.setting == "short" else "long")
    new_tokens = 128 if args.setting == "short" else 192
    spec = {"method": "loopspec", "draft_loops": 1, "schedule": "auto"}
    engines = {"native": LLM(CHECKPOINT, **ENGINE_ARGS)}
    for name in args.engines:
        engines[name] = LLM(CHECKPOINT, speculative_config=spec, **ENGINE_ARGS)
        chooser = model_runner(engines[name]).drafter.chooser
        chooser.choose = types.MethodType(choose_plain, chooser)
        if name == "thin_off":
            bypass_thin_wrappers(model_runner(engines[name]))
        elif name in ("bare_runner", "bare_core"):
            bypass_runner_hooks(model_runner(engines[name]))
        if name == "bare_core":
            engine_core(engines[name]).use_spec_decode = False
    names = list(engines)
    results = {}
    for c in args.c:
        for name in names:
            trial(engines[name], prompts[:c], 16, args.temperature)
        runs = {name: [] for name in names}
        for rep in range(args.repeats):
            batch = [prompts[(rep * c + i) % len(prompts)] for i in range(c)]
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in (order if rep % 2 == 0 else order[::-1]):
                runs[name].append(trial(engines[name], batch, new_tokens, args.temperature))
        median = {name: statistics.median(r) for name, r in runs.items()}
        ratio = {name: statistics.median(n / e for n, e in zip(runs["native"], runs[name])) for name in names}
        results[c] = {"median_us_per_step": median, "native_over_engine_paired": ratio, "runs": runs}
        print(f"c{c} ({args.setting}, T{args.temperature}, {args.repeats} repeats): us/step and native/engine paired")
        for name in names:
            print(f"  {name:12s} {median[name]:8.1f}  {ratio[name]:.4f}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
