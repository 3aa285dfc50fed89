"""Test support: what a call took, and the switches a test reads the paths with.

``observed()``: a list of ``(event, detail)`` the calls inside report: ``("kernel", name)`` the implementation
each call of the functional core ran (``"sdpa"`` or ``"math"``, as ``mha_jax.testing``'s). ``tuned(**fields)``:
the calls inside use ``Tuning`` with those fields.
"""

from __future__ import annotations

import dataclasses

from mha_spec import observing


@dataclasses.dataclass(frozen=True)
class Tuning:
    """``fast_step``: a module's decoding step may skip masking the whole cache where it takes the call.
    ``paged_block_pages``: the pages a ragged call over a paged cache reads as one key block."""

    fast_step: bool = True
    paged_block_pages: int = 32  # eager PyTorch pays per operation, not per page read


_STATE = observing.Observing("mha_torch", Tuning())
current, tuned, observed, observe = _STATE.current, _STATE.tuned, _STATE.observed, _STATE.observe

__all__ = ["Tuning", "current", "observe", "observed", "tuned"]
