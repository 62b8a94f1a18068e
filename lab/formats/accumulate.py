"""The accumulation of an emulated FP8 GEMM: FP32 (the lab's contract), or a model of Hopper's FP8 tensor cores.

The lab's emulated GEMM multiplies dequantized FP8 operands with ``torch.mm``: every product and every partial sum in
FP32 (round to nearest). An H100's FP8 GEMM does not: its tensor cores add products in a narrower fixed-point
accumulator, and kernels that care (CUTLASS's "promotion", DeepSeek-V3's N_C = 128) add that accumulator into an FP32
one on the CUDA cores every so many products.

The model ("fast"; Fasi et al. 2021 for the structure, DeepSeek-V3 arXiv:2412.19437 for the width). The running sum
S (the MMA's C input) and the next `group` products of each output are one multi-operand addition:
  1. every product is exact (E4M3 x E4M3 has 8 significant bits; here in FP32 where exact, else in FP64);
  2. all `group` + 1 addends are aligned to the largest exponent among them (leading bit 2^e) and each one's
     significand is cut to `frac_bits` bits below that leading bit, toward zero (the bits shifted out are dropped,
     no guard, round or sticky bits: Fasi et al.'s finding for Volta/Ampere, kept here for Hopper);
  3. the aligned addends are summed exactly (a wide adder), the sum normalised, and its significand again cut toward
     zero to `frac_bits` fraction bits: the new S. A carry out of the top bit therefore loses a low bit too.
"promote": the same accumulator, started from zero every `promote_every` products; its value is then added into an
FP32 accumulator (one FP32 add, round to nearest: the partial sum has <= frac_bits + 1 bits, exact in FP32).

Parameters and what they are fitted to (benchmarks/fp8/accumulator_error.py, results/fp8/accumulator_error.md):
  * frac_bits = 13 (an e8m13 accumulator; DeepSeek's "about 14 bits" counts the leading one) is FITTED to the
    all-positive fast-accumulation errors (K = 512, 1024, 4096: 0.65%, 1.5%, 6.9%), which depend on frac_bits almost
    alone (relative error ~ K 2^-frac_bits / 6: every product loses on average half a unit in the last place of the
    growing sum); 12 and 14 miss them by a factor of ~2 either way. group = 32 is not fitted (those errors barely
    move between 16 and 64): it is a Hopper FP8 wgmma instruction's k.
  * The random-normal errors (fast and promoted, K = 1024..8192, median and largest over the largest output) were
    not used to choose the parameters: they are the model's PREDICTIONS, compared in the same table.
The model is not bit-exact to the hardware (no claim on ties, subnormals, the order inside an instruction, or the
exact width of the aligned addends); it is a statistical model of the error's size, growth with K and bias toward
zero. Scales: the model applies them inside the products (operands are dequantized values). For a per-tensor or
per-row scale that is a power of two this is what the hardware does; a block scale that varies along K is, on the
hardware, applied at promotion (DeepSeek), which this model does not separate.
"""
from __future__ import annotations

import torch

MODES = ("fp32", "fast", "promote")
FRAC_BITS = 13  # fraction bits of the aligned addends and of the running sum (fitted; see above)
GROUP = 32      # products added per MMA step (one FP8 wgmma's k on Hopper)
PROMOTE_EVERY = 128  # DeepSeek-V3's N_C: 4 wgmma instructions of k = 32
CHUNK_ELEMENTS = 1 << 19  # products held at once (2-4 MiB): see gemm


def _cut(x: torch.Tensor, lead: torch.Tensor, frac_bits: int) -> torch.Tensor:
    """x cut toward zero to the grid of 2^(lead - frac_bits): its bits below `frac_bits` fraction bits of a number
    whose leading bit is 2^lead. Scaling by powers of two is exact in FP64, and trunc is round toward zero."""
    unit = torch.exp2((frac_bits - lead).double())
    return torch.trunc(x * unit) / unit


def _lead(x: torch.Tensor) -> torch.Tensor:
    """The exponent of x's leading bit (x = m 2^lead, 1 <= |m| < 2); zero gets a very small one (it never leads)."""
    _, e = torch.frexp(x)  # x = m 2^e with 0.5 <= |m| < 1
    return torch.where(x == 0, torch.full_like(e, -1000), e - 1)


def _fp32_exact(x: torch.Tensor) -> bool:
    """Whether products of such values are exact in FP32, and the model's scaled addends in range there: at most 12
    significant bits (an E4M3 value times a power-of-two scale has 4) and magnitudes within [2^-40, 2^40]."""
    nz = x[x != 0].double()
    if nz.numel() == 0:
        return True
    lead = _lead(nz)
    return bool((lead.abs() <= 40).all() and torch.equal(nz * torch.exp2((11 - lead).double()),
                                                         torch.trunc(nz * torch.exp2((11 - lead).double()))))


def _accumulate(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor, group: int, frac_bits: int) -> torch.Tensor:
    """Add the products of a (M,k) and b (k,N) into the running sums s (M,N), `group` at a time, by the model.
    a, b and s share a dtype in which every product is exact (FP64 always; FP32 where _fp32_exact says so)."""
    buf = torch.empty(s.shape[0], group, s.shape[1], dtype=a.dtype, device=a.device)  # reused: no allocation a step
    whole = torch.int32 if a.dtype == torch.float32 else torch.int64  # holds frac_bits + 1 + log2(group + 1) bits
    for k0 in range(0, a.shape[1], group):
        # (M, g, N) products: one MMA step's addends for every output at once
        p = buf[:, :min(group, a.shape[1] - k0)]
        torch.mul(a[:, k0:k0 + group, None], b[None, k0:k0 + group, :], out=p)
        top = torch.maximum(torch.maximum(p.amax(dim=1), p.amin(dim=1).neg_()), s.abs())  # max |.| without abs()
        # the largest exponent among the products and the running sum sets the grid 2^(lead - frac_bits); scaling
        # by 2^(frac_bits - lead) (a power of two: exact) makes that grid the integers, and trunc drops what is below.
        # In FP32 an all-zero step's lead (-1000) is clamped to keep the unit finite (any finite unit leaves zeros
        # zero); the range check keeps every non-zero lead above -100 (products >= 2^-80, cut < 40 bits below them)
        lead = _lead(top).clamp(min=-100) if p.dtype == torch.float32 else _lead(top)
        unit = torch.exp2((frac_bits - lead).to(p.dtype))
        # the aligned addends are integers below 2^(frac_bits + 1): their sum is exact (frac_bits + 1 +
        # log2(group + 1) bits, <= 24 where FP32 is used, else <= 53), as the hardware's wide adder is. Cut toward
        # zero by the conversion to an integer (C's truncation: trunc's values, ~10x faster than trunc_ on the CPU)
        # and summed in integers, exact either way (finite operands: gemm checks)
        ints = p.mul_(unit[:, None, :]).to(whole).sum(dim=1, dtype=whole) + (s * unit).to(whole)
        total = ints.to(p.dtype) / unit
        s = _cut(total, _lead(total), frac_bits).to(p.dtype)  # normalise, then cut toward zero again
    return s


def gemm(a: torch.Tensor, b: torch.Tensor, accumulate: str = "fp32", promote_every: int = PROMOTE_EVERY,
         group: int = GROUP, frac_bits: int = FRAC_BITS) -> torch.Tensor:
    """a (M,K) @ b (K,N) for FP32 operands holding dequantized FP8 values, accumulated as `accumulate` says:
    fp32: torch.mm(a, b), bit for bit (the lab's contract); fast: the tensor-core model above, never promoted;
    promote: the model's partial sum added into an FP32 accumulator every `promote_every` products (a multiple of
    `group`, as a kernel promotes after whole MMA instructions). Returns FP32 (M,N)."""
    if accumulate not in MODES:
        raise ValueError(f"accumulate={accumulate!r}: one of {MODES}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm needs (M,K) and (K,N) operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"gemm takes FP32 operands (dequantized values), got {a.dtype} and {b.dtype}")
    if accumulate == "fp32":
        return torch.mm(a, b)
    if not 1 <= group <= 4096 or not 1 <= frac_bits <= 36:
        raise ValueError(f"group={group}, frac_bits={frac_bits}: 1 <= group <= 4096, 1 <= frac_bits <= 36 (FP64 exact)")
    # the model is of finite values (its integer sums have no NaN): an output a non-finite operand reaches is NaN
    bad_rows, bad_cols = ~a.isfinite().all(dim=1), ~b.isfinite().all(dim=0)
    if bool(bad_rows.any() or bad_cols.any()):
        out = gemm(a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0), accumulate, promote_every, group,
                   frac_bits)
        out[bad_rows] = float("nan")
        out[:, bad_cols] = float("nan")
        return out
    # FP32 where it is exact (E4M3 operands: about twice as fast as FP64), FP64 otherwise (24 + 24 bits <= 53)
    fp32 = (group + 1) << (frac_bits + 1) <= 1 << 24 and _fp32_exact(a) and _fp32_exact(b)
    dtype = torch.float32 if fp32 else torch.float64
    a64, b64 = a.to(dtype), b.to(dtype)
    if accumulate == "promote" and (promote_every < 1 or promote_every % group):
        raise ValueError(f"promote_every={promote_every} must be a positive multiple of group={group}")
    # Rows in chunks whose (rows, group, N) products stay in a core's L2 cache: every output row is independent, and
    # the model's six passes over its products run ~3x faster there than through memory (LM shapes, AMD EPYC)
    rows = max(8, CHUNK_ELEMENTS // (group * b.shape[1]))
    return torch.cat([_rows(a64[m0:m0 + rows], b64, accumulate, promote_every, group, frac_bits)
                      for m0 in range(0, a.shape[0], rows)])


def _rows(a: torch.Tensor, b: torch.Tensor, accumulate: str, promote_every: int, group: int,
          frac_bits: int) -> torch.Tensor:
    """gemm's fast or promote accumulation of a few output rows (operands already in the exact dtype)."""
    zero = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    if accumulate == "fast":
        return _accumulate(a, b, zero, group, frac_bits).float()  # <= frac_bits + 1 bits: exact in FP32
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    for k0 in range(0, a.shape[1], promote_every):
        part = _accumulate(a[:, k0:k0 + promote_every], b[k0:k0 + promote_every], zero, group, frac_bits)
        acc = acc + part.float()  # the CUDA cores' FP32 add, round to nearest
    return acc
