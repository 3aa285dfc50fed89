"""Test support: the kernels' tunables, what a call's trace took, and the private modules tests read.

``tuned(**fields)``: the calls traced inside use ``Tuning`` with those fields (block sizes, band and ring tiles,
the ``"xla"`` products' thresholds). ``observed()``: a list of ``(event, detail)`` the traces inside report:
``("kernel", name)`` each kernel traced (``"flash"``: one per platform), ``("blocks", (block_q, block_k))``
blockwise's forward blocks, ``("band", config)`` a window run as bands, ``("own_blocks", shape)`` an ``"xla"``
product over every head. A program already compiled is not traced again: tune and observe a fresh trace.
"""

from mha_jax import _band as band
from mha_jax import _blockwise as blockwise
from mha_jax import _dispatch as dispatch
from mha_jax import _platform as platform
from mha_jax import _splash as splash
from mha_jax._tiles import Tokens
from mha_jax._tuning import Tuning, observed, tuned

__all__ = ["Tokens", "Tuning", "band", "blockwise", "dispatch", "observed", "platform", "splash", "tuned"]
