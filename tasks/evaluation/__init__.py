"""Evaluation: held-out greedy accuracy and sampled avg@k / pass@k, by level and source (``heldout``)."""
