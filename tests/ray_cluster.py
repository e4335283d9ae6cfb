"""A throwaway local Ray cluster for tests and benchmarks: a child process
starts it with ``ray.init`` (never ``ray stop``, which would stop every Ray
cluster of this user on the machine) and shuts it down when told."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, ray
ctx = ray.init(num_cpus=int(sys.argv[1]), resources=json.loads(sys.argv[2]), include_dashboard=False,
               _temp_dir=sys.argv[3], log_to_driver=False)
print(ctx.address_info["gcs_address"], flush=True)
sys.stdin.read()  # until the parent closes stdin
ray.shutdown()
"""


class LocalRayCluster:
    """``with LocalRayCluster(resources) as env:``, ``env`` the variables a
    process needs to join it (``RAY_ADDRESS`` and Ray's auth token: Ray
    2.60 clusters authenticate every client)."""

    def __init__(self, resources: dict[str, float], num_cpus: int = 2) -> None:
        import json

        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.args = [sys.executable, "-c", _CHILD, str(num_cpus), json.dumps(resources), self.temp_dir]
        self.proc: subprocess.Popen | None = None
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    "RAY_USAGE_STATS_ENABLED": "0",
                    # Ray's memory monitor kills workers once the node is 95% full,
                    # which a machine shared with other engines reaches; leave
                    # memory to the kernel, as the mp executor does.
                    "RAY_memory_monitor_refresh_ms": "0"}

    def __enter__(self) -> dict[str, str]:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **self.env}, start_new_session=True)
        address = self.proc.stdout.readline().strip()
        if not address:
            self.proc.kill()
            raise RuntimeError("local Ray cluster did not start")
        return {**self.env, "RAY_ADDRESS": address}

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
