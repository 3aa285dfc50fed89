"""The masking terms as objects (``mha_spec.terms``): one predicate on NumPy, JAX and PyTorch
arrays alike, and block summaries that never skip a visible pair nor leave a masked one unmasked.

For random blocks of (sorted or shuffled) positions, ids and indices, each term and their
conjunction are checked against their own ``visible`` read pair by pair: a block called empty
(``live`` False) holds no visible pair, and one called whole holds no hidden pair; where positions
and ids are sorted runs the summary is exact for every term.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from mha_spec.terms import Causal, Chunked, Lengths, Segments, Terms, Where, Window, cache_overflows, of

TERMS = {
    "causal": Causal(),
    "window": Window(2, 1),
    "chunked": Chunked(4),
    "segments": Segments(),
    "lengths": Lengths(),
    "causal&chunked": Causal() & Chunked(3),
    "all": Causal() & Window(5, 0) & Chunked(4) & Segments() & Lengths(),
}


def _sides(rng, sorted_runs: bool, n: int = 6):
    """Query and key sides (positions, ids, indices, one length) of one block of n x n: sorted
    runs of consecutive positions and of ids that skip none, or any."""
    if sorted_runs:
        q_pos, k_pos = (np.sort(rng.integers(-6, 14, 1)) + np.arange(n) for _ in range(2))
        q_ids, k_ids = (rng.integers(0, 2) + np.cumsum(rng.random(n) < 0.3) for _ in range(2))  # no id skipped
    else:
        q_pos, k_pos = (rng.integers(-6, 14, n) for _ in range(2))
        q_ids, k_ids = (rng.integers(0, 3, n) for _ in range(2))
    index = rng.integers(0, 4) + np.arange(n)
    return Where(q_pos, q_ids), Where(k_pos, k_ids, index, rng.integers(0, 10))


def _pairs(q: Where, k: Where, lay):
    """The sides laid to broadcast over (queries, keys), converted by ``lay``."""
    return (Where(lay(q.position[:, None]), lay(q.segment[:, None])),
            Where(lay(k.position[None]), lay(k.segment[None]), lay(k.index[None]), lay(np.asarray(k.length))))


@pytest.mark.parametrize("name", sorted(TERMS))
def test_visible_is_the_same_on_numpy_jax_and_torch(name):
    rng = np.random.default_rng(0)
    q, k = _sides(rng, sorted_runs=False)
    want = np.asarray(TERMS[name].visible(*_pairs(q, k, np.asarray)))
    assert want.dtype == bool and np.broadcast_shapes(want.shape, (6, 6)) == (6, 6)
    assert np.array_equal(np.asarray(TERMS[name].visible(*_pairs(q, k, jnp.asarray))), want)
    assert np.array_equal(TERMS[name].visible(*_pairs(q, k, torch.as_tensor)).numpy(), want)


@pytest.mark.parametrize("name", sorted(TERMS))
def test_block_summaries_are_sound_and_exact_on_sorted_runs(name):
    term, rng = TERMS[name], np.random.default_rng(1)
    kinds = {"empty": 0, "whole": 0, "partial": 0}
    for _, sorted_runs in itertools.product(range(100), (False, True)):
        q, k = _sides(rng, sorted_runs, n=int(rng.integers(1, 7)))
        seen = np.asarray(term.visible(*_pairs(q, k, np.asarray)))
        lo_hi = [Where(*(None if x is None else f(x) for x in side)) for side in (q, k) for f in (np.min, np.max)]
        whole, live = term.block(lo_hi[0], lo_hi[1], Where(*lo_hi[2][:3], k.length), Where(*lo_hi[3][:3], k.length))
        assert live or not seen.any()
        assert not whole or seen.all()
        if sorted_runs and not isinstance(term, Terms):  # one term over sorted runs: exact
            assert bool(live) == seen.any() and bool(whole) == seen.all()
        kinds["whole" if whole else "partial" if live else "empty"] += 1
    assert all(kinds.values()), kinds  # every class met


def test_terms_combine_with_and_in_one_order():
    assert Causal() & Window(3, 0) == Terms((Causal(), Window(3, 0)))
    assert (Causal() & Chunked(4)) & Segments() == Causal() & (Chunked(4) & Segments())
    assert of(True, (3, 0), 8, True, True) == Causal() & Window(3, 0) & Chunked(8) & Segments() & Lengths()
    none = of(False, None, None, False, False)
    assert not none and none.visible(Where(), Where()) is None and none.block(*[Where()] * 4) == (None, None)
    assert hash(Chunked(4) & Causal()) == hash(Chunked(4) & Causal())  # static: a jit/custom-vjp argument


def test_chunks_hold_negative_positions_by_floor_division():
    """Position -1 is in chunk -1 (with -4 .. -1), not chunk 0: ``//`` floors alike in the three."""
    pos = [-5, -4, -1, 0, 3, 4]
    for lay in (np.asarray, jnp.asarray, torch.as_tensor):
        seen = np.asarray(Chunked(4).visible(Where(lay(pos)[:, None]), Where(lay(pos)[None])))
        chunks = np.array([-2, -1, -1, 0, 0, 1])
        assert np.array_equal(seen, chunks[:, None] == chunks[None])


@pytest.mark.parametrize("lay", [np.asarray, jnp.asarray, torch.as_tensor])
def test_cache_overflow_reads_the_terms_that_bound_positions(lay):
    """Steps of rows at [start, end) over 4 slots: overflow where a query may still see the newest
    overwritten position (end - 5); a window that looks ahead without causality bounds nothing."""
    start, end = lay([0, 3, 4, 4, 6]), lay([4, 6, 5, 8, 9])
    cases = {
        Causal(): [0, 1, 1, 1, 1],
        Window(3, 0): [0, 1, 0, 1, 1],  # left + n <= 4
        Causal() & Window(1, 2): [0, 0, 0, 1, 0],
        Window(1, 2): [0, 1, 1, 1, 1],  # as with no term
        Causal() & Chunked(4): [0, 1, 0, 0, 1],  # newest overwritten in the first query's chunk
        Lengths(): [0, 1, 1, 1, 1],
    }
    for term, want in cases.items():
        got = np.asarray(cache_overflows(start, end, 4, Terms(term.members)))
        assert got.tolist() == [bool(w) for w in want], term
