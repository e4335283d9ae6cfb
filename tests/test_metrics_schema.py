"""loopspec's counters: one schema for the worker stats, the snapshot files
and the Prometheus collector; the snapshot writer stops with its engine."""

from __future__ import annotations

import json

from vllm_loopspec.speculative import metrics
from vllm_loopspec.speculative.metrics import COUNTERS, LoopSpecCollector, LoopSpecStats, SnapshotWriter


def _stats(rounds: int) -> LoopSpecStats:
    s = LoopSpecStats(rounds=rounds, speculating_rows=2 * rounds, drafted_tokens=8)
    s.count_loop_rows(range(0, 2), 5, masked=1)
    s.count_acceptance(3, 2)
    s.skipped["logprobs"] += rounds
    return s


def test_collector_sums_workers_by_the_schema(tmp_path):
    for i, rounds in enumerate((1, 4)):
        (tmp_path / f"worker-{i}.json").write_text(json.dumps(_stats(rounds).as_dict()))
    families = {f.name: f for f in LoopSpecCollector(tmp_path).collect()}
    assert set(families) == ({spec.prometheus_name for spec in COUNTERS}
                             | {spec.replica_name for spec in COUNTERS if spec.kind == "scalar"})
    samples = {(f.name, tuple(s.labels.items())): s.value for f in families.values() for s in f.samples}
    assert samples[("loopspec:rounds", ())] == 5
    assert samples[("loopspec:speculating_rows", ())] == 10
    assert samples[("loopspec:rows_per_loop", (("loop", "1"),))] == 10
    assert samples[("loopspec:rows_per_loop", (("loop", "2"),))] == 10
    assert samples[("loopspec:masked_rows_per_loop", (("loop", "1"),))] == 2
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


def test_collector_reports_each_replica_and_their_sum(tmp_path):
    """Data-parallel engines: every counter summed over replicas, and the
    scalar ones per replica (``engine`` label)."""
    for name, replica, rounds in (("a", 0, 1), ("b", 1, 4), ("c", 1, 2)):
        (tmp_path / f"worker-{name}.json").write_text(
            json.dumps({**_stats(rounds).as_dict(), metrics.REPLICA_KEY: replica}))
    samples = {(f.name, tuple(s.labels.items())): s.value
               for f in LoopSpecCollector(tmp_path).collect() for s in f.samples}
    assert samples[("loopspec:rounds", ())] == 7
    assert samples[("loopspec:replica_rounds", (("engine", "0"),))] == 1
    assert samples[("loopspec:replica_rounds", (("engine", "1"),))] == 6
    assert samples[("loopspec:replica_speculating_rows", (("engine", "1"),))] == 12


def test_snapshot_writer_names_its_replica_or_stays_silent(tmp_path, monkeypatch):
    """A TP rank other than 0 runs the same round as rank 0: it writes nothing."""
    monkeypatch.setenv(metrics.ENV_DIR, str(tmp_path))
    SnapshotWriter(_stats(3).as_dict, replica=1).stop()
    silent = SnapshotWriter(_stats(5).as_dict, replica=1, enabled=False)
    silent.stop()
    assert silent.thread is None
    (file,) = tmp_path.glob("worker-*.json")
    snap = json.loads(file.read_text())
    assert (snap["rounds"], snap[metrics.REPLICA_KEY]) == (3, 1)
