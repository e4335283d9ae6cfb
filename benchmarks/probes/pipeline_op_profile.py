"""Where a pipelined step's time goes, by operator (issue 12): PyTorch's
profiler over one decode trial of a pipelined engine beside the same trial
of a native one, self CPU time per operator divided by the pipelined ticks
(or, for native, by its steps). At width 8 it shows a tick to be model
compute: oneDNN matmuls, the attention kernel, and the compiled graph's own
(fused elementwise) kernels; host bookkeeping is a few percent.

    .venv/bin/python benchmarks/probes/pipeline_op_profile.py [d1] [K] [concurrency]

Writes ``benchmarks/results/pipeline_op_profile.json``. The profiler adds
a few microseconds per operator call, so read shares, not absolute times.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe import ROOT, native_and_pipelined  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))

TOP = 20


def profiled_trial(llm, batch, new_tokens: int):
    from torch.profiler import ProfilerActivity, profile

    from loopspec_decode import decode_trial

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trial = decode_trial(llm, batch, new_tokens)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    return trial, total, ops


def main() -> None:
    from loopspec_decode import decode_trial
    from vllm_loopspec.engine_internals import model_runner

    given = [int(a) for a in sys.argv[1:4]]
    d1, k, c = given + [2, 32, 8][len(given):]
    batch, native, llm = native_and_pipelined(d1, k, c)
    for engine in (native, llm):
        decode_trial(engine, batch, 64)
    record = {"probe": "pipeline_op_profile", "command": "python benchmarks/probes/pipeline_op_profile.py "
                                                         + " ".join(sys.argv[1:]),
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "d1": d1, "K": k, "concurrency": c}
    stats = model_runner(llm).drafter.stats
    for name, engine in (("native", native), ("pipelined", llm)):
        ticks_before = stats.pipelined_ticks
        trial, total, ops = profiled_trial(engine, batch, 128)
        per = stats.pipelined_ticks - ticks_before if name == "pipelined" else trial["steps"]
        record[name] = {
            "tokens_per_s": trial["tokens_per_s"], "steps": trial["steps"],
            "per": "tick" if name == "pipelined" else "step", "count": per,
            "self_cpu_ms_per": total / per / 1e3,
            "top_ops": [{"op": e.key, "calls_per": e.count / per, "self_ms_per": e.self_cpu_time_total / per / 1e3,
                         "share": e.self_cpu_time_total / total} for e in ops[:TOP]],
        }
    out = ROOT / "benchmarks" / "results" / "pipeline_op_profile.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
