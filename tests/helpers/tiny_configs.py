"""Tiny transformers configurations the tests share (random init, no download)."""

# a Llama-style decoder: grouped-query attention (2 heads, 1 key-value head), 2 layers
DECODER = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)
