"""The specification both twins import: pure Python and NumPy, never JAX, flax or torch.

``mha_jax`` and ``mha_torch`` never import each other; what must be the same in both lives here,
once, so that a bad argument fails alike in both frameworks and a checkpoint reads alike: the
argument checks (``arguments``), the masking terms and one call's parsed masking (``terms``),
ALiBi's score term and transformers' slopes for it (``alibi``),
checkpoint naming schemes (``layouts``), ``torch.nn.MultiheadAttention``'s masks (``torch_mha``),
rotary embeddings (``rotary``), transformers' configs (``families``), the batch axes
(``batch_axes``), the cache arithmetic (``kv_cache``), ``QKNorm`` (``qk_norm``) and the
docstrings' shared sections (``docstrings``); each module's docstring says what it holds.

Not a public API of its own: use it through ``mha_jax`` and ``mha_torch``.
"""
