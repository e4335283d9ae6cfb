"""What a benchmark's JSON says about the machine it ran on."""

import platform


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform``
    knows (``x86_64``): the project's host has changed under it between
    sessions, and results from hosts of different speeds must be told apart."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
