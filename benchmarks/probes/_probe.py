"""What the in-process issue-13 probes share: the environment (set before
vLLM is imported), the bundled checkpoint and prompts, one engine shape,
and a timer of each engine step (``execute_model`` to the end of
``sample_tokens``, as the adaptive policy times it)."""

import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = str(ROOT / "checkpoints" / "ouro-stdlib")
ENGINE_ARGS = dict(dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5, enforce_eager=False, seed=0,
                   max_num_seqs=16, max_num_batched_tokens=8192, num_gpu_blocks_override=512)


def load_prompts(name: str) -> list[str]:
    lines = (ROOT / "benchmarks" / "prompts" / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def add_and_prefill(llm, prompts: list[str], new_tokens: int, temperature: float) -> None:
    """Add one request per prompt (seeded when sampled, no early stop) to
    ``llm``'s engine and step it until every request has its first token:
    the decode steps after this are a trial's timed part, as in kv_sweep.py."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    tag = f"t{time.perf_counter_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=new_tokens, temperature=temperature,
                                                           ignore_eos=True,
                                                           seed=1000 + i if temperature > 0 else None))
    produced = set()
    while len(produced) < len(prompts):
        produced.update(out.request_id for out in engine.step())


def cell_from_argv(argv, width: int, temperature: float, reps: int):
    """``[width] [temperature] [reps] [draft_loops] [short|long]`` of the
    probes that replay one sweep cell, with the caller's defaults (d 1,
    short): ``(width, temperature, reps, d, prompts, new_tokens)``, the
    prompts and tokens of the sweep's setting (long: the long prompts,
    192 tokens; short: the mixed ones, 128)."""
    width = int(argv[1]) if len(argv) > 1 else width
    temperature = float(argv[2]) if len(argv) > 2 else temperature
    reps = int(argv[3]) if len(argv) > 3 else reps
    d = int(argv[4]) if len(argv) > 4 else 1
    long = len(argv) > 5 and argv[5] == "long"
    return width, temperature, reps, d, load_prompts("long" if long else "mixed"), 192 if long else 128


def add_sweep_protocol_args(ap) -> None:
    """The arguments of the probes that replay kv_sweep.py's protocol
    (its cells, widths and repeats) with "auto" engines of several d."""
    ap.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--settings", nargs="+", default=["short", "long"])


def native_and_pipelined(d1: int, k: int, c: int):
    """``c`` of the ``mixed`` prompts, a native engine and a pipelined one
    (``d1``, ``K``) of the shared shape: the pipelined probes' setup."""
    from vllm import LLM

    prompts = load_prompts("mixed")
    batch = [prompts[i % len(prompts)] for i in range(c)]
    native = LLM(CHECKPOINT, **ENGINE_ARGS)
    llm = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "num_speculative_tokens": k, "draft_loops": d1,
                                              "schedule": "pipelined"}, **ENGINE_ARGS)
    return batch, native, llm


def time_steps(runner, samples: list) -> None:
    """Append ``(speculative?, scheduled tokens, seconds)`` to ``samples``
    for every step ``runner`` runs from now on."""
    execute, sample = runner.execute_model, runner.sample_tokens
    step = {}

    def timed_execute(scheduler_output, *args, **kwargs):
        step.update(t=time.perf_counter(), spec=bool(scheduler_output.scheduled_spec_decode_tokens),
                    n=scheduler_output.total_num_scheduled_tokens)
        return execute(scheduler_output, *args, **kwargs)

    def timed_sample(*args, **kwargs):
        out = sample(*args, **kwargs)
        samples.append((step["spec"], step["n"], time.perf_counter() - step["t"]))
        return out

    runner.execute_model, runner.sample_tokens = timed_execute, timed_sample


def median_ms(samples, spec: bool, tokens: int | None = None):
    """(median ms, count) of the speculative or plain steps, plain ones of
    ``tokens`` scheduled tokens when given."""
    import numpy as np

    ms = [s * 1e3 for is_spec, n, s in samples if is_spec == spec and (tokens is None or n == tokens)]
    return (round(float(np.median(ms)), 2) if ms else None), len(ms)


def run_lengths(arms) -> str:
    """``plainx12, pipelinedx3, ...``: consecutive steps of one arm counted."""
    out = []
    for arm in arms:
        if out and out[-1][0] == arm:
            out[-1][1] += 1
        else:
            out.append([arm, 1])
    return ", ".join(f"{arm}x{n}" for arm, n in out)
