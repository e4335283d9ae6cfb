"""Where a pipelined tick's time goes (issue 12): the model tick (and, in
it, vLLM's ``Attention`` calls, one per loop group and layer), the per-tick
``lm_head``, the loop groups' attention metadata, and the rest of
``run_pipelined`` (host bookkeeping), per tick, beside a native loop pass.

    .venv/bin/python benchmarks/probes/pipeline_tick_split.py [d1] [K] [concurrency] [temperature]

Writes ``benchmarks/results/pipeline_tick_split.json`` (with
``VLLM_LOOPSPEC_MERGED_PLANES=0``, one attention call per loop group:
``pipeline_tick_split_per_group.json``; at a temperature above 0,
``pipeline_tick_split_T<temperature>.json``). "decide" is the deciders'
share of the host bookkeeping (proposing and verifying from the logits:
argmaxes, and under sampling the processed distributions, the draws and
the acceptance tests). One engine, one
warm-up, then one timed trial of 128 tokens per request; the wrappers add a
few perf_counter calls per tick.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe import ROOT, native_and_pipelined  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    import vllm_loopspec.speculative.drafter as drafter_module
    from loopspec_decode import decode_trial
    from vllm_loopspec.engine_internals import model_runner

    given = [int(a) for a in sys.argv[1:4]]
    d1, k, c = given + [1, 16, 1][len(given):]
    temperature = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    batch, native, llm = native_and_pipelined(d1, k, c)
    for engine in (native, llm):
        decode_trial(engine, batch, 16, temperature=temperature)
    native_trial = decode_trial(native, batch, 128, profile=True, temperature=temperature)
    loops = model_runner(native).model.num_loops

    seconds = {"model tick": 0.0, "Attention calls": 0.0, "lm_head": 0.0, "group metadata": 0.0,
               "run_pipelined": 0.0, "decide": 0.0}
    attention_calls = [0]

    def timed(name, fn, count=None):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
                if count is not None:
                    count[0] += 1
        return wrapper

    served = drafter_module._PipelineServedModel
    served.tick = timed("model tick", served.tick)
    served.logits = timed("lm_head", served.logits)
    Attention.forward = timed("Attention calls", Attention.forward, attention_calls)
    run_pipelined = drafter_module.run_pipelined

    def run_timed(schedule, model, decide, attention, *args, **kwargs):
        for method in ("decide", "propose", "refine", "verify"):  # the decider's calls (earlier code: three)
            if hasattr(decide, method):
                setattr(decide, method, timed("decide", getattr(decide, method)))
        return timed("run_pipelined", run_pipelined)(schedule, model, decide, timed("group metadata", attention),
                                                      *args, **kwargs)

    drafter_module.run_pipelined = run_timed
    stats = model_runner(llm).drafter.stats
    ticks_before = stats.pipelined_ticks
    trial = decode_trial(llm, batch, 128, temperature=temperature)
    ticks = stats.pipelined_ticks - ticks_before
    per_tick = {name: value / ticks * 1e3 for name, value in seconds.items()}
    per_tick["host bookkeeping (run_pipelined minus model tick, lm_head and group metadata; decide in it)"] = (
        per_tick["run_pipelined"] - per_tick["model tick"] - per_tick["lm_head"] - per_tick["group metadata"])
    record = {
        "probe": "pipeline_tick_split", "command": "python benchmarks/probes/pipeline_tick_split.py "
                                                  + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "d1": d1, "K": k, "concurrency": c,
        "temperature": temperature,
        "merged_planes": model_runner(llm).drafter.stacked_planes() is not None,
        "tokens_per_s": {"native": native_trial["tokens_per_s"], "pipelined": trial["tokens_per_s"]},
        "native_loop_ms": native_trial["forward_seconds"] / native_trial["steps"] / loops * 1e3,
        "native_step_ms": native_trial["seconds"] / native_trial["steps"] * 1e3,
        "pipelined_steps": trial["steps"], "ticks": ticks, "ms_per_tick": per_tick,
        # what a step costs outside run_pipelined: vLLM's scheduling, input
        # preparation, rejection sampler and output handling of K+1 tokens a row
        "pipelined_step_ms": trial["seconds"] / trial["steps"] * 1e3,
        "outside_run_pipelined_ms_per_step": (trial["seconds"] - seconds["run_pipelined"]) / trial["steps"] * 1e3,
        "attention_calls_per_tick": attention_calls[0] / ticks,
        "us_per_attention_call": seconds["Attention calls"] / max(attention_calls[0], 1) * 1e6,
    }
    name = "pipeline_tick_split" + ("" if record["merged_planes"] else "_per_group")
    name += (f"_T{temperature:g}" if temperature > 0 else "") + ".json"
    out = ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
