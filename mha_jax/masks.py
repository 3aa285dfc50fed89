"""What each query may see: masks, biases and positions, parsed once.

``mask`` broadcasts (right-aligned, numpy rules) to ``(batch, heads, q_len, kv_len)`` and follows
the JAX/Flax convention: any dtype, nonzero = attend (flax's ``make_attention_mask``,
``make_causal_mask`` and ``combine_masks`` give float32 0/1 masks; they mean what they mean in
flax). Additive terms go in ``bias``.

Causality, sliding windows, packed segments and key/value lengths are predicates on positions,
kept as positions (never a dense ``(q_len, kv_len)`` matrix unless an implementation needs one):
query ``i`` at position ``qp[i]`` may see key ``j`` at ``kp[j]`` when

- ``kp[j] <= qp[i]`` (``is_causal``);
- ``qp[i] - left <= kp[j] <= qp[i] + right`` (``local_window_size``);
- ``qp[i] // size == kp[j] // size`` (``attention_chunk_size``: Llama 4's chunked attention);
- the two segment ids are equal (``query_segment_ids``, ``key_segment_ids``);
- ``j < key_value_seq_lengths[b]``.

Each is one term of ``mha_spec.terms``; ``_Spec.terms`` is their conjunction, which every
consumer (the dense mask, the blockwise classes, the band, the ring's tiles, unused-key zeroing
and the cache's overflow check) reads.

Twin of ``mha_torch/masks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from mha_jax import _checks
from mha_spec import arguments, terms
from mha_spec.terms import Where

MASK_LAYOUT = "(batch, heads, q_len, kv_len)"


def padding_mask(valid) -> jnp.ndarray:
    """Boolean mask ``(batch, 1, 1, kv_len)`` from a ``(batch, kv_len)`` validity array.

    ``valid`` is bool or 0/1 integer; True/nonzero marks a real (not padded) key.
    """
    _checks.require_array("valid", valid)
    if valid.ndim != 2:
        raise ValueError(f"valid must have rank 2 (batch, kv_len), got shape {tuple(valid.shape)}")
    if _checks._dtype_kind(valid) not in ("bool", "int"):
        raise TypeError(f"valid must be bool or integer, got dtype {valid.dtype}")
    return (jnp.asarray(valid) != 0)[:, None, None, :]


def causal_mask(q_len: int, kv_len: int | None = None) -> jnp.ndarray:
    """Boolean mask ``(1, 1, q_len, kv_len)``: query i attends to keys 0..i.

    Aligned top-left, as ``is_causal`` with default positions: with ``q_len > kv_len`` the
    last rows see every key.
    """
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    return jnp.tril(jnp.ones((q_len, kv_len), dtype=bool))[None, None]


@dataclass(frozen=True)
class _Spec:
    """One call's masking, checked: the dense terms as given, the structured ones as positions.

    ``allowed`` (bool) and ``bias`` (float) broadcast to ``(batch, heads, q_len, kv_len)``;
    positions and segment ids are int32 ``(batch|1, len)``; ``lengths`` int32 ``(batch,)``;
    ``window`` is ``(left, right)``; ``chunk_size`` an int. None means absent (default
    positions: ``arange``). ``terms`` is the structured terms' conjunction.
    """

    shape: tuple[int, int, int, int]
    allowed: jax.Array | None = None
    bias: jax.Array | None = None
    is_causal: bool = False
    query_positions: jax.Array | None = None
    key_positions: jax.Array | None = None
    window: tuple[int, int] | None = None
    query_segment_ids: jax.Array | None = None
    key_segment_ids: jax.Array | None = None
    lengths: jax.Array | None = None
    chunk_size: int | None = None

    @property
    def default_positions(self) -> bool:
        return self.query_positions is None and self.key_positions is None

    @property
    def terms(self) -> terms.Terms:
        return terms.of(self.is_causal, self.window, self.chunk_size, self.query_segment_ids is not None,
                        self.lengths is not None)


def _parse(
    shape: tuple[int, int, int, int],
    *,
    mask=None,
    bias=None,
    is_causal=False,
    query_positions=None,
    key_positions=None,
    local_window_size=None,
    query_segment_ids=None,
    key_segment_ids=None,
    key_value_seq_lengths=None,
    attention_chunk_size=None,
) -> _Spec:
    """Check every masking argument of a call with ``shape`` = (batch, heads, q_len, kv_len)."""
    batch, _, q_len, kv_len = shape
    allowed = None
    if mask is not None:
        _checks.require_array("mask", mask)
        arguments.check_broadcast("mask", mask.shape, shape, MASK_LAYOUT)
        if _checks._dtype_kind(mask) not in ("bool", "int", "float"):
            raise TypeError(
                f"mask must be bool, integer or real floating (nonzero = attend), got dtype "
                f"{mask.dtype} with shape {tuple(mask.shape)}"
            )
        allowed = jnp.asarray(mask) if mask.dtype == jnp.bool_ else jnp.asarray(mask) != 0
    if bias is not None:
        _checks.require_float("bias", bias)
        arguments.check_broadcast("bias", bias.shape, shape, MASK_LAYOUT)
        bias = jnp.asarray(bias)
    return _Spec(
        shape, allowed, bias, arguments.check_is_causal(is_causal),
        _sequence("query_positions", query_positions, batch, q_len, "q_len"),
        _sequence("key_positions", key_positions, batch, kv_len, "kv_len"),
        arguments.check_window(local_window_size),
        *_segments(query_segment_ids, key_segment_ids, batch, q_len, kv_len),
        _lengths(key_value_seq_lengths, batch, kv_len), terms.check_chunk_size(attention_chunk_size),
    )


def _sequence(name: str, x, batch: int, length: int, length_name: str):
    """Integer ``(length,)`` or ``(batch|1, length)`` as int32 ``(batch|1, length)``."""
    if x is None:
        return None
    _checks.check_sequence(name, x, batch, length, length_name)
    x = jnp.asarray(x, jnp.int32)
    return x[None] if x.ndim == 1 else x


def _segments(query_ids, key_ids, batch: int, q_len: int, kv_len: int):
    if (query_ids is None) != (key_ids is None):
        given, missing = ("query_segment_ids", "key_segment_ids") if key_ids is None else ("key_segment_ids", "query_segment_ids")
        raise ValueError(f"{given} needs {missing} too (in self-attention through a module, it defaults to the query's)")
    return (_sequence("query_segment_ids", query_ids, batch, q_len, "q_len"),
            _sequence("key_segment_ids", key_ids, batch, kv_len, "kv_len"))


def _lengths(lengths, batch: int, kv_len: int):
    if lengths is None:
        return None
    _checks.check_lengths("key_value_seq_lengths", lengths, batch, kv_len)
    return jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (batch,))


def _positions(spec: _Spec):
    """(query positions ``(batch|1, q_len)``, key positions ``(batch|1, kv_len)``), arange by default."""
    _, _, q_len, kv_len = spec.shape
    qp = jnp.arange(q_len, dtype=jnp.int32)[None] if spec.query_positions is None else spec.query_positions
    kp = jnp.arange(kv_len, dtype=jnp.int32)[None] if spec.key_positions is None else spec.key_positions
    return qp, kp


def _dense(spec: _Spec):
    """bool ``(batch|1, heads|1, q_len, kv_len)``: every term but the bias, or None if none restricts."""
    if not spec.terms:
        return spec.allowed  # positions alone restrict nothing
    qp, kp = _positions(spec)
    qs, ks, lengths = spec.query_segment_ids, spec.key_segment_ids, spec.lengths
    visible = spec.terms.visible(
        Where(qp[:, :, None], None if qs is None else qs[:, :, None]),
        Where(kp[:, None, :], None if ks is None else ks[:, None, :], jnp.arange(spec.shape[3])[None, None, :],
              None if lengths is None else lengths[:, None, None]),
    )[:, None]
    return visible if spec.allowed is None else spec.allowed & visible


def _unused_keys(spec: _Spec, kv_heads: int = 1, segments: bool = True):
    """bool ``(batch, kv_heads, kv_len)``: True where no query of the heads sharing a key/value
    head (with ``kv_heads=1``, of any head) may attend to the key; None when none is found.

    Each term is read alone (a key that only their combination excludes stays in): the dense
    mask and a ``-inf`` bias over all queries, and without forming a ``(q_len, kv_len)`` matrix,
    lengths, causality, windows and chunks from the extreme query positions, and segments absent from
    the queries. Zeroing those keys keeps whatever they hold (NaN in padding, say) out of
    outputs and every gradient: 0 * NaN is NaN in the weights-times-values product and in a
    projection's weight gradient. ``segments=False`` leaves the segments' term out (it sorts the
    query ids along the length, which a length sharded over a mesh axis cannot be).
    """
    batch, _, _, kv_len = spec.shape
    excluded = []
    if spec.allowed is not None:
        excluded.append(jnp.logical_not(spec.allowed))
    if spec.bias is not None:
        excluded.append(spec.bias == -jnp.inf)
    unused = None
    for ex in excluded:  # over queries, then over the query heads of each key/value head
        ex = ex.reshape((1,) * (4 - ex.ndim) + tuple(ex.shape)).all(axis=2)  # (batch?, heads?, kv_len?)
        if ex.shape[1] != 1:
            ex = ex.reshape(ex.shape[0], kv_heads, ex.shape[1] // kv_heads, ex.shape[2]).all(axis=2)
        unused = ex if unused is None else unused | ex
    keys = []  # (batch|1, kv_len) terms
    # every term but segments (exactly, below) from the queries' extreme positions, each key alone
    ranged = spec.terms.only({"index", "length", "position"} if spec.shape[2] > 0 else {"index", "length"})
    if ranged:
        qp, kp = _positions(spec) if "position" in ranged.reads else (None, None)
        lo, hi = (Where() if qp is None else Where(f(qp, axis=1, keepdims=True)) for f in (jnp.min, jnp.max))
        key = Where(kp, index=jnp.arange(kv_len)[None], length=None if spec.lengths is None else spec.lengths[:, None])
        keys.append(~ranged.block(lo, hi, key, key)[1])
    if segments and spec.query_segment_ids is not None and spec.shape[2] > 0:
        keys.append(~_present(spec.query_segment_ids, spec.key_segment_ids))
    for ex in keys:
        ex = ex[:, None, :]
        unused = ex if unused is None else unused | ex
    return None if unused is None else jnp.broadcast_to(unused, (batch, kv_heads, kv_len))


def _present(query_ids, key_ids):
    """bool ``(batch|1, kv_len)``: whether each key's segment id occurs among the queries'."""
    batch = max(query_ids.shape[0], key_ids.shape[0])
    ordered = jnp.broadcast_to(jnp.sort(query_ids, axis=1), (batch, query_ids.shape[1]))
    key_ids = jnp.broadcast_to(key_ids, (batch, key_ids.shape[1]))
    # "sort": the default's loop, under vmap, fails on a batch sharded over an Explicit mesh axis
    index = jax.vmap(lambda a, v: jnp.searchsorted(a, v, method="sort"))(ordered, key_ids)
    found = jnp.take_along_axis(ordered, jnp.minimum(index, ordered.shape[1] - 1), axis=1)
    return found == key_ids


def _zero_unused_inputs(inputs_k, inputs_v, spec: _Spec, segments: bool = True):
    """The modules' ``inputs_k``/``inputs_v`` ``(batch, kv_len, features)`` with zeros at the
    keys that no query of any head may attend to, before they are projected (``segments`` as in
    ``_unused_keys``)."""
    unused = _unused_keys(spec, segments=segments)
    if unused is None:
        return inputs_k, inputs_v
    unused = unused[:, 0, :, None]
    return jnp.where(unused, 0, inputs_k), jnp.where(unused, 0, inputs_v)
