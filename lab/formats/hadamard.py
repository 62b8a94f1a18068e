"""The random Hadamard transform (RHT) of NVFP4's weight-gradient GEMM (arXiv:2509.25149): each run of 16 values along
k is multiplied by Q = diag(signs) H16 / 4, H16 the Sylvester Hadamard matrix and signs a random +-1 vector.

Q is orthogonal (Q Q^T = diag(s) H H^T diag(s) / 16 = I), so transforming both operands of a GEMM along k, A -> A Q
and B -> Q^T B (the same map v -> v Q on every length-16 run of every vector along k), leaves A B unchanged in exact
arithmetic; what changes is the distribution each quantizer sees: outliers are spread over their block, which the
paper's 16-value FP4 blocks (few levels) tolerate better.
"""
from __future__ import annotations

import functools

import torch

BLOCK = 16


@functools.lru_cache(maxsize=16)
def hadamard_matrix(n: int = BLOCK, dtype=torch.float32, device=None) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries +-1; n a power of two), unnormalised. Built once per (n, dtype,
    device), not on every operand of every step: callers must not modify it."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs n a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_signs(n: int = BLOCK, generator: torch.Generator | None = None) -> torch.Tensor:
    """n random signs (+-1.0, FP32) drawn from `generator`: the diagonal of the transform's sign matrix. One draw
    serves both operands of a GEMM (the product stays exact only if they share it)."""
    return torch.randint(0, 2, (n,), generator=generator).to(torch.float32) * 2 - 1


def random_hadamard(x: torch.Tensor, k_dim: int, signs: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (2-D) with every run of len(signs) values along k_dim mapped v -> v diag(signs) H / sqrt(n), computed and
    returned in `dtype` (default x's; a BF16 operand in FP32: exact)."""
    n = signs.numel()
    dtype = dtype or x.dtype
    if x.dim() != 2:
        raise ValueError(f"random_hadamard takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.shape[k_dim] % n:
        raise ValueError(f"the random Hadamard transform works in runs of {n} along k: dimension {k_dim} of shape "
                         f"{tuple(x.shape)} is not a multiple of {n}")
    q = signs.to(dtype).unsqueeze(1) * hadamard_matrix(n, dtype, x.device) / n ** 0.5
    # one mm over every run (k made contiguous first, in x's own dtype: a transposing copy of BF16 moves half the
    # bytes of FP32's; then converted): a batched matmul of the runs costs 2-5x as much on the CPU for k_dim 0, with
    # the same bits (each output the same 16 products summed by the same kernel)
    xk = x.movedim(k_dim, -1).contiguous().to(dtype)
    return torch.mm(xk.view(-1, n), q).view(xk.shape).movedim(-1, k_dim)
