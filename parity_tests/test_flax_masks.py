"""Flax's own mask helpers, given to our Flax modules, mean what they mean in flax.

``make_attention_mask``, ``make_causal_mask`` and ``combine_masks`` (nnx and linen) return
float32 0/1 masks; flax reads any mask as nonzero = attend. The same masks and weights through
``flax.nnx.MultiHeadAttention`` / ``flax.linen.MultiHeadDotProductAttention`` and through ours
must give the same outputs, and a causal mask must hide the future from the gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import mha_jax

B, Q, E, H = 2, 7, 16, 4
LENGTHS = np.array([7, 4])  # the second sequence is padded after 4 tokens
# nnx and linen export the same helpers; both are checked
HELPERS = {"nnx": nnx, "linen": linen}


def _masks(helpers, tokens):
    """flax's masks for ``tokens`` ``(B, Q)`` (0 = padding): padding, causal, and both."""
    valid = tokens != 0
    padding = helpers.make_attention_mask(valid, valid)
    causal = helpers.make_causal_mask(tokens)
    return {"padding": padding, "causal": causal, "padding+causal": helpers.combine_masks(padding, causal)}


def _inputs():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray((np.arange(Q)[None] < LENGTHS[:, None]) * rng.integers(1, 9, size=(B, Q)))
    return tokens, jnp.asarray(rng.normal(size=(B, Q, E)), jnp.float32)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
@pytest.mark.parametrize("helpers", sorted(HELPERS))
def test_flax_masks_give_flax_nnx_outputs(helpers, implementation):
    tokens, x = _inputs()
    theirs = nnx.MultiHeadAttention(H, E, decode=False, bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(1))
    ours = mha_jax.MultiHeadAttention(H, E, implementation=implementation, rngs=nnx.Rngs(2))
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    for name, mask in _masks(HELPERS[helpers], tokens).items():
        assert mask.dtype == jnp.float32  # what flax's helpers give by default
        want, got = np.asarray(theirs(x, mask=mask)), np.asarray(ours(x, mask=mask))
        # queries that may see some key; a padded query of the padding masks sees none, where
        # flax gives the mean of V and ours 0 (through the output projection: its bias)
        live = np.asarray(mask).any(axis=(1, 3))
        np.testing.assert_allclose(got[live], want[live], rtol=2e-5, atol=2e-6, err_msg=name)
        bias = np.asarray(ours.out.bias.get_value())
        np.testing.assert_array_equal(got[~live], np.broadcast_to(bias, got[~live].shape), err_msg=name)


def test_flax_masks_give_flax_linen_outputs():
    tokens, x = _inputs()
    theirs = linen.MultiHeadDotProductAttention(H, bias_init=linen.initializers.normal(0.5))
    ours = mha_jax.linen.MultiHeadDotProductAttention(H)
    variables = theirs.init(jax.random.key(3), x)
    for name, mask in _masks(linen, tokens).items():
        live = np.asarray(mask).any(axis=(1, 3))
        want, got = np.asarray(theirs.apply(variables, x, mask=mask)), np.asarray(ours.apply(variables, x, mask=mask))
        np.testing.assert_allclose(got[live], want[live], rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_flax_causal_mask_hides_the_future(implementation):
    """The output at position 0 does not depend on later inputs: its gradient there is exactly 0,
    and padded keys get no weight."""
    tokens, x = _inputs()
    model = mha_jax.MultiHeadAttention(H, E, implementation=implementation, rngs=nnx.Rngs(4))
    masks = _masks(nnx, tokens)
    grad = jax.grad(lambda x: model(x, mask=masks["causal"])[:, 0].sum())(x)
    assert np.all(np.asarray(grad)[:, 1:] == 0)
    assert np.all(np.asarray(grad)[:, 0] != 0)
    if implementation == "xla":
        _, weights = model(x, mask=masks["padding+causal"], return_weights=True)
        assert np.all(np.asarray(weights)[1, :, :, LENGTHS[1]:] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.bool_])
def test_any_nonzero_attends(dtype):
    """A mask in any dtype is read as nonzero = attend, as in flax; 0.5 and -1 attend too."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=(B, Q, H, 8)), jnp.float32) for _ in range(3))
    attend = rng.random((B, 1, Q, Q)) < 0.6
    values = np.where(attend, rng.choice([1, 2, -1] if dtype != jnp.bool_ else [1], size=attend.shape), 0)
    if dtype in (jnp.float32, jnp.bfloat16):
        values = np.where(attend, rng.choice([1.0, 0.5, -1.0, 3.0], size=attend.shape), 0.0)
    want = mha_jax.dot_product_attention(q, k, v, mask=jnp.asarray(attend))
    got = mha_jax.dot_product_attention(q, k, v, mask=jnp.asarray(values, dtype))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
