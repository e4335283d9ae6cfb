"""Disaggregated prefill/decode for Ouro over vLLM's ``NixlConnector``: the
launcher (:mod:`.launcher`), the router (:mod:`.router`) and the handoff
contract (:mod:`.contract`)."""

from vllm_loopspec.disagg.contract import HandoffContractError
from vllm_loopspec.disagg.launcher import PDDeployment, main

__all__ = ["HandoffContractError", "PDDeployment", "main"]
