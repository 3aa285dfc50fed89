"""The PyTorch module on 2 ranks (gloo, CPU, processes of their own, started once for this file):

- under torch's tensor parallelism (``parallelize_module``: ``ColwiseParallel`` on the query/key/value
  projections, ``RowwiseParallel`` on the output) each rank computes its own heads, and the result equals the
  single-process module, forward and backward, grouped heads and masks included; so does decoding, each rank
  caching its own key/value heads, by the fast path (one-token steps, nothing else given) and by the general
  step (the same tokens at given positions), against the full causal pass; and so does serving by ``paged_step``,
  each rank's pages holding its own key/value heads;
- torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``, the length split
  over the ranks) has no ring for the CPU kernel of ``F.scaled_dot_product_attention`` (checked in this
  process: which kernels it replaces, which one the module calls on a CPU).
"""

import os
import socket
import sys
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import mha_torch

E, H, KV = 16, 4, 2
PROMPT, STEPS = 5, 3  # decoding: a prompt of 5 tokens, then 3 one-token steps
WORLD, TIMEOUT_S = 2, 240


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


def _tokens() -> torch.Tensor:
    """The decoded sequence ``(2, PROMPT + STEPS, E)``, float64."""
    return torch.randn(2, PROMPT + STEPS, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _decode(model, kv_heads: int, general: bool) -> tuple[torch.Tensor, int]:
    """The outputs of decoding ``_tokens()`` (a prompt, then one-token steps) over a cache of ``kv_heads``
    heads, and how many steps the fast path took; ``general``: the positions given, which the fast path
    leaves to the general step."""
    x, taken = _tokens(), []
    fast_step = model._fast_step

    def spy(*args):
        out = fast_step(*args)
        taken.append(out is not None)
        return out

    model._fast_step = spy
    cache = mha_torch.KVCache(2, PROMPT + STEPS, kv_heads, E // H, dtype=torch.float64)
    with torch.no_grad():
        outs = []
        for start, stop in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, PROMPT + STEPS)]:
            positions = dict(query_positions=torch.arange(start, stop).expand(2, -1)) if general else {}
            outs.append(model(x[:, start:stop], cache=cache, is_causal=True, **positions))
    del model._fast_step
    return torch.cat(outs, dim=1), sum(taken)


def _paged(model, kv_heads: int) -> torch.Tensor:
    """The outputs of serving ``_tokens()``'s two sequences by ``paged_step`` over a paged cache of ``kv_heads``
    heads: both prompts in one step, then a token of each per step; ``(2, PROMPT + STEPS, E)``."""
    from mha_spec.paged import PageTable
    from mha_torch import paged

    x, table = _tokens(), PageTable(num_pages=8, page_size=2, max_seqs=2, pages_per_seq=4)
    cache, outs = paged.init_cache(table, kv_heads, E // H, torch.float64), []
    with torch.no_grad():
        for start, stop in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, PROMPT + STEPS)]:
            cache = paged.schedule(cache, table.append([stop - start] * 2))
            out, cache = model.paged_step(x[:, start:stop].reshape(-1, E), cache, max_q_len=stop - start)
            outs.append(out.reshape(2, stop - start, E))
    return torch.cat(outs, dim=1)


def _rank(rank: int, world: int, port: int, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                "out_proj": RowwiseParallel()}
        model, x, mask = _reference()
        parallelize_module(model, mesh, plan)
        mine = {"local_heads": model._local_heads(), "module": _run(model, x, mask)}
        for general in (False, True):
            mine["general" if general else "fast"] = _decode(model, KV // world, general)
        mine["paged"] = _paged(model, KV // world)
        results[rank] = mine
    except Exception:
        results[rank] = traceback.format_exc()
        raise
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks():
    """Each rank's results: its ranks' processes started once, killed if they outlive ``TIMEOUT_S``."""
    if sys.platform != "linux" or not torch.distributed.is_available():
        pytest.skip("gloo on Linux")
    manager = mp.get_context("spawn").Manager()  # not forked: this process runs JAX's threads
    results = manager.dict()
    context = mp.start_processes(_rank, args=(WORLD, _free_port(), results), nprocs=WORLD, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() >= deadline:
                pytest.fail(f"the {WORLD} ranks ran past {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    found = dict(results)
    manager.shutdown()
    for rank in range(WORLD):
        assert isinstance(found.get(rank), dict), f"rank {rank}: {found.get(rank)}"
    return found


def test_tensor_parallel_module_equals_the_single_process_module(ranks):
    out, grad = _run(*_reference())
    for rank in range(WORLD):
        tp_out, tp_grad = ranks[rank]["module"]
        assert ranks[rank]["local_heads"] == (H // WORLD, KV // WORLD)
        assert torch.allclose(tp_out, out, rtol=0, atol=1e-12)
        assert torch.allclose(tp_grad, grad, rtol=0, atol=1e-12)


def test_tensor_parallel_paged_steps_equal_the_full_causal_pass(ranks):
    """Each rank's pages hold its 1 key/value head: both prompts in one ``paged_step``, then one token of each per
    step, equal the full causal pass; so does one process with both heads."""
    model, _, _ = _reference()
    full = model(_tokens(), is_causal=True).detach()
    for rank in range(WORLD):
        assert torch.allclose(ranks[rank]["paged"], full, rtol=0, atol=1e-12), (ranks[rank]["paged"] - full).abs().max()
    assert torch.allclose(_paged(model, KV), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("path", ["fast", "general"])
def test_tensor_parallel_decoding_equals_the_full_causal_pass(ranks, path):
    """Each rank caches its 1 key/value head; the one-token steps take the fast path unless positions are
    given, which sends every step to the general one."""
    model, _, _ = _reference()
    full = model(_tokens(), is_causal=True).detach()
    for rank in range(WORLD):
        out, fast_steps = ranks[rank][path]
        assert fast_steps == (STEPS if path == "fast" else 0)
        assert torch.allclose(out, full, rtol=0, atol=1e-12), (out - full).abs().max()
    model, _, _ = _reference()
    alone, fast_steps = _decode(model, KV, path == "general")  # one process takes the same path
    assert fast_steps == (STEPS if path == "fast" else 0) and torch.allclose(alone, full, rtol=0, atol=1e-12)


def test_context_parallel_has_no_ring_for_the_cpu_kernel():
    """torch's context parallelism runs its ring in place of the CUDA kernels of
    ``F.scaled_dot_product_attention`` (flash, memory-efficient, cuDNN) only; on a CPU the call goes to
    another kernel, which it leaves to DTensor's sharding rules (none for it: ``docs/scaling.md`` quotes the
    errors). The module's attention on a CPU is that kernel."""
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    model = _reference()[0].float()
    with Calls() as calls:
        model(_tokens().float(), is_causal=True)
    cpu_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert cpu_kernel in calls.ops
    ringed = {op.name() for op in _attention.custom_ops}
    assert ringed == {f"aten::_scaled_dot_product_{kind}_attention{part}"
                      for kind in ("flash", "efficient", "cudnn") for part in ("", "_backward")}, ringed


def test_a_shard_that_splits_a_group_of_heads_is_refused():
    model = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV)
    with torch.no_grad():  # a rank holding 2 query heads but no whole key/value head, as 4 ranks would
        model.q_proj.weight = torch.nn.Parameter(model.q_proj.weight[: 2 * (E // H)])
        model.k_proj.weight = torch.nn.Parameter(model.k_proj.weight[: E // H // 2])
    with pytest.raises(ValueError, match="splits a group of 2 query heads from its key/value head"):
        model(torch.randn(1, 3, E))
