"""loopspec's counters: one schema for the worker stats, the snapshot files
and the Prometheus collector; the snapshot writer stops with its engine."""

from __future__ import annotations

import json

from vllm_loopspec.speculative import metrics
from vllm_loopspec.speculative.metrics import COUNTERS, LoopSpecCollector, LoopSpecStats, SnapshotWriter


def _stats(rounds: int) -> LoopSpecStats:
    s = LoopSpecStats(rounds=rounds, speculating_rows=2 * rounds, drafted_tokens=8)
    s.count_loop_rows(range(0, 2), 5)
    s.count_acceptance(3, 2)
    s.skipped["logprobs"] += rounds
    return s


def test_collector_sums_workers_by_the_schema(tmp_path):
    for i, rounds in enumerate((1, 4)):
        (tmp_path / f"worker-{i}.json").write_text(json.dumps(_stats(rounds).as_dict()))
    families = {f.name: f for f in LoopSpecCollector(tmp_path).collect()}
    assert set(families) == {spec.prometheus_name for spec in COUNTERS}
    samples = {(f.name, tuple(s.labels.items())): s.value for f in families.values() for s in f.samples}
    assert samples[("loopspec:rounds", ())] == 5
    assert samples[("loopspec:speculating_rows", ())] == 10
    assert samples[("loopspec:rows_per_loop", (("loop", "1"),))] == 10
    assert samples[("loopspec:rows_per_loop", (("loop", "2"),))] == 10
    assert samples[("loopspec:accepted_per_pos", (("position", "2"),))] == 2
    assert samples[("loopspec:accepted_per_pos", (("position", "3"),))] == 0
    assert samples[("loopspec:skipped_rows", (("reason", "logprobs"),))] == 5


def test_snapshot_writer_flushes_and_stops(tmp_path, monkeypatch):
    monkeypatch.setenv(metrics.ENV_DIR, str(tmp_path))
    stats = _stats(1)
    writer = SnapshotWriter(stats.as_dict)
    stats.rounds = 7
    writer.stop()
    assert not writer.thread.is_alive()
    (file,) = tmp_path.glob("worker-*.json")
    assert json.loads(file.read_text())["rounds"] == 7  # the last figures are written on stop
