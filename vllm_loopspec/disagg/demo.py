"""``make pd-demo``: a disaggregated deployment of the bundled checkpoint
(prefill instance, decode instance with loopspec, router), one streamed
completion through the router, where its prompt tokens came from on the
decode side and what the KV transfer cost, then everything stopped."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm_loopspec.demo import default_checkpoint
from vllm_loopspec.disagg.launcher import PDDeployment, metric_sum, prompt_tokens_by_source

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--prompt", default='def read_config(path):\n    """Read')
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    ckpt = args.checkpoint or default_checkpoint()
    log_dir = ROOT / ".cache" / "pd-demo"
    print(f"[pd-demo] starting prefill + decode (loopspec) instances of {ckpt} (logs: {log_dir})", flush=True)
    t0 = time.time()
    with PDDeployment(ckpt, log_dir=log_dir) as pd:
        print(f"[pd-demo] ready in {time.time() - t0:.0f}s: router {pd.url}, prefill {pd.prefill.url}, "
              f"decode {pd.decode.url}", flush=True)
        body = {"model": pd.decode.model_name(), "prompt": args.prompt, "max_tokens": args.max_tokens,
                "temperature": 0}
        print("[pd-demo] prompt:\n" + args.prompt, end="", flush=True)
        sys.stdout.write("\033[1m")
        for chunk in pd.client.stream("/v1/completions", body):
            if chunk["choices"]:
                sys.stdout.write(chunk["choices"][0]["text"])
                sys.stdout.flush()
        sys.stdout.write("\033[0m\n")
        time.sleep(0.5)
        text = pd.decode.metrics()
        sources = prompt_tokens_by_source(text)
        n = metric_sum(text, "vllm:nixl_xfer_time_seconds_count")
        print(f"[pd-demo] decode side prompt tokens: {int(sources['external_kv_transfer'])} by KV transfer, "
              f"{int(sources['local_compute'])} computed; {int(metric_sum(text, 'loopspec:rounds_total'))} "
              f"loopspec rounds")
        if n:
            print(f"[pd-demo] {int(n)} KV transfers: mean {1e3 * metric_sum(text, 'vllm:nixl_xfer_time_seconds_sum') / n:.1f} ms, "
                  f"{metric_sum(text, 'vllm:nixl_bytes_transferred_sum') / n / 2**20:.2f} MiB, "
                  f"{metric_sum(text, 'vllm:nixl_num_descriptors_sum') / n:.0f} descriptors each")
    print("[pd-demo] stopped prefill, decode and router")


if __name__ == "__main__":
    main()
