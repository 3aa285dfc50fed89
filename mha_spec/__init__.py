"""The specification both twins import: pure Python and NumPy, never JAX, flax or torch.

``mha_jax`` and ``mha_torch`` never import each other; what must be the same in both lives here,
once, so that a bad argument fails alike in both frameworks and a checkpoint reads alike:

- ``arguments``: checks that read no array library (head counts, broadcasting, rates, scales,
  soft-caps, windows, QK-norm, sequence, length, position and sink shapes), and ``ArrayChecks``,
  the array checks each twin makes from how its framework reads an array;
- ``batch_axes``: the modules' leading batch axes, merged into one and restored;
- ``terms``: which keys a query may see: one object per masking term on positions (causality,
  window, chunks, segments, lengths), combined with ``&``, and ``Spec``, one call's parsed masking;
- ``layouts``: checkpoint naming schemes and the shape check of a loaded state;
- ``torch_mha``: what ``torch.nn.MultiheadAttention``'s masks mean in ours, and their shape rules;
- ``rotary``: rotary embeddings' parameters and how transformers' configs name them;
- ``families``: a transformers layer's attention options read from its ``config.json``;
- ``qk_norm``: ``QKNorm``, exported by both twins;
- ``docstrings``: the sections the twins' docstrings share, put in at import.

Not a public API of its own: use it through ``mha_jax`` and ``mha_torch``.
"""
