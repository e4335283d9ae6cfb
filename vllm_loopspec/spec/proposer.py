"""The proposer vLLM's ``custom_class`` method instantiates.

loopspec drafts inside the model forward of the next step (see ``runner``),
so this class only satisfies the interface; the runner overrides
``propose_draft_token_ids`` and never calls :meth:`propose`.
"""

from __future__ import annotations


class LoopSpecProposer:
    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config

    def load_model(self, model) -> None:
        # The drafter is the served model itself.
        self.model = model

    def propose(self, *args, **kwargs):
        raise RuntimeError(
            "LoopSpecProposer.propose should not be called: the loopspec runner "
            "drafts inside the model forward. Is the loopspec worker in use?"
        )
