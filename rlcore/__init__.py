"""rlcore: the pure algorithms of rlsift (stdlib, numpy and torch only).

No I/O, no logging, no Prefect, MLflow or duckdb: functions take tensors and arrays and return results
plus a ``dict[str, float]`` of metrics. Model work (generation, log-probs, hidden states) happens in
``tasks/`` and only its arrays cross into here.

Shape notation, used in every docstring of this package:

    B   prompts (groups) in a batch
    G   rollouts per prompt that enter the update (PODS: m kept of n generated)
    n   rollouts generated per prompt before down-sampling
    N   rollouts in a flattened batch (N = B * G)
    L   completion tokens (right-padded)
    P   prompt tokens
    T   tokens of a full sequence (prompt + completion)
    H   hidden size of the policy
    D   embedding / feature dimension
    K   reference-set prompts (DOTS)
    M   pool prompts (candidates for selection)
"""
