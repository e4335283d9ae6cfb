"""Issue 13 diagnostic: a speculative engine's plain step at the burst's
width, model forward and the rest apart. Native engines and "bare" ones
(a loopspec "auto" engine held plain from its first step with every runner
hook bypassed: ``chooser_ab.choose_plain``, ``bare_plain_engines.
bypass_runner_hooks``; vLLM's runner and scheduler built for a speculative
config, no loopspec code in the steps), built in the order given (default
native, bare, bare2, native2: the build order's drift cancels). Each trial
decodes 17 sampled requests (T=0.8, 96 tokens) to the end; per trial the
median ``engine.step()`` and the median ``_model_forward`` call (the steps
after the fourth). Reported: each engine against the first, median of the
ratios paired by repeat.

    python benchmarks/probes/plain_step_forward_split.py REPEATS [KIND,KIND,...] [OUT.json]
"""
import json
import statistics as st
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive_burst  # noqa: E402,F401  (sets the in-process environment)
from burst_engine_kinds import build  # noqa: E402
from loopspec_decode import load_prompts  # noqa: E402
from vllm_loopspec.engine_internals import model_runner  # noqa: E402


def time_forward(llm, calls: list[float]) -> None:
    runner = model_runner(llm)
    forward = runner._model_forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        calls.append(time.perf_counter() - start)
        return out

    runner._model_forward = timed


def trial(llm, prompts: list[str], tag: str) -> list[float]:
    from vllm import SamplingParams

    engine = llm.llm_engine
    for i in range(17):
        engine.add_request(f"{tag}-{i}", prompts[i % len(prompts)],
                           SamplingParams(max_tokens=96, temperature=0.8, seed=i, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def main() -> None:
    repeats = int(sys.argv[1])
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ["native", "bare", "bare2", "native2"]
    engines = {kind: build(kind) for kind in kinds}
    forwards = {kind: [] for kind in kinds}
    for kind, llm in engines.items():
        time_forward(llm, forwards[kind])
    prompts = load_prompts("mixed")
    for kind, llm in engines.items():
        trial(llm, prompts, f"warm-{kind}")
    res = {kind: {"step": [], "forward": []} for kind in kinds}
    for rep in range(repeats):
        for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
            forwards[kind].clear()
            steps = trial(engines[kind], prompts, f"{rep}-{kind}")
            res[kind]["step"].append(st.median(steps[4:]))
            res[kind]["forward"].append(st.median(forwards[kind][4:]))
    first = res[kinds[0]]
    for kind in kinds:
        mine = res[kind]
        step = st.median(a / b for a, b in zip(mine["step"], first["step"]))
        forward = st.median(a / b for a, b in zip(mine["forward"], first["forward"]))
        outside = st.median((a - c) / (b - d) for a, b, c, d in
                            zip(mine["step"], first["step"], mine["forward"], first["forward"]))
        print(f"{kind:>8}: step {1e6 * st.median(mine['step']):.0f} us ({step:.3f}x {kinds[0]}), forward "
              f"{1e6 * st.median(mine['forward']):.0f} us ({forward:.3f}x), outside the forward "
              f"{1e6 * (st.median(mine['step']) - st.median(mine['forward'])):.0f} us ({outside:.3f}x)")
    if len(sys.argv) > 3:
        Path(sys.argv[3]).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "built_in_order": kinds,
                                                 "median_seconds_per_trial": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
