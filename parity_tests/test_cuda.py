"""``mha_torch`` on a CUDA device, where a GPU is at hand (skipped elsewhere: CI has none).

Half-precision inputs reach SDPA's fused kernels as they are; cast to float32 first, SDPA falls
back to its math kernel and forms every score. Checked against the float64 oracle on the same
rounded inputs, forward and gradients, for each masking term, and by the memory one call takes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mha_torch
from parity_tests.tool import oracle
from parity_tests.tool.harness import TOLERANCES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

B, H, KV, N, D = 2, 8, 2, 256, 64
SEGMENTS = np.repeat(np.arange(4), N // 4)[None].repeat(B, 0)
CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(is_causal=True, local_window_size=(32, 0)),
    "segments": dict(query_segment_ids=SEGMENTS, key_segment_ids=SEGMENTS),
    "lengths, one row empty": dict(key_value_seq_lengths=np.array([200, 0])),
    "sinks": dict(is_causal=True, sinks=np.linspace(-1.0, 1.0, H)),
}


def _rel(got: torch.Tensor, want: np.ndarray) -> float:
    got = got.detach().double().cpu().numpy()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_sdpa_on_cuda_matches_the_oracle(case, dtype):
    rng = np.random.default_rng(0)
    kw = CASES[case]
    q, k, v = (torch.tensor(rng.standard_normal(s), dtype=dtype, device="cuda", requires_grad=True)
               for s in ((B, H, N, D), (B, KV, N, D), (B, KV, N, D)))
    d_out = rng.standard_normal((B, H, N, D))
    sinks = None if "sinks" not in kw else torch.tensor(kw["sinks"], dtype=dtype, device="cuda")
    att = oracle.Attention(
        is_causal=kw.get("is_causal", False), window=kw.get("local_window_size"),
        query_segment_ids=kw.get("query_segment_ids"), key_segment_ids=kw.get("key_segment_ids"),
        lengths=kw.get("key_value_seq_lengths"), sinks=None if sinks is None else sinks.double().cpu().numpy(),
    )
    want, _, cache = oracle.attention(*(x.detach().double().cpu().numpy() for x in (q, k, v)), att)
    grads = oracle.attention_grad(cache, d_out)
    given = {name: torch.tensor(x, device="cuda") if isinstance(x, np.ndarray) else x
             for name, x in kw.items() if name != "sinks"}
    out = mha_torch.dot_product_attention(q, k, v, sinks=sinks, **given)
    assert out.dtype == dtype
    (out.float() * torch.tensor(d_out, device="cuda", dtype=torch.float32)).sum().backward()
    forward, backward = TOLERANCES["bfloat16"]
    assert _rel(out, want) <= forward
    for got, expected in zip((q.grad, k.grad, v.grad), grads):
        assert _rel(got, expected) <= backward


def test_half_precision_reaches_a_fused_kernel():
    """Causal bfloat16 over 4096 positions and 32 heads: the math kernel's float32 scores alone
    would take 2 GiB; a fused kernel takes a few MiB beyond the inputs."""
    q = torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        mha_torch.dot_product_attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 256 * 2**20
