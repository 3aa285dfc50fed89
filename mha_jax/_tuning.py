"""The kernels' tunables and what a call's trace observed of its path (``mha_jax.testing`` sets and reads them)."""

from __future__ import annotations

import dataclasses

from mha_spec import observing


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The constants the kernels read while a call is traced (``docs/performance.md``: how each was chosen).

    ``blocks``/``backward_blocks``: blockwise's (query, key) blocks, forward and backward; None: by length
    (``_blockwise.block_sizes``). ``band_block``: queries per band of a window. ``ring_tile``: the largest tile of
    queries (and keys) a ring step scores at once. ``rows_over_heads``, ``many_keys``: ``"xla"`` forms one product
    over every key/value head when ``q_len x groups x kv_heads^2 <= rows_over_heads`` and ``kv_len >= many_keys``.
    """

    blocks: tuple[int, int] | None = None
    backward_blocks: tuple[int, int] | None = None
    band_block: int = 128
    ring_tile: int = 512
    rows_over_heads: int = 1024
    many_keys: int = 128


_STATE = observing.Observing("mha_jax", Tuning())
current, tuned, observed, observe = _STATE.current, _STATE.tuned, _STATE.observed, _STATE.observe
