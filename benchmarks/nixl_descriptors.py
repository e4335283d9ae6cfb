"""NIXL READ cost vs descriptor count and size, two agents in two processes.

    PYTHONPATH=. .venv/bin/python benchmarks/nixl_descriptors.py

Answers issue 14's question (would fewer, larger descriptors, e.g. one per block
from a cross-layer contiguous KV layout instead of vLLM's one per KV layer per
block run, make the P/D KV pull cheaper?) without vLLM: a "prefill" process
registers host memory with its NIXL agent (UCX over loopback TCP, as the P/D
launcher configures it) and a "decode" process pulls it with READ, the way
vLLM's pull-mode ``NixlConnector`` does: descriptor lists prepared once
(``prep_xfer_dlist``), then per pull ``make_prepped_xfer("READ", ...)``,
``transfer`` and polling ``check_xfer_state`` until DONE. That span is timed.

A pull of B MiB is split into D equal descriptors. By default they are laid out
like vLLM's per-layer KV tensors: separate, non-adjacent ranges (a gap of one
descriptor between neighbours on both sides), so NIXL cannot merge them
(``make_prepped_xfer`` merges descriptors that are adjacent on both sides;
the telemetry's ``descCount`` is the count after merging and is recorded).
``pull_shapes`` in the JSON gives the bytes and descriptor counts of the pulls
the P/D deployment makes (``pd_transfer.json``) for comparison.
The adjacent layout, where NIXL merges all D into one, is run too (skip it
with ``--no-contiguous``). Memory is registered either as one region per side
(vLLM 0.32 registers its one KV allocation so) or as D regions per side (one
per descriptor, as with separately allocated per-layer tensors).

Writes ``benchmarks/results/pd_descriptors.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host import cpu_name  # noqa: E402

MIB = 2**20
MIN_DESC_BYTES = 4096


def ucx_env() -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "tcp,self")
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # as vllm.distributed.nixl_utils sets it


def make_agent(name: str, num_threads: int):
    from nixl._api import nixl_agent, nixl_agent_config
    # vLLM's NixlConnector: nixl_agent_config(num_threads=<extra_config num_threads, 4>, capture_telemetry=True)
    return nixl_agent(name, nixl_agent_config(num_threads=num_threads, capture_telemetry=True))


def layout(base: int, total: int, ndesc: int, gapped: bool) -> list[tuple[int, int]]:
    """(address, length) of each descriptor: ndesc equal pieces of total bytes,
    adjacent, or each followed by a gap of its own length."""
    size = total // ndesc
    step = 2 * size if gapped else size
    return [(base + i * step, size) for i in range(ndesc)]


def descriptor_counts(layers: int, loops: int, blocks: int, block_runs: int = 1) -> dict:
    """Descriptors one vLLM pull of `blocks` KV blocks posts for an Ouro model of
    `layers` x `loops` KV layers (one NIXL region per KV layer on the CPU
    backend, K and V packed in one page), before and after NIXL merges
    descriptors adjacent on both sides (blocks in `block_runs` runs that are
    contiguous on both sides), and with a cross-layer block-major layout whose
    whole row (all KV layers of a block) is one descriptor."""
    regions = layers * loops
    assert 1 <= block_runs <= blocks
    return {"posted": regions * blocks,          # _compute_desc_ids: one id per region per block
            "after_merge": regions * block_runs,  # NIXL merges a region's adjacent blocks
            "cross_layer": block_runs}            # one row per block, adjacent rows merge


# The shapes issue 14 asks about: fp32 KV, 128-token blocks (the P/D launcher's).
SHAPES = {"bundled ouro-stdlib (2 layers x 4 loops, 2 KV heads x 64)": (2, 4, 2 * 64),
          "Ouro-1.4B width (24 layers x 4 loops, 16 KV heads x 128)": (24, 4, 16 * 128)}


def pull_shapes(prompt_lens=(16, 128, 512, 1024), block_size: int = 128, dtype_bytes: int = 4) -> list[dict]:
    """Bytes and descriptors of one pull for each shape and prompt length
    (whole blocks move; blocks assumed contiguous on both sides, one run)."""
    out = []
    for label, (layers, loops, kv_width) in SHAPES.items():
        page = block_size * 2 * kv_width * dtype_bytes  # one KV layer's block: K and V
        for tokens in prompt_lens:
            blocks = -(-tokens // block_size)
            counts = descriptor_counts(layers, loops, blocks)
            out.append({"shape": label, "prompt_tokens": tokens, "blocks": blocks,
                        "mib": layers * loops * blocks * page / MIB,
                        "desc_kib_after_merge": blocks * page / 1024, **counts})
    return out


class Side:
    """One agent's memory for one (B, D, layout, registration) case."""

    def __init__(self, agent, total: int, fill: int | None):
        import numpy as np
        self.np = np
        self.agent = agent
        self.buf = np.full(2 * total, fill if fill is not None else 0, dtype=np.uint8)  # touched: no first-use faults
        self.base = self.buf.ctypes.data
        self.total = total
        self.reg = None

    def register(self, ndesc: int, many: bool, gapped: bool) -> float:
        t0 = time.perf_counter()
        if many:
            regions = [(a, n, 0, "") for a, n in layout(self.base, self.total, ndesc, gapped)]
        else:
            regions = [(self.base, 2 * self.total, 0, "")]
        self.reg = self.agent.register_memory(self.agent.get_reg_descs(regions, "DRAM"))
        return time.perf_counter() - t0

    def deregister(self) -> None:
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None

    def descs(self, ndesc: int, gapped: bool):
        return self.np.array([(a, n, 0) for a, n in layout(self.base, self.total, ndesc, gapped)], dtype=self.np.uint64)


# -- prefill side (target): registers, answers, keeps its progress thread alive ------------

def prefill_main(conn, num_threads: int) -> None:
    ucx_env()
    agent = make_agent("prefill", num_threads)
    side = None
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            break
        if msg[0] == "setup":
            _, total, ndesc, many, gapped = msg
            if side is None or side.total != total:
                if side is not None:
                    side.deregister()
                side = Side(agent, total, fill=0x5A)
            side.deregister()
            reg_s = side.register(ndesc, many, gapped)
            conn.send((agent.get_agent_metadata(), side.descs(ndesc, gapped), reg_s))
        elif msg[0] == "teardown":
            if side is not None:
                side.deregister()
            conn.send("ok")
    if side is not None:
        side.deregister()
    conn.send("bye")


# -- decode side (initiator) ----------------------------------------------------------------

def one_pull(agent, local, remote, ndesc: int, timeout_s: float) -> dict:
    import numpy as np
    idx = np.arange(ndesc, dtype=np.int32)
    t0 = time.perf_counter()
    handle = agent.make_prepped_xfer("READ", local, idx, remote, idx)
    t1 = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC":
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"READ of {ndesc} descriptors not DONE after {timeout_s} s")
        time.sleep(0.0001)
        state = agent.check_xfer_state(handle)
    t2 = time.perf_counter()
    if state != "DONE":
        raise RuntimeError(f"transfer state {state}")
    tel = agent.get_xfer_telemetry(handle)
    agent.release_xfer_handle(handle)
    return {"ms": 1e3 * (t2 - t0), "make_xfer_ms": 1e3 * (t1 - t0), "telemetry_xfer_ms": tel.xferDuration / 1e3,
            "telemetry_post_ms": tel.postDuration / 1e3, "desc_count": tel.descCount, "bytes": tel.totalBytes}


def run_case(agent, conn, local: Side, total: int, ndesc: int, many: bool, gapped: bool, repeats: int,
             timeout_s: float) -> dict:
    conn.send(("setup", total, ndesc, many, gapped))
    meta, remote_descs, remote_reg_s = conn.recv()
    local.deregister()
    local_reg_s = local.register(ndesc, many, gapped)
    name = agent.add_remote_agent(meta)
    remote = agent.prep_xfer_dlist(name, remote_descs, "DRAM")
    mine = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local.descs(ndesc, gapped), "DRAM")
    try:
        local.buf[:] = 0
        warm = one_pull(agent, mine, remote, ndesc, timeout_s)
        sizes = [n for _, n in layout(0, total, ndesc, gapped)]
        got = sum(int(local.buf[a:a + n].sum(dtype="uint64")) for a, n in layout(0, total, ndesc, gapped))
        assert got == 0x5A * sum(sizes), "READ did not bring the prefill side's bytes"
        samples = [one_pull(agent, mine, remote, ndesc, timeout_s) for _ in range(repeats)]
    finally:
        agent.release_dlist_handle(mine)
        agent.release_dlist_handle(remote)
        agent.remove_remote_agent(name)
        local.deregister()
        conn.send(("teardown",))
        conn.recv()
    ms = [s["ms"] for s in samples]
    med = statistics.median(ms)
    return {"mib": total / MIB, "descriptors": ndesc, "desc_bytes": total // ndesc,
            "registration": "per_descriptor" if many else "one_region",
            "layout": "gapped" if gapped else "contiguous",
            "desc_count_after_merge": samples[0]["desc_count"], "bytes": samples[0]["bytes"],
            "ms_median": med, "ms_min": min(ms), "ms_max": max(ms),
            "gib_per_s": total / 2**30 / (med / 1e3),
            "telemetry_xfer_ms_median": statistics.median(s["telemetry_xfer_ms"] for s in samples),
            "make_xfer_ms_median": statistics.median(s["make_xfer_ms"] for s in samples),
            "register_s": {"decode": local_reg_s, "prefill": remote_reg_s},
            "warmup_ms": warm["ms"], "samples": samples}


def cases(sizes: list[int], counts: list[int], contiguous: bool) -> list[tuple[int, int, bool, bool]]:
    """(MiB, descriptors, registration per descriptor, gapped) in run order."""
    out = []
    for mib in sizes:
        for d in counts:
            if mib * MIB // d < MIN_DESC_BYTES:
                continue
            out += [(mib, d, False, True), (mib, d, True, True)]
            if contiguous and d > 1:
                out.append((mib, d, False, False))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--descriptors", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=4, help="UCX worker threads (vLLM's default 4)")
    p.add_argument("--no-contiguous", action="store_true", help="skip the adjacent (NIXL-merged) layout")
    p.add_argument("--timeout-s", type=float, default=30.0, help="per pull")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting cases after this")
    p.add_argument("--note", default="", help="what else ran on the machine")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pd_descriptors.json")
    args = p.parse_args()
    ucx_env()
    from importlib.metadata import version

    import nixl._api  # noqa: F401  (resolves to nixl_cu12/_cu13; recorded below)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child, args.num_threads), daemon=True)
    load_start = os.getloadavg()
    started = time.time()
    report = {"env": {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "nixl": version("nixl"),
                      "nixl_module": sys.modules["nixl._api"].__name__,
                      "python": platform.python_version(),
                      "platform": platform.platform(), "cpu": cpu_name(),
                      "cpu_count": os.cpu_count(),
                      "ucx": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("UCX_")},
                      "num_threads": args.num_threads, "loadavg_start": load_start, "note": args.note},
              "settings": {"command": [Path(sys.executable).name, *sys.argv], "repeats": args.repeats,
                           "warmup": 1, "min_desc_bytes": MIN_DESC_BYTES,
                           "timed": "make_prepped_xfer + transfer + poll check_xfer_state until DONE"},
              "pull_shapes": pull_shapes(), "rows": []}
    proc.start()
    try:
        agent = make_agent("decode", args.num_threads)
        local = None
        for mib, d, many, gapped in cases(args.sizes_mib, args.descriptors, not args.no_contiguous):
            if time.time() - started > args.budget_s:
                report["rows"].append({"mib": mib, "descriptors": d, "error": "budget spent, not run"})
                continue
            total = mib * MIB
            if local is None or local.total != total:
                local = Side(agent, total, fill=None)
            try:
                row = run_case(agent, parent, local, total, d, many, gapped, args.repeats, args.timeout_s)
            except Exception as e:  # keep the other cases
                row = {"mib": mib, "descriptors": d, "registration": "per_descriptor" if many else "one_region",
                       "layout": "gapped" if gapped else "contiguous", "error": repr(e)[:300]}
            report["rows"].append(row)
            print(f"[nixl_descriptors] {mib:4d} MiB  D={d:5d}  {row.get('registration')} {row.get('layout')}  "
                  + (f"median {row['ms_median']:8.2f} ms  ({row['ms_min']:.2f}-{row['ms_max']:.2f})  "
                     f"descCount {row['desc_count_after_merge']}" if "ms_median" in row else row["error"]),
                  flush=True)
        parent.send(("quit",))
        if parent.poll(10):
            parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    report["env"]["loadavg_end"] = os.getloadavg()
    report["env"]["wall_s"] = time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[nixl_descriptors] wrote {args.out}")


if __name__ == "__main__":
    main()
