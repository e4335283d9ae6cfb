"""``make demo``: serve the bundled Ouro checkpoint with ``vllm serve
--speculative-config loopspec``, stream a completion through the OpenAI API,
and print the acceptance figures from ``/metrics``.

The bundled checkpoint is ``checkpoints/ouro-stdlib`` (trained here on the
Python standard library). Without it the demo falls back to a tiny random
checkpoint written to ``.cache/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm_loopspec.server_process import VllmServer

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "checkpoints" / "ouro-stdlib"
FALLBACK = ROOT / ".cache" / "tiny-random"


def default_checkpoint() -> Path:
    if (BUNDLED / "config.json").exists():
        return BUNDLED
    if not (FALLBACK / "config.json").exists():
        from vllm_loopspec.tools.make_checkpoint import make_checkpoint

        print(f"[demo] no trained checkpoint; writing a tiny random one to {FALLBACK}")
        make_checkpoint(FALLBACK, preset="tiny")
    return FALLBACK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--prompt", default='def read_config(path):\n    """Read')
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speculative-config", default="loopspec",
                    help='loopspec (default), JSON such as {"method":"loopspec","num_speculative_tokens":4}, '
                         'or "none" for native decoding')
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra argument for vllm serve (repeatable)")
    args = ap.parse_args()
    ckpt = args.checkpoint or default_checkpoint()
    log = ROOT / ".cache" / "demo-serve.log"
    log.parent.mkdir(exist_ok=True)
    serve_args = ["--dtype", "float32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.5",
                  "--enforce-eager", *args.serve_arg]
    if args.speculative_config != "none":
        serve_args += ["--speculative-config", args.speculative_config]
    print(f"[demo] vllm serve {ckpt} {' '.join(serve_args)}  (log: {log})", flush=True)
    t0 = time.time()
    with VllmServer(ckpt, *serve_args, log_path=log) as srv:
        print(f"[demo] server ready in {time.time() - t0:.0f}s at {srv.url}", flush=True)
        body = {"model": srv.model_name(), "prompt": args.prompt, "max_tokens": args.max_tokens,
                "temperature": 0}
        print("[demo] prompt:\n" + args.prompt, end="", flush=True)
        t1, chunks, text = time.time(), 0, ""
        sys.stdout.write("\033[1m")
        for chunk in srv.stream("/v1/completions", body):
            if chunk["choices"]:
                piece = chunk["choices"][0]["text"]
                text += piece
                chunks += 1
                sys.stdout.write(piece)
                sys.stdout.flush()
        sys.stdout.write("\033[0m\n")
        elapsed = time.time() - t1
        print(f"[demo] {chunks} streamed chunks in {elapsed:.2f}s")
        time.sleep(0.5)  # loopspec's worker counters are flushed every 0.2 s
        print_acceptance(srv.metrics())


def _values(metrics: str, name: str) -> list[tuple[str, float]]:
    out = []
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = line[len(name):].rsplit(" ", 1)[0]
            out.append((labels, float(line.rsplit(" ", 1)[1])))
    return out


def print_acceptance(metrics: str) -> None:
    drafts = sum(v for _, v in _values(metrics, "vllm:spec_decode_num_drafts_total"))
    if not drafts:
        print("[demo] native decoding (no speculation)")
        return
    accepted = sum(v for _, v in _values(metrics, "vllm:spec_decode_num_accepted_tokens_total"))
    rounds = sum(v for _, v in _values(metrics, "loopspec:rounds_total"))
    pipelined = sum(v for _, v in _values(metrics, "loopspec:pipelined_steps_total"))
    # loopspec's own counts: a pipelined step hands vLLM a chain it verified
    # itself (vLLM sees every draft accepted); these count first proposals kept.
    drafted = sum(v for _, v in _values(metrics, "loopspec:drafted_tokens_total"))
    kept = sum(v for _, v in _values(metrics, "loopspec:accepted_tokens_total"))
    print(f"[demo] loopspec: {int(drafts)} request-steps with drafts, {1 + accepted / drafts:.2f} tokens each; "
          f"{int(drafted)} drafted, {int(kept)} accepted ({kept / max(drafted, 1):.0%}); "
          f"{int(rounds)} engine steps with drafts ({int(pipelined)} pipelined)")
    per_pos = {int(labels.split('position="')[1].split('"')[0]): v
               for labels, v in _values(metrics, "loopspec:accepted_per_pos_total")}
    tried = {int(labels.split('position="')[1].split('"')[0]): v
             for labels, v in _values(metrics, "loopspec:drafted_per_pos_total")}
    if per_pos:
        print("[demo] accepted at draft position: " + ", ".join(
            f"{pos}: {per_pos[pos] / tried[pos]:.0%}" for pos in sorted(per_pos) if tried.get(pos)))


if __name__ == "__main__":
    main()
