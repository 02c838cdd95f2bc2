"""The policy model: loading (``policy``), the tiny default's supervised warm start (``warmstart``), LoRA adapters
(``lora``) and the forward passes the algorithms need (``forward``: token log-probs, pooled embeddings, MLP
inputs). Sampling from it is ``tasks/generation/``.
"""
