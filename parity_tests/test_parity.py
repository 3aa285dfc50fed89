"""The grid: both modules against the float64 oracle and each other, forward and gradients."""

import numpy as np
import pytest

from parity_tests.tool import cases, harness

GRID = cases.full_grid()


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


def test_grid_covers_every_head_layout():
    configs = {c.config for c in GRID}
    assert {c.dtype for c in GRID} == {"float64", "float32", "bfloat16"}
    assert {c.kv_heads == c.num_heads for c in configs} == {True, False}
    assert any(c.kv_heads == 1 for c in configs)
    assert {c.use_bias for c in configs} == {True, False}
    assert {c.self_attention for c in configs} == {True, False}
    assert any(c.q_len != c.kv_len for c in configs)
    assert any(c.qkv_features not in (None, c.in_features) for c in configs)
    assert any(c.out_features not in (None, c.in_features) for c in configs)


@pytest.mark.parametrize("config", ["self", "cross-gqa"])
def test_every_mask_form_of_the_grid_changes_the_attention(config):
    """Each mask form the grid runs draws a mask that matters: the oracle's attention weights
    (or, for a bias, its output) differ from the unmasked case's and from every other form's,
    so no form of the grid is vacuous or a copy of another; the one pair written to mean the
    same (padding as a bool mask and as an additive -1e9) gives the same attention."""
    forms = sorted({c.mask for c in GRID if c.config.name == config})
    assert len(forms) == 20
    seen = {}
    for mask in forms:
        case = harness.Case(harness.CONFIGS[config], mask, "float64")
        result = harness.run_oracle(case, harness.make_data(case))
        seen[mask] = np.concatenate([result["weights"].ravel(), result["out"].ravel()])
    for i, a in enumerate(forms):
        for b in forms[i + 1:]:
            same = np.allclose(seen[a], seen[b], rtol=0, atol=1e-9)
            assert same == ({a, b} == {"bcast-b11k-float", "padding"}), f"{a} and {b}: same attention {same}"


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


def test_one_blockwise_program_serves_every_mask_form_with_the_same_static_options():
    """The blockwise side compiles one program per configuration, dtype and static option:
    every mask form's terms, in their one form, fit the program of its static options (each
    program traces the kernel once; a case that needed a program of its own would trace it
    again)."""
    from mha_jax import testing

    cases = [c for c in GRID if c.config.name == "self" and c.dtype == "float32"]
    harness._jax_programs()[1].clear_cache()
    with testing.observed() as seen:
        for case in cases:
            harness.run_jax(case, harness.make_data(case), implementation="blockwise", canonical=True)
    traces = [event for event, _ in seen if event == "blocks"]
    options = {harness.static_options(harness.make_data(c).attention) for c in cases}
    assert len(traces) == len(options) == 5


def test_every_mask_form_has_its_drawing():
    """``make_data`` draws each mask form of the grid by its own entry of ``MASK_FORMS``, and
    refuses a form it has none for by name."""
    assert list(harness.MASK_FORMS) == list(cases.MASKS)
    with pytest.raises(ValueError, match="unknown mask kind 'no-such-form'"):
        harness.make_data(harness.Case(harness.CONFIGS["self"], "no-such-form", "float64"))
