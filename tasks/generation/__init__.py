"""Generation: sampling n completions per prompt, behind one interface, :class:`RolloutEngine`.

``rollout`` (the interface, the ``Generation`` record and the in-process engine ``HFEngine``), ``sampling`` (the
next token's draw), ``vllm_engine`` (a vLLM server),
``server_pool`` (several of them) and ``rank_shared`` (every rank of a sharded run generating its share).
The training loop, the selector and the evaluation see only
``RolloutEngine``.
"""

from tasks.generation.rollout import Generation, RolloutEngine

__all__ = ["Generation", "RolloutEngine"]
