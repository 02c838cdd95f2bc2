"""The model shapes infra/'s GPU checks build with random weights (nothing is downloaded)."""

#: Qwen2.5 configs (their config.json): hidden, MLP width, layers, heads, key-value heads, tied embeddings.
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True, vocab_size=151_936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True, vocab_size=151_936),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False, vocab_size=152_064),
    # CPU shapes, with a vocabulary large enough that the logits matter: the default tier's check, and the
    # memory measurement of docs/performance.md
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True, vocab_size=32_000),
    "cpu": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True, vocab_size=32_000),
}
