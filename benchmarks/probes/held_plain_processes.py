"""Issue 13 diagnostic: is a held plain step's excess over native's (2-6%
in one process, thirty-sixth and thirty-seventh sessions) the engine's
kind, or two engines sharing a process?

Three engines, native, a second native (the noise floor) and an auto d2
engine whose chooser always answers plain with a hold, run the burst's
shape (1 greedy + 16 sampled requests at T=0.8, 96 tokens each), in turn
(order rotated per repeat), either all in this process (``inproc``) or each
in a process of its own (``procs``: only one runs at a time; the others
wait on a pipe). Per trial: the median seconds of an ``engine.step()`` in
steady decode (the prefill step and the three after it left out).
Reported: per engine, the median over repeats of its step time over the
first engine's in the same repeat (paired).

    [HELD_PLAIN_SHAPE=sampled16] python benchmarks/probes/held_plain_processes.py MODE REPEATS [OUT [KIND,KIND,...]]

``KIND``: ``native`` or ``held``, one engine each, built in that order
(default ``native,native,held``). The thirty-eighth session's first runs
(``held_plain_processes_thirty_eighth_{inproc,procs}.json``) named the
engines ``native``, ``native2``, ``held``.
"""
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _probe  # noqa: E402,F401  (environment before vLLM)
from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts  # noqa: E402

KINDS = {"native": None, "held": {"method": "loopspec", "draft_loops": 2, "schedule": "auto"}}
ENGINES = ["native", "native", "held"]  # the default line-up: a second native is the noise floor
# The batch: the burst's (one greedy request and 16 sampled) unless
# HELD_PLAIN_SHAPE=sampled16 (the sweep's short T=0.8 c16: 16 sampled).
GREEDY, SAMPLED = (0, 16) if os.environ.get("HELD_PLAIN_SHAPE") == "sampled16" else (1, 16)
ARGS = {**ENGINE_ARGS, "max_num_seqs": 32}


def build(name: str):
    from vllm import LLM
    from vllm_loopspec.engine_internals import model_runner

    spec = KINDS[name.rstrip("0123456789")]
    llm = LLM(CHECKPOINT, **ARGS) if spec is None else LLM(CHECKPOINT, speculative_config=spec, **ARGS)
    if spec is not None:
        from chooser_ab import choose_plain

        chooser = model_runner(llm).drafter.chooser
        chooser.choose = types.MethodType(choose_plain, chooser)
    return llm


def trial(llm, tag: str) -> float:
    from vllm import SamplingParams

    prompts = load_prompts("mixed")
    engine = llm.llm_engine
    if GREEDY:
        engine.add_request(f"{tag}-g", prompts[0], SamplingParams(max_tokens=96, temperature=0, ignore_eos=True))
    for i in range(SAMPLED):
        engine.add_request(f"{tag}-{i}", prompts[(1 + i) % len(prompts)],
                           SamplingParams(max_tokens=96, temperature=0.8, seed=100 + i, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[4:-2])


def worker(kind: str, conn) -> None:
    llm = build(kind)
    trial(llm, "warm0")
    trial(llm, "warm1")
    conn.send("ready")
    while True:
        tag = conn.recv()
        if tag is None:
            return
        conn.send(trial(llm, tag))


def main() -> None:
    mode, repeats = sys.argv[1], int(sys.argv[2])
    kinds = sys.argv[4].split(",") if len(sys.argv) > 4 else ENGINES
    names = [f"{kind}{i}" for i, kind in enumerate(kinds)]
    if mode == "procs":
        ctx = mp.get_context("spawn")
        conns = {}
        for kind in names:  # built one at a time: builds compete for the two cores
            parent, child = ctx.Pipe()
            ctx.Process(target=worker, args=(kind, child), daemon=True).start()
            assert parent.recv() == "ready"
            conns[kind] = parent

        def run(kind, tag):
            conns[kind].send(tag)
            return conns[kind].recv()
    else:
        engines = {kind: build(kind) for kind in names}
        for kind in names:
            trial(engines[kind], "warm0")
            trial(engines[kind], "warm1")

        def run(kind, tag):
            return trial(engines[kind], tag)

    steps = {kind: [] for kind in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for kind in order:
            time.sleep(0.2)  # an idle process's OpenMP threads stop spinning
            steps[kind].append(run(kind, f"{rep}-{kind}"))
    paired = {kind: round(statistics.median(s / n for s, n in zip(steps[kind], steps[names[0]])), 4)
              for kind in names}
    medians = {kind: round(1e6 * statistics.median(v), 1) for kind, v in steps.items()}
    print("mode", mode, "median step us", medians, "paired over native", paired)
    if mode == "procs":
        for conn in conns.values():
            conn.send(None)
    if len(sys.argv) > 3:
        out = ROOT / sys.argv[3]
        record = json.loads(out.read_text()) if out.exists() else {}
        record[mode] = {"command": "python benchmarks/probes/held_plain_processes.py " + " ".join(sys.argv[1:]),
                        "batch": {"greedy": GREEDY, "sampled": SAMPLED},
                        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "median_step_us": medians,
                        "paired_step_over_native": paired,
                        "step_seconds": {k: [round(x, 6) for x in v] for k, v in steps.items()}}
        out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
