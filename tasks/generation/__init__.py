"""Generation: sampling n completions per prompt, behind one interface, :class:`RolloutEngine`.

``rollout`` (the interface, the ``Generation`` record and the in-process engine ``HFEngine``), ``sampling`` (the
next token's draw), ``generator`` (the overlap's generator process), ``vllm_engine`` (a vLLM server) and
``server_pool`` (several of them). The training loop, the selector and the evaluation see only
``RolloutEngine``.
"""

from tasks.generation.rollout import Generation, RolloutEngine

__all__ = ["Generation", "RolloutEngine"]
