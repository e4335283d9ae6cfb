"""Train a small Ouro checkpoint on the Python standard library, on CPU.

    python -m vllm_loopspec.training.train --out checkpoints/ouro-stdlib
    python -m vllm_loopspec.training.evaluate checkpoints/ouro-stdlib

``data`` builds the corpus (train/held-out split by file, BPE tokenizer,
cached token ids), ``fast`` is a training forward numerically equivalent to
:class:`vllm_loopspec.reference.OuroReference` (same parameters, fused
attention, incremental KV-cached decoding), ``train`` runs the per-loop
objective, ``evaluate`` writes the held-out per-loop numbers and the
loop-``d`` vs loop-``R`` agreement.
"""
