#!/usr/bin/env bash
# Start the two-node Ray cluster that configs/ray-*.yaml run on.
#   node 1:  bash configs/ray-cluster.sh head
#   node 2:  bash configs/ray-cluster.sh worker HEAD_IP
# Every node needs the same Python environment: vLLM 0.32 and vllm-loopspec
# installed (pip install 'vllm-loopspec[gpu,ray]'): Ray actors load the
# plugin through its vllm.general_plugins entry point. If the cluster
# authenticates clients (RAY_AUTH_MODE=token), export the same
# RAY_AUTH_TOKEN on both nodes and in the shell that runs `vllm serve`.
# CPU nodes (testing only) also declare one vllm_cpu_worker per worker they
# host: add  --resources '{"vllm_cpu_worker": N}'.
set -euo pipefail
case "${1:-}" in
  head)   ray start --head --port 6379 ;;
  worker) ray start --address "${2:?HEAD_IP}:6379" ;;
  *)      echo "usage: $0 head | worker HEAD_IP" >&2; exit 2 ;;
esac
