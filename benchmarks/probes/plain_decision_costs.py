"""Issue 13 diagnostic: what an ``"auto"`` engine's plain steps cost, by how
the step decided the next one, against a native engine's steps on the same
prompts. In the sweeps' sampled cells (plain the best arm) auto's plain-only
trials ran 0.03-0.18 ms a step over the native trial beside them, mostly
outside the model forward. Each step's propose decides the next step: it was
held (a hold of plain steps running: the cheap path), it asked the chooser
(``plain`` / ``policy`` / ``pipelined`` chosen), or the policy arm declined
(a plain step through the policy's planning). Steps are timed from
``execute_model`` to the end of ``sample_tokens`` (propose runs inside).

    python benchmarks/probes/plain_decision_costs.py [width] [temperature] [reps] [draft_loops] [short|long] [extra]

``extra``: native engines built first and kept alive (0 by default), as the
sweep's process holds ~20 engines beside the ones it times.

Prints per decision kind: steps, median ms, and native's median step.
"""
import statistics
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, add_and_prefill, cell_from_argv, time_steps


def main() -> None:
    from vllm import LLM
    from vllm_loopspec.engine_internals import model_runner
    from vllm_loopspec.speculative.schedule_choice import arm_kind

    width, temperature, reps, d, prompts, tokens = cell_from_argv(sys.argv, 8, 0.8, 6)
    setting = "long" if tokens == 192 else "short"
    extra = [LLM(CHECKPOINT, **ENGINE_ARGS) for _ in range(int(sys.argv[6]) if len(sys.argv) > 6 else 0)]
    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": d, "schedule": "auto"},
               **ENGINE_ARGS)
    drafter = model_runner(auto).drafter
    kinds: list[str] = []
    mark = {}
    propose, held, choose, declined = (drafter.propose, drafter._take_held_step, drafter._choose_on_every_rank,
                                       drafter._policy_declined)

    def marked_propose(*args, **kwargs):
        mark.clear()
        out = propose(*args, **kwargs)
        kinds.append(mark.get("kind", "no choice"))
        return out

    def marked_held():
        taken = held()
        if taken:
            mark["kind"] = "held"
        return taken

    def marked_choose(*args, **kwargs):
        choice = choose(*args, **kwargs)
        mark["kind"] = f"chose {arm_kind(choice.arm)}" + (" with a hold" if choice.hold else "")
        return choice

    def marked_declined():
        mark["kind"] = "policy declined"
        declined()

    drafter.propose, drafter._take_held_step = marked_propose, marked_held
    drafter._choose_on_every_rank, drafter._policy_declined = marked_choose, marked_declined
    samples = {"native": [], "auto": []}
    time_steps(model_runner(native), samples["native"])
    time_steps(model_runner(auto), samples["auto"])
    by_kind: dict[str, list[float]] = {}
    native_ms: list[float] = []
    for rep in range(reps + 1):  # the first is warm-up, not counted
        batch = [prompts[(rep * width + i) % len(prompts)] for i in range(width)]
        for name, llm in (("native", native), ("auto", auto)) if rep % 2 == 0 else (("auto", auto), ("native", native)):
            add_and_prefill(llm, batch, tokens, temperature)
            samples[name].clear()
            kinds.clear()
            engine = llm.llm_engine
            while engine.has_unfinished_requests():
                engine.step()
            if rep == 0:
                continue
            steps = [s for _, n, s in samples[name]]
            if name == "native":
                native_ms += [1e3 * s for s in steps]
            else:
                for kind, (spec, n, s) in zip(kinds, samples[name]):
                    by_kind.setdefault(kind if not spec else f"{kind} [speculative step]", []).append(1e3 * s)
        time.sleep(0)
    print(f"width {width}, T={temperature}, {setting}, d={d}, {reps} repeats, {len(extra)} extra engines: "
          f"native step median "
          f"{statistics.median(native_ms):.3f} ms ({len(native_ms)} steps)")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        print(f"  auto, decided {kind}: {len(ms)} steps, median {statistics.median(ms):.3f} ms")


if __name__ == "__main__":
    main()
