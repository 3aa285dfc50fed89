"""The grid: both modules against the float64 oracle and each other, forward and gradients."""

import pytest

from parity_tests import harness

GRID = harness.default_grid()


def _worst(result: harness.Result) -> str:
    rows = [
        f"{pair} {name}: rel {e['rel']:.2e}, max {e['max_abs']:.2e}"
        for pair, entries in result.details.items()
        for name, e in entries.items()
    ]
    return "\n".join(sorted(rows, key=lambda r: -float(r.split("max ")[-1]))[:5])


@pytest.mark.parametrize("case", GRID, ids=[c.id for c in GRID])
def test_modules_match_oracle_and_each_other(case):
    result = harness.run_case(case)
    tol, grad_tol = harness.TOLERANCES[case.dtype]
    assert result.passed, f"tolerance {tol:.0e} / {grad_tol:.0e}; worst:\n{_worst(result)}"


def test_grid_covers_every_mask_dtype_and_head_layout():
    assert {c.mask for c in GRID} == set(harness.MASKS)
    assert {c.dtype for c in GRID} == set(harness.DTYPES)
    configs = {c.config for c in GRID}
    assert {c.kv_heads == c.num_heads for c in configs} == {True, False}
    assert any(c.kv_heads == 1 for c in configs)
    assert {c.use_bias for c in configs} == {True, False}
    assert {c.self_attention for c in configs} == {True, False}
    assert any(c.q_len != c.kv_len for c in configs)
    assert any(c.qkv_features not in (None, c.in_features) for c in configs)
    assert any(c.out_features not in (None, c.in_features) for c in configs)


@pytest.mark.parametrize("dtype", harness.DTYPES)
def test_a_wrong_weight_is_caught(dtype):
    """The harness can fail: one perturbed weight on the torch side breaks parity."""
    case = harness.Case(harness.CONFIGS["self"], "padding", dtype)
    data = harness.make_data(case)
    results = {"oracle": harness.run_oracle(case, data), "jax": harness.run_jax(case, data)}
    data.params["v_proj.weight"] = data.params["v_proj.weight"].copy()
    data.params["v_proj.weight"][0, 0] += 0.05
    results["torch"] = harness.run_torch(case, data)
    assert not harness.compare(case, results).passed
