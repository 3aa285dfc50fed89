"""Continuous batching over a paged cache: a small decoder serving a queue of requests of different lengths.

A two-layer Llama-style decoder in PyTorch, each attention built by ``mha_torch.from_hf`` from a config dict
(random weights), serves requests from a queue through ``MultiHeadAttention.paged_step``: at each step the
running sequences decode one token each while a newly admitted one reads its whole prompt in the same call;
a finished sequence's pages go back to the pool for the next request (``mha_spec.paged.PageTable``). Every
request's greedy tokens equal those of decoding it alone with a contiguous ``KVCache``. Run:
``python examples/serve.py``.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

import mha_torch
from mha_spec.paged import PageTable
from mha_torch import paged

CONFIG = dict(model_type="llama", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0)
SLOTS, PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 3, 4, 8, 16  # 3 sequences at once, from a pool of 16 pages


class Decoder(torch.nn.Module):
    """Embedding, layers of (RMS norm, attention, RMS norm, MLP) with residuals, a norm and the output head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        width, vocab = CONFIG["hidden_size"], CONFIG["vocab_size"]
        self.embed = torch.nn.Embedding(vocab, width)
        self.attention = torch.nn.ModuleList(
            [mha_torch.from_hf(CONFIG, layer=i) for i in range(CONFIG["num_hidden_layers"])])
        self.norms = torch.nn.ModuleList([torch.nn.RMSNorm(width) for _ in range(2 * len(self.attention) + 1)])
        self.mlps = torch.nn.ModuleList([torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.SiLU(), torch.nn.Linear(2 * width, width))
            for _ in self.attention])
        self.head = torch.nn.Linear(width, vocab)
        self.eval()

    def forward(self, tokens: torch.Tensor, attend) -> torch.Tensor:
        """Logits of ``tokens``; ``attend(layer, attention, h)`` runs layer ``layer``'s attention on ``h``."""
        h = self.embed(tokens)
        for i, (attention, mlp) in enumerate(zip(self.attention, self.mlps)):
            h = h + attend(i, attention, self.norms[2 * i](h))
            h = h + mlp(self.norms[2 * i + 1](h))
        return self.head(self.norms[-1](h))


@torch.no_grad()
def alone(model: Decoder, prompt: list[int], new: int) -> list[int]:
    """Greedy tokens of one request decoded by itself, with a contiguous ``KVCache`` per layer."""
    caches = [mha_torch.KVCache(1, len(prompt) + new, a.num_kv_heads, a.head_dim) for a in model.attention]
    tokens, out = torch.tensor([prompt]), []
    for _ in range(new):
        logits = model(tokens, lambda i, attention, h: attention(h, cache=caches[i], is_causal=True))
        tokens = logits[:, -1:].argmax(-1)
        out.append(int(tokens))
    return out


@torch.no_grad()
def serve(model: Decoder, requests: list[tuple[list[int], int]]) -> tuple[list[list[int]], int]:
    """Every request's greedy tokens, served ``SLOTS`` at a time with continuous batching; and the steps taken."""
    table = PageTable(NUM_PAGES, PAGE_SIZE, SLOTS, PAGES_PER_SEQ)
    caches = [paged.init_cache(table, a.num_kv_heads, a.head_dim, torch.float32) for a in model.attention]
    queue, slots, results, steps = deque(enumerate(requests)), [None] * SLOTS, [[] for _ in requests], 0
    while queue or any(slots):
        for s in range(SLOTS):  # admit a waiting request into each free slot: its prompt is its first chunk
            if slots[s] is None and queue:
                index, (prompt, new) = queue.popleft()
                slots[s] = [index, list(prompt), new]
        q_lens = [len(slot[1]) if slot else 0 for slot in slots]
        step = table.append(q_lens)
        caches = [paged.schedule(cache, step) for cache in caches]
        tokens = torch.tensor([t for slot in slots if slot for t in slot[1]])
        logits = model(tokens, lambda i, attention, h, caches=caches, n=max(q_lens): attention.paged_step(
            h, caches[i], max_q_len=n)[0])
        last = np.cumsum(q_lens) - 1
        for s, slot in enumerate(slots):
            if slot:
                token = int(logits[last[s]].argmax())
                results[slot[0]].append(token)
                slot[1], slot[2] = [token], slot[2] - 1
                if slot[2] == 0:  # done: its pages back to the pool
                    table.release(s)
                    slots[s] = None
        steps += 1
    return results, steps


def main() -> None:
    model, rng = Decoder(), np.random.default_rng(0)
    requests = [(rng.integers(0, CONFIG["vocab_size"], size=n).tolist(), new)
                for n, new in ((5, 6), (9, 3), (2, 8), (7, 4), (3, 5))]
    served, steps = serve(model, requests)
    for (prompt, new), tokens in zip(requests, served):
        assert tokens == alone(model, prompt, new), (prompt, tokens)
    print(f"{len(requests)} requests served in {steps} steps, {SLOTS} at a time from {NUM_PAGES} pages of "
          f"{PAGE_SIZE}: each request's {sum(new for _, new in requests)} greedy tokens equal to decoding it alone")


if __name__ == "__main__":
    main()
