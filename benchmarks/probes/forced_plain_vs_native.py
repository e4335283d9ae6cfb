"""Issue 13 check: is a loopspec engine that decodes plainly as fast as
native? Three engines in this process, interleaved: native; loopspec held
under the width cap (the controller disarmed with a cap below the batch and
no probe due: every step takes the real fast path, ``holds_plain``); and
loopspec with the adaptive policy. Separates the cost of running a
speculative engine at all from the cost of its decisions.

    python benchmarks/probes/forced_plain_vs_native.py [widths ...]

Writes ``benchmarks/results/forced_plain_vs_native.json``."""
import json
import os
import statistics
import sys
import time

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.engine_internals import model_runner

    widths = [int(a) for a in sys.argv[1:]] or [4, 16]
    prompts = load_prompts("mixed")
    engines = {"native": LLM(CHECKPOINT, **ENGINE_ARGS)}
    for name in ("held plain", "adaptive"):
        engines[name] = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 1}, **ENGINE_ARGS)
    held = model_runner(engines["held plain"]).drafter.controller

    def hold_plain(width: int, mix: int) -> bool:
        """The width-cap fast path at every width (the real one re-arms at
        the re-arm width, which would be 1 at the narrowest cap)."""
        held.step += 1
        held._record(width, [0] * width, "width_cap")
        return True

    held.armed, held.holds_plain = False, hold_plain
    results = {}
    for temperature in (0.8, 0.0):
        params = SamplingParams(max_tokens=128, temperature=temperature, ignore_eos=True)
        for c in widths:
            rates = {name: [] for name in engines}
            for rep in range(5):
                batch = [prompts[(rep * c + i) % len(prompts)] for i in range(c)]
                for name, llm in engines.items():
                    t = time.perf_counter()
                    out = llm.generate(batch, params, use_tqdm=False)
                    n = sum(len(o.outputs[0].token_ids) for o in out)
                    if rep:  # the first repeat warms every shape
                        rates[name].append(n / (time.perf_counter() - t))
            paired = {name: statistics.median(a / b for a, b in zip(rates[name], rates["native"]))
                      for name in engines if name != "native"}
            results[f"T{temperature} c{c}"] = {"tokens_per_s": rates, "paired_vs_native": paired}
            print(f"T{temperature} c{c}", {k: round(v, 3) for k, v in paired.items()}, flush=True)
    suffix = "" if widths == [4, 16] else "_c" + "_".join(map(str, widths))
    out = ROOT / "benchmarks" / "results" / f"forced_plain_vs_native{suffix}.json"
    out.write_text(json.dumps({
        "benchmark": "forced_plain_vs_native", "command": " ".join(["python", *sys.argv]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats_timed": 4, "max_tokens": 128,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset: OpenMP default)"),
        "results": results}, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
