"""loopspec: the served Ouro model drafts with its own first ``d`` loops and
verifies with the remaining loops in one batched pass.

* ``options``  – what users configure, validated before anything binds
* ``patches``  – the only patches to vLLM (CLI bare word, config translation)
* ``round``    – the round itself, independent of vLLM's runner
* ``runner``   – vLLM glue: runner/worker subclasses that run a round per step
* ``proposer`` – the stand-in proposer vLLM's ``custom_class`` method loads
"""
