"""Issue 13 diagnostic: loopspec's hooks of a held plain step, timed hot.

An auto d1 engine whose chooser holds plain (``chooser_ab.choose_plain``)
decodes four sampled requests; then ``LoopSpecDrafter.propose`` and
``step_started`` of a held step are called in a tight loop (timeit, then
cProfile). Against ``plain_step_outside.py``'s per-call medians inside the
engine's steps, this says how much of their cost is the code itself and how
much is running it cold, between a model forward and vLLM's step.

    python benchmarks/probes/held_step_micro.py
"""
import cProfile
import pstats
import sys
import timeit
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _probe  # noqa: E402,F401  (environment before vLLM)
from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts  # noqa: E402

CALLS = 20000


def main() -> None:
    from vllm import LLM, SamplingParams

    from chooser_ab import choose_plain
    from vllm_loopspec.engine_internals import model_runner

    llm = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1, "schedule": "auto"},
              **ENGINE_ARGS)
    runner = model_runner(llm)
    drafter = runner.drafter
    drafter.chooser.choose = types.MethodType(choose_plain, drafter.chooser)
    captured = {}
    execute = runner.execute_model

    def capture(scheduler_output, *args, **kwargs):
        captured["schedule"] = scheduler_output
        return execute(scheduler_output, *args, **kwargs)

    runner.execute_model = capture
    engine = llm.llm_engine
    prompts = load_prompts("mixed")
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=64, temperature=0.8, seed=i,
                                                               ignore_eos=True))
    for _ in range(40):  # into steady decode, held plain steps
        engine.step()
    schedule = captured["schedule"]
    sampled = [[5], [6], [7], [8]]
    print("a held step's schedule:", schedule.num_scheduled_tokens, "drafts", schedule.scheduled_spec_decode_tokens)

    def held_propose():
        drafter._hold_left = 10
        drafter.propose(sampled)

    def held_started():
        drafter._next_held, drafter._hold_left = True, 10
        drafter.step_started(schedule)

    for name, call in (("propose", held_propose), ("step_started", held_started),
                       ("step_finished", drafter.step_finished)):
        print(f"held {name}: {timeit.timeit(call, number=CALLS) / CALLS * 1e6:.2f} us a call (hot, {CALLS} calls)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(5000):
        held_propose()
        held_started()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
