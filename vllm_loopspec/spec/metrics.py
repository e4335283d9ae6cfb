"""loopspec's own counters on vLLM's ``/metrics``.

The counters live in the worker process (where rounds run) while ``/metrics``
is served by the API server process. When vLLM builds its config in the front
end, loopspec creates a directory, exports it as ``LOOPSPEC_METRICS_DIR``
(inherited by the engine and worker processes vLLM spawns afterwards) and
registers a Prometheus collector that sums the snapshots workers write there.
A worker thread writes every ``FLUSH_SECONDS``, so ``/metrics`` lags by that.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

ENV_DIR = "LOOPSPEC_METRICS_DIR"
FLUSH_SECONDS = 0.2

_collector_registered = False


def enable_in_frontend() -> None:
    """Create the snapshot directory and register the collector (idempotent)."""
    global _collector_registered
    if _collector_registered:
        return
    # Always a fresh directory: a value inherited from a parent process (a
    # script that itself ran engines) belongs to that process's front end.
    path = tempfile.mkdtemp(prefix="loopspec-metrics-")
    os.environ[ENV_DIR] = path
    atexit.register(shutil.rmtree, path, True)
    from prometheus_client import REGISTRY

    REGISTRY.register(LoopSpecCollector(Path(os.environ[ENV_DIR])))
    _collector_registered = True


class SnapshotWriter:
    """Worker side: a daemon thread writes the latest stats as JSON every
    ``FLUSH_SECONDS`` when they changed, off the decoding path."""

    def __init__(self, snapshot) -> None:
        path = os.environ.get(ENV_DIR)
        # One file per runner (several in-process engines share a pid).
        self.file = Path(path) / f"worker-{os.getpid()}-{id(self):x}.json" if path else None
        self.snapshot = snapshot  # callable returning a JSON-able dict
        self.written = None
        if self.file is not None:
            threading.Thread(target=self._run, name="loopspec-metrics", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(FLUSH_SECONDS)
            self.flush()

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


def read_snapshots(directory: Path) -> dict:
    total = {"rounds": 0, "speculating_rows": 0, "drafted_tokens": 0, "accepted_tokens": 0,
             "rows_per_loop": [], "drafted_per_pos": [], "accepted_per_pos": [], "skipped": {}}
    for file in sorted(directory.glob("worker-*.json")):
        try:
            snap = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        for key in ("rounds", "speculating_rows", "drafted_tokens", "accepted_tokens"):
            total[key] += snap.get(key, 0)
        for key in ("rows_per_loop", "drafted_per_pos", "accepted_per_pos"):
            values = snap.get(key, [])
            total[key] += [0] * max(0, len(values) - len(total[key]))
            for i, n in enumerate(values):
                total[key][i] += n
        for reason, n in snap.get("skipped", {}).items():
            total["skipped"][reason] = total["skipped"].get(reason, 0) + n
    return total


class LoopSpecCollector:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        snap = read_snapshots(self.directory)
        for key, doc in (
            ("rounds", "Engine steps that ran a loopspec round."),
            ("speculating_rows", "Request-rounds that drafted at least one token."),
            ("drafted_tokens", "Tokens drafted by the shallow loops."),
            ("accepted_tokens", "Drafted tokens the deep loops accepted."),
        ):
            yield CounterMetricFamily(f"loopspec:{key}", doc, value=snap[key])
        rows = CounterMetricFamily("loopspec:rows_per_loop", "Rows each loop processed in loopspec steps.",
                                   labels=["loop"])
        for loop, n in enumerate(snap["rows_per_loop"]):
            rows.add_metric([str(loop + 1)], n)
        yield rows
        for key, doc in (("drafted_per_pos", "Rounds that drafted each position."),
                         ("accepted_per_pos", "Rounds whose draft at each position was accepted.")):
            family = CounterMetricFamily(f"loopspec:{key}", doc, labels=["position"])
            for pos, n in enumerate(snap[key]):
                family.add_metric([str(pos + 1)], n)
            yield family
        skipped = CounterMetricFamily("loopspec:skipped_rows",
                                      "Request-steps that decoded one token without drafting, by reason.",
                                      labels=["reason"])
        for reason, n in sorted(snap["skipped"].items()):
            skipped.add_metric([reason], n)
        yield skipped
