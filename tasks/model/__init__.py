"""The policy model: loading real models and building the tiny default (``loading``), its supervised warm start
(``warmstart``), LoRA adapters (``lora``), the forward passes the algorithms need (``forward``: token log-probs,
pooled embeddings, MLP inputs; ``logprob_head``: the LM head of a log-prob pass, in chunks) and the module inside a
backend's wrapper (``wrappers``). Sampling from it is
``tasks/generation/``; the policy the stages pass around is tasks/policy.py.
"""
