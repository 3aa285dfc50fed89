"""The PyTorch module under torch's tensor parallelism: with ``parallelize_module``
(``ColwiseParallel`` on the query/key/value projections, ``RowwiseParallel`` on the output) each of
2 ranks (gloo, CPU, processes of their own) computes its own heads, and the result equals the
single-process module, forward and backward, grouped heads and masks included.
"""

import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

import mha_torch

E, H, KV = 16, 4, 2


def _reference(seed: int = 0):
    torch.manual_seed(seed)
    model = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV, dtype=torch.float64)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 5) > 0.3
    return model, x, mask


def _run(model, x, mask):
    x = x.clone().requires_grad_()
    out = model(x, mask=mask, is_causal=True, key_value_seq_lengths=torch.tensor([5, 3]))
    (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).cos()).sum().backward()
    return out.detach(), x.grad


def _rank(rank: int, world: int, port: int, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, x, mask = _reference()
        mesh = init_device_mesh("cpu", (world,))
        plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                "out_proj": RowwiseParallel()}
        parallelize_module(model, mesh, plan)
        assert model._local_heads() == (H // world, KV // world)
        out, grad = _run(model, x, mask)
        results[rank] = (out, grad)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux" or not torch.distributed.is_available(), reason="gloo on Linux")
def test_tensor_parallel_module_equals_the_single_process_module():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank, args=(2, port, results), nprocs=2, join=True)
    out, grad = _run(*_reference())
    for rank in range(2):
        tp_out, tp_grad = results[rank]
        assert torch.allclose(tp_out, out, rtol=0, atol=1e-12)
        assert torch.allclose(tp_grad, grad, rtol=0, atol=1e-12)


def test_a_shard_that_splits_a_group_of_heads_is_refused():
    model = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV)
    with torch.no_grad():  # a rank holding 2 query heads but no whole key/value head, as 4 ranks would
        model.q_proj.weight = torch.nn.Parameter(model.q_proj.weight[: 2 * (E // H)])
        model.k_proj.weight = torch.nn.Parameter(model.k_proj.weight[: E // H // 2])
    with pytest.raises(ValueError, match="splits a group of 2 query heads from its key/value head"):
        model(torch.randn(1, 3, E))
