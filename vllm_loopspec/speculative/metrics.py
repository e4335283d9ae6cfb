"""loopspec's own counters, and their export to vLLM's ``/metrics``.

One schema (:data:`COUNTERS`) names every counter once: the worker-side
:class:`LoopSpecStats`, the snapshot files and the Prometheus collector all
follow it.

The counters live in the worker process (where rounds run) while
``/metrics`` is served by the API server process. When vLLM builds its
config in the front end, loopspec creates a directory, exports it as
``LOOPSPEC_METRICS_DIR`` (inherited by the engine and worker processes vLLM
spawns afterwards) and registers a Prometheus collector that sums the
snapshots workers write there. A worker thread writes every
``FLUSH_SECONDS``, so ``/metrics`` lags by that; it stops with its engine.

Parallel engines: the ranks of one tensor-parallel group run the same round,
so only TP rank 0 writes (the others would count it again). Each snapshot
names its data-parallel replica (``replica``): ``/metrics`` carries every
counter summed over replicas (``loopspec:<name>``) and, for the scalar
counters, one sample per replica (``loopspec:replica_<name>{engine="N"}``,
``engine`` as in vLLM's own per-replica metrics).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ENV_DIR = "LOOPSPEC_METRICS_DIR"
FLUSH_SECONDS = 0.2


@dataclass(frozen=True)
class CounterSpec:
    name: str  # field of LoopSpecStats; Prometheus name loopspec:<metric or name>
    doc: str
    kind: str = "scalar"  # "scalar" | "vector" (list indexed from 1) | "labelled" (dict)
    label: str | None = None
    metric: str | None = None

    @property
    def prometheus_name(self) -> str:
        return f"loopspec:{self.metric or self.name}"

    @property
    def replica_name(self) -> str:
        """Per-replica family of a scalar counter."""
        return f"loopspec:replica_{self.metric or self.name}"


COUNTERS = (
    CounterSpec("rounds", "Engine steps that ran a loopspec round."),
    CounterSpec("speculating_rows", "Request-rounds that drafted at least one token."),
    CounterSpec("drafted_tokens", "Tokens drafted by the shallow loops."),
    CounterSpec("accepted_tokens", "Drafted tokens the deep loops accepted."),
    CounterSpec("rows_per_loop", "Rows of scheduled tokens each loop processed in loopspec steps.", "vector",
                "loop"),
    CounterSpec("masked_rows_per_loop", "Masked rows each loop processed in loopspec steps (draft ticks of rows "
                "with fewer drafts, padding): computed, no KV written.", "vector", "loop"),
    CounterSpec("drafted_per_pos", "Rounds that drafted each position.", "vector", "position"),
    CounterSpec("accepted_per_pos", "Rounds whose draft at each position was accepted.", "vector", "position"),
    CounterSpec("pipelined_steps", "Engine steps run with the pipelined schedule (every step with \"schedule\": "
                "\"pipelined\"; those the measured rates chose with \"auto\")."),
    CounterSpec("pipelined_ticks", "Ticks of pipelined steps (every in-flight token advances draft_loops loops)."),
    CounterSpec("pipelined_restarts", "Pipelined successors replaced at verification (restarted at loop 0)."),
    CounterSpec("pipelined_pruned", "In-flight pipelined tokens discarded with a replaced ancestor."),
    CounterSpec("pipelined_second_proposals", "Pipelined proposals replaced by a second proposal at "
                "second_proposal_loop."),
    CounterSpec("pipelined_second_kept", "Pipelined slots whose committed draft is a second proposal."),
    CounterSpec("skipped", "Request-steps that decoded one token without drafting, by reason.", "labelled",
                "reason", metric="skipped_rows"),
)


@dataclass
class LoopSpecStats:
    """Per-engine counters (worker side)."""

    rounds: int = 0
    speculating_rows: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rows_per_loop: list[int] = field(default_factory=list)  # index = loop
    masked_rows_per_loop: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)  # index = draft position j-1
    accepted_per_pos: list[int] = field(default_factory=list)
    pipelined_steps: int = 0
    pipelined_ticks: int = 0
    pipelined_restarts: int = 0
    pipelined_pruned: int = 0
    pipelined_second_proposals: int = 0
    pipelined_second_kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> request-steps

    def count_loop_rows(self, loops: range, rows: int, masked: int = 0) -> None:
        _grow(self.rows_per_loop, loops.stop)
        _grow(self.masked_rows_per_loop, loops.stop)
        for loop in loops:
            self.rows_per_loop[loop] += rows
            self.masked_rows_per_loop[loop] += masked

    def count_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        for per_pos, n in ((self.drafted_per_pos, num_drafts), (self.accepted_per_pos, num_accepted)):
            _grow(per_pos, num_drafts)
            for j in range(n):
                per_pos[j] += 1
        self.accepted_tokens += num_accepted

    def count_positions(self, num_drafts, accepted_per_pos) -> None:
        """Drafts per position of rows drafting ``num_drafts`` each, and
        ``accepted_per_pos`` accepted at each position (not a prefix: a
        pipelined step keeps or replaces each position on its own)."""
        width = int(max(num_drafts, default=0))
        _grow(self.drafted_per_pos, width)
        _grow(self.accepted_per_pos, width)
        for k in num_drafts:
            for j in range(int(k)):
                self.drafted_per_pos[j] += 1
        for j, a in enumerate(accepted_per_pos):
            self.accepted_per_pos[j] += int(a)
        self.accepted_tokens += int(sum(accepted_per_pos))

    def as_dict(self) -> dict:
        out = {}
        for spec in COUNTERS:
            value = getattr(self, spec.name)
            out[spec.name] = dict(value) if spec.kind == "labelled" else (
                list(value) if spec.kind == "vector" else value)
        return out


def _grow(values: list[int], length: int) -> None:
    values.extend([0] * max(0, length - len(values)))


def add_snapshots(total: dict, snap: dict) -> dict:
    """``total += snap``, counter by counter."""
    for spec in COUNTERS:
        value = snap.get(spec.name)
        if value is None:
            continue
        if spec.kind == "scalar":
            total[spec.name] = total.get(spec.name, 0) + value
        elif spec.kind == "vector":
            acc = total.setdefault(spec.name, [])
            _grow(acc, len(value))
            for i, n in enumerate(value):
                acc[i] += n
        else:
            acc = total.setdefault(spec.name, {})
            for key, n in value.items():
                acc[key] = acc.get(key, 0) + n
    return total


def empty_snapshot() -> dict:
    return LoopSpecStats().as_dict()


# -- front end ----------------------------------------------------------------

_collector_registered = False


ENV_OWNER = "LOOPSPEC_METRICS_OWNER"  # pid of the front end that created ENV_DIR


def _inherited_directory() -> str | None:
    """The snapshot directory of the front end that started this process with
    ``multiprocessing`` (vLLM's API server processes of ``--api-server-count
    > 1``, the default with ``--data-parallel-size``), whose engines write
    there; None for any other process."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    path, owner = os.environ.get(ENV_DIR), os.environ.get(ENV_OWNER)
    if parent is None or not path or owner != str(parent.pid) or not Path(path).is_dir():
        return None
    return path


def enable_in_frontend() -> None:
    """Create the snapshot directory and register the collector (idempotent)."""
    global _collector_registered
    if _collector_registered:
        return
    path = _inherited_directory()
    if path is None:
        # A fresh directory: a value inherited from any other parent (a
        # script that itself ran engines) belongs to that process's front end.
        path = tempfile.mkdtemp(prefix="loopspec-metrics-")
        os.environ[ENV_DIR] = path
        os.environ[ENV_OWNER] = str(os.getpid())
        atexit.register(shutil.rmtree, path, True)
    from prometheus_client import REGISTRY

    from vllm_loopspec.patches import expose_in_multiprocess_registry

    collector = LoopSpecCollector(Path(path))
    REGISTRY.register(collector)
    expose_in_multiprocess_registry(collector)
    _collector_registered = True


REPLICA_KEY = "replica"  # data-parallel rank of the engine that wrote a snapshot


def _snapshot_files(directory: Path):
    for file in sorted(directory.glob("worker-*.json")):
        try:
            yield json.loads(file.read_text())
        except (OSError, ValueError):
            continue


def read_snapshots(directory: Path) -> dict:
    total = empty_snapshot()
    for snap in _snapshot_files(directory):
        add_snapshots(total, snap)
    return total


def read_snapshots_by_replica(directory: Path) -> dict[int, dict]:
    """Counters summed per data-parallel replica (one entry per replica
    that has written)."""
    out: dict[int, dict] = {}
    for snap in _snapshot_files(directory):
        add_snapshots(out.setdefault(int(snap.get(REPLICA_KEY, 0)), empty_snapshot()), snap)
    return out


class LoopSpecCollector:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        replicas = read_snapshots_by_replica(self.directory)
        snap = empty_snapshot()
        for replica_snap in replicas.values():
            add_snapshots(snap, replica_snap)
        for spec in COUNTERS:
            value = snap[spec.name]
            if spec.kind == "scalar":
                yield CounterMetricFamily(spec.prometheus_name, spec.doc, value=value)
                family = CounterMetricFamily(spec.replica_name, spec.doc + " Per data-parallel replica.",
                                             labels=["engine"])
                for replica, replica_snap in sorted(replicas.items()):
                    family.add_metric([str(replica)], replica_snap[spec.name])
                yield family
                continue
            family = CounterMetricFamily(spec.prometheus_name, spec.doc, labels=[spec.label])
            items = enumerate(value, start=1) if spec.kind == "vector" else sorted(value.items())
            for key, n in items:
                family.add_metric([str(key)], n)
            yield family


# -- worker -------------------------------------------------------------------

class SnapshotWriter:
    """Worker side: a daemon thread writes the latest stats as JSON every
    ``FLUSH_SECONDS`` when they changed, off the decoding path, until
    :meth:`stop` (the runner's shutdown)."""

    def __init__(self, snapshot, replica: int = 0, enabled: bool = True) -> None:
        path = os.environ.get(ENV_DIR) if enabled else None
        # One file per runner (several in-process engines share a pid).
        self.file = Path(path) / f"worker-{os.getpid()}-{id(self):x}.json" if path else None
        self.replica = replica
        self._stats = snapshot  # callable returning a JSON-able dict
        self.written = None
        self._stopped = threading.Event()
        self.thread = None
        if self.file is not None:
            self.thread = threading.Thread(target=self._run, name="loopspec-metrics", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(FLUSH_SECONDS):
            self.flush()

    def stop(self) -> None:
        """Write the last figures and end the thread."""
        self._stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        self.flush()

    def snapshot(self) -> dict:
        return {**self._stats(), REPLICA_KEY: self.replica}

    def flush(self) -> None:
        if self.file is None:
            return
        try:
            snap = self.snapshot()
        except RuntimeError:  # stats changed while being copied; next tick
            return
        if snap == self.written:
            return
        tmp = self.file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(snap))
            os.replace(tmp, self.file)
        except OSError:  # directory removed at shutdown
            return
        self.written = snap
