"""loopspec beyond one device (issue 16).

* Tensor parallelism: every TP rank runs the same round on its shard (drafts
  from logits all-gathered on every rank; sampled drafts from the same
  generator state, vLLM's own invariant for its sampler). The debug drafter
  the suite runs checks after each round that every rank drafted the same
  tokens, so a sampled batch that passes has written the same drafts into
  every KV shard.
* Data parallelism: each replica speculates on its own requests; /metrics
  carries loopspec's counters per replica and summed.
* Pipeline parallelism is refused, with what to use instead.
* Ray: the loopspec worker runs in Ray actors (CPU: patch 12's resource
  mapping) and gives the same tokens as the mp executor.

The servers run on the tiny checkpoint with threads bound one core per
worker (``VLLM_CPU_OMP_THREADS_BIND=0|1``)."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm import SamplingParams

from prompts import MEDIUM, SHORT
from vllm_loopspec.patches import PIPELINE_PARALLEL_REFUSAL, RAY_CPU_RESOURCE
from vllm_loopspec.server_process import VllmServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from parallel_decode import replica_counters, server_args  # noqa: E402

PROMPTS = SHORT + MEDIUM  # 10 prompts
MAX_TOKENS = 24
SPEC = {"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2}


# -- configuration (no engine) ------------------------------------------------------

def _config(ckpt, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(ckpt), dtype="float32", max_model_len=256, speculative_config=SPEC,
                      **kw).create_engine_config()


def test_pipeline_parallel_is_refused_with_what_to_use_instead(tiny_checkpoint):
    """A tick needs every layer: under PP a round would cross the pipeline
    once per draft tick with the other stages idle (benchmarks/RESULTS.md,
    "Beyond one device"), so loopspec refuses PP before any process starts."""
    from vllm_loopspec.speculative.options import LoopSpecConfigError

    with pytest.raises(LoopSpecConfigError) as err:
        _config(tiny_checkpoint, pipeline_parallel_size=2)
    assert str(err.value) == PIPELINE_PARALLEL_REFUSAL
    for advice in ("--tensor-parallel-size", "--data-parallel-size", "without loopspec either"):
        assert advice in str(err.value)


def test_tensor_and_data_parallel_configs_select_the_loopspec_worker(tiny_checkpoint):
    from test_loopspec_config import EXPECTED_WORKER

    for kw in ({"tensor_parallel_size": 2}, {"data_parallel_size": 2}):
        cfg = _config(tiny_checkpoint, **kw)
        assert cfg.speculative_config.method == "custom_class"
        assert cfg.parallel_config.worker_cls == EXPECTED_WORKER


def test_cpu_ray_engines_get_the_worker_setup_hook(tiny_checkpoint):
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the Ray resource mapping is for CPU engines; GPUs use Ray's GPU resource")
    assert current_platform.ray_device_key == RAY_CPU_RESOURCE
    cfg = _config(tiny_checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert cfg.parallel_config.ray_runtime_env["worker_process_setup_hook"] == \
        "vllm_loopspec.patches.setup_ray_cpu_worker_process"
    mp = _config(tiny_checkpoint, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert not (mp.parallel_config.ray_runtime_env or {}).get("worker_process_setup_hook")


@pytest.mark.parametrize("name, tp, dp, key, backend", [
    ("ray-2node-dp.yaml", 4, 2, "data_parallel_backend", "ray"),
    ("ray-node-tp.yaml", 4, 1, "distributed_executor_backend", "ray"),
])
def test_shipped_ray_configs_parse_as_documented(name, tp, dp, key, backend):
    """``vllm serve CKPT --config configs/<name>``: the shipped two-node
    examples turn loopspec on with TP inside a node and Ray across nodes."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_loopspec.speculative.options import is_loopspec

    config = Path(__file__).resolve().parents[1] / "configs" / name
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "ckpt", "--config", str(config)])
    assert (args.tensor_parallel_size, args.data_parallel_size, getattr(args, key)) == (tp, dp, backend)
    assert args.pipeline_parallel_size == 1
    assert is_loopspec(args.speculative_config)


# -- engines ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def native_reference(native_llm):
    """TP=1 native greedy tokens of every prompt."""
    outs = native_llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                               use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _serve(checkpoint, arm: str, log: Path, extra_env: dict | None = None) -> VllmServer:
    args, env = server_args(arm, SPEC)
    return VllmServer(checkpoint, *args, log_path=log, env={**env, **(extra_env or {})})


def _complete_all(srv: VllmServer, prompts, temperature: float = 0.0, seeds=None,
                  replicas: int | None = None) -> list[list[int]]:
    """All prompts at once (one batch of concurrent requests); with
    ``replicas``, request ``i`` goes to data-parallel rank ``i % replicas``
    (vLLM's ``X-data-parallel-rank`` header)."""
    model = srv.model_name()

    def one(i):
        body = {"model": model, "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": temperature,
                "ignore_eos": True, "return_token_ids": True}
        if seeds is not None and seeds[i] is not None:
            body["seed"] = seeds[i]
        headers = {"X-data-parallel-rank": str(i % replicas)} if replicas else None
        return srv.post("/v1/completions", body, headers=headers)["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def _replicas_after_flush(srv: VllmServer) -> dict:
    time.sleep(1.0)  # worker snapshots reach /metrics through a 0.2 s flush thread
    return replica_counters(srv.metrics())


@pytest.fixture(scope="module")
def tp2_greedy(tiny_checkpoint, tmp_path_factory):
    """TP=2 loopspec (mp executor): greedy tokens of every prompt, then a
    sampled batch, and the counters after each."""
    log = tmp_path_factory.mktemp("tp2") / "serve.log"
    with _serve(tiny_checkpoint, "tp2-loopspec", log, {"VLLM_LOGGING_LEVEL": "INFO"}) as srv:
        greedy = _complete_all(srv, PROMPTS)
        after_greedy = _replicas_after_flush(srv)
        sampled = _complete_all(srv, PROMPTS, temperature=0.8, seeds=[i if i % 2 else None for i in range(10)])
        after_sampled = _replicas_after_flush(srv)
    return {"greedy": greedy, "sampled": sampled, "after_greedy": after_greedy, "after_sampled": after_sampled,
            "log": log.read_text(errors="replace")}


@pytest.mark.slow
def test_tp2_greedy_loopspec_equals_tp1_native(tp2_greedy, native_reference):
    assert tp2_greedy["greedy"] == native_reference
    counters = tp2_greedy["after_greedy"]
    assert list(counters) == ["0"]  # one replica; TP rank 1 does not count the round again
    assert counters["0"]["rounds"] > 0 and counters["0"]["accepted_tokens"] > 0


@pytest.mark.slow
def test_tp2_sampled_drafts_are_the_same_on_every_rank(tp2_greedy):
    """The debug drafter all-gathers each round's drafts and stops the
    engine if the ranks differ: a sampled batch (seeded and unseeded
    requests) that completes drafted alike on both ranks."""
    assert "debug.DebugLoopSpecDrafter" in tp2_greedy["log"]  # the drafter with the check
    assert all(len(t) == MAX_TOKENS for t in tp2_greedy["sampled"])
    before, after = tp2_greedy["after_greedy"]["0"], tp2_greedy["after_sampled"]["0"]
    assert after["rounds"] > before["rounds"]


@pytest.mark.slow
def test_dp2_greedy_loopspec_equals_native_with_both_replicas_speculating(tiny_checkpoint, tmp_path,
                                                                            native_reference):
    """Two replicas behind one server (vLLM's default of one API server per
    replica: loopspec's counters must reach /metrics from either). vLLM's
    balancer may send a small burst to one replica, so the requests name
    their replica, half each."""
    with _serve(tiny_checkpoint, "dp2-loopspec", tmp_path / "serve.log") as srv:
        greedy = _complete_all(srv, PROMPTS, replicas=2)
        counters = _replicas_after_flush(srv)
        text = srv.metrics()
    assert greedy == native_reference
    assert sorted(counters) == ["0", "1"]
    assert all(c["rounds"] > 0 and c["drafted_tokens"] > 0 for c in counters.values()), counters
    total = sum(c["drafted_tokens"] for c in counters.values())
    assert f"loopspec:drafted_tokens_total {float(total)}" in text


@pytest.mark.slow
def test_ray_executor_tp2_equals_mp(tiny_checkpoint, tmp_path, tp2_greedy, native_reference):
    """TP=2 with ``--distributed-executor-backend ray`` on a local Ray
    cluster: the loopspec worker runs in Ray actors, token for token as with
    the mp executor."""
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]'; make install does)")
    from ray_cluster import LocalRayCluster

    with LocalRayCluster({RAY_CPU_RESOURCE: 2}) as ray_env:
        with _serve(tiny_checkpoint, "tp2ray-loopspec", tmp_path / "serve.log", ray_env) as srv:
            greedy = _complete_all(srv, PROMPTS)
            counters = _replicas_after_flush(srv)
    assert greedy == tp2_greedy["greedy"] == native_reference
    assert counters["0"]["rounds"] > 0
