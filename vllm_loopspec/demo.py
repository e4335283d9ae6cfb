"""``make demo``: serve the bundled Ouro checkpoint with ``vllm serve`` and
stream a completion through the OpenAI API.

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
    ap.add_argument("--prompt", default="def read_config(path):\n")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra argument for vllm serve (repeatable)")
    args = ap.parse_args()
    ckpt = args.checkpoint or default_checkpoint()
    log = ROOT / ".cache" / "demo-serve.log"
    log.parent.mkdir(exist_ok=True)
    serve_args = ["--dtype", "float32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.5",
                  "--enforce-eager", *args.serve_arg]
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
        spec = [line for line in srv.metrics().splitlines()
                if line.startswith(("vllm:spec_decode", "loopspec:")) and not line.startswith("#")]
        if spec:
            print("[demo] speculation metrics:\n  " + "\n  ".join(spec))
        else:
            print("[demo] (no speculation configured: native decoding)")


if __name__ == "__main__":
    main()
