"""The policy model: loading (``policy``), the tiny default's supervised warm start (``warmstart``),
rollout engines (``rollout``: transformers, drawing with ``sampling``; ``vllm_engine``: a vLLM server;
``server_pool``: several of them) and the forward passes the algorithms need (``forward``: token log-probs,
pooled embeddings, MLP inputs).
"""
