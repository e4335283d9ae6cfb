"""What a row count met for the first time costs in vLLM's CPU linear layers.

On x86 CPUs without AMX, vLLM 0.32 runs an unquantized linear layer as a
oneDNN matmul (``dispatch_cpu_unquantized_gemm``: ``ops.create_onednn_mm``
with a 32-kernel cache per weight shape, keyed by the row count), and oneDNN
JIT-builds a kernel for each row count it has not met, keeping 1024 for the
process. This probe times ``ops.onednn_mm`` on the bundled model's five
weight shapes (fp32, as the benchmarks' engines): each row count 1..64 the
first time and again, then 400 row counts on every shape (2000 kernels, over
oneDNN's 1024) and row counts 1..30 again. Prints only; no engine.

    python benchmarks/probes/onednn_row_counts.py

(Engines: ``ONEDNN_VERBOSE=profile_create`` prints every kernel built,
``create:cache_miss``, with oneDNN's own milliseconds.)
"""
import statistics
import time

import torch

# The bundled checkpoint's linear layers, (out, in): hidden 256, 4 heads of
# 64 with 2 KV heads, MLP 704, vocabulary 4096.
SHAPES = {"qkv_proj": (512, 256), "o_proj": (256, 256), "gate_up_proj": (1408, 256),
          "down_proj": (256, 704), "lm_head": (4096, 256)}


def main() -> None:
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    handlers = {name: ops.create_onednn_mm(torch.randn(n, k).t(), 32) for name, (n, k) in SHAPES.items()}

    def call_ms(name: str, rows: int) -> float:
        x = torch.randn(rows, SHAPES[name][1])
        start = time.perf_counter()
        ops.onednn_mm(handlers[name], x, None)
        return 1e3 * (time.perf_counter() - start)

    print("shape: median ms of a row count's first call (1..64) | of the same row counts again")
    for name in SHAPES:
        first = [call_ms(name, m) for m in range(1, 65)]
        again = [call_ms(name, m) for m in range(1, 65)]
        print(f"{name}: {statistics.median(first):.3f} | {statistics.median(again):.3f}")
    start = time.perf_counter()
    for m in range(65, 401):
        for name in SHAPES:
            call_ms(name, m)
    print(f"row counts 65..400 on every shape (first calls): {time.perf_counter() - start:.2f} s")
    for name in SHAPES:
        print(f"{name}, row counts 1..30 after that: median "
              f"{statistics.median(call_ms(name, m) for m in range(1, 31)):.3f} ms")


if __name__ == "__main__":
    main()
