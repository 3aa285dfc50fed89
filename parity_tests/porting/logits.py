"""What a logit checker reports: per-token KL divergence (mean, and the worst token) and top-k
agreement, PyTorch's logits the reference distribution."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from parity_tests.tool import axis_layouts
from parity_tests.tool.arrays import max_abs_error, relative_error, to_float64


@dataclass(frozen=True)
class LogitMetrics:
    """``kl_mean``/``kl_max``: ``KL(softmax(torch) || softmax(jax))`` per token, ``kl_max_token``
    the ``(batch, position)`` where it is largest; ``top1``: the fraction of tokens whose
    argmax agrees; ``topk``: the mean overlap of the ``k`` most likely tokens (1 = the same sets)."""

    max_abs: float
    relative: float
    kl_mean: float
    kl_max: float
    kl_max_token: tuple[int, ...]
    top1: float
    topk: float
    k: int

    def as_json(self) -> dict:
        return dict(asdict(self), kl_max_token=list(self.kl_max_token))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def metrics(jax_logits, torch_logits, *, k: int = 5, valid: np.ndarray | None = None) -> LogitMetrics:
    """Logits ``(*tokens, vocab)`` of both sides compared; ``valid`` bool ``tokens``-shaped: only those tokens."""
    b = to_float64(torch_logits)
    a = to_float64(axis_layouts.fit(to_float64(jax_logits), b.shape))
    if b.ndim < 2:
        raise ValueError(f"logits must be (*tokens, vocab), got shape {b.shape}")
    kl, top1, overlap = per_token(a, b, k)
    keep = np.ones(kl.shape, bool) if valid is None or valid.shape != kl.shape else valid
    kl_valid = np.where(keep, kl, -np.inf)
    worst = np.unravel_index(int(np.argmax(kl_valid)), kl.shape)
    return LogitMetrics(
        max_abs=max_abs_error(a, b, valid), relative=relative_error(a, b, valid),
        kl_mean=float(kl[keep].mean()), kl_max=float(kl[worst]), kl_max_token=tuple(int(i) for i in worst),
        top1=float(top1[keep].mean()), topk=float(overlap[keep].mean()), k=min(k, b.shape[-1]),
    )


def per_token(a: np.ndarray, b: np.ndarray, k: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token of logits ``a`` (JAX) and ``b`` (PyTorch's, the reference), both ``(*tokens, vocab)``
    float64: ``KL(softmax(b) || softmax(a))``, whether the argmaxes agree, and the overlap of the
    ``k`` most likely tokens (1: the same sets)."""
    la, lb = _log_softmax(a), _log_softmax(b)
    kl = np.sum(np.exp(lb) * (lb - la), axis=-1)
    k = min(k, b.shape[-1])
    top_a = np.argsort(-a, axis=-1, kind="stable")[..., :k]
    top_b = np.argsort(-b, axis=-1, kind="stable")[..., :k]
    overlap = (top_a[..., :, None] == top_b[..., None, :]).any(-1).sum(-1) / k
    return kl, top_a[..., 0] == top_b[..., 0], overlap
