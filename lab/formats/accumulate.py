"""The accumulation of an emulated FP8 GEMM: FP32 (the lab's contract), or a model of Hopper's FP8 tensor cores.

The lab's emulated GEMM multiplies dequantized FP8 operands with ``torch.mm``: every product and every partial sum in
FP32 (round to nearest). An H100's FP8 GEMM does not: its tensor cores add products in a narrower fixed-point
accumulator, and kernels that care (CUTLASS's "promotion", DeepSeek-V3's N_C = 128) add that accumulator into an FP32
one on the CUDA cores every so many products.

The model ("fast"; Fasi et al. 2021 for the structure, DeepSeek-V3 arXiv:2412.19437 for the width). The running sum
S (the MMA's C input) and the next `group` products of each output are one multi-operand addition:
  1. every product is exact (E4M3 x E4M3 has 8 significant bits; here in FP32 where exact, else in FP64);
  2. all `group` + 1 addends are aligned to one exponent e: the largest sum of a product's two operand exponents
     (an FP8 subnormal counted at its format's smallest normal exponent: gemm's a_floor, b_floor) or S's leading bit,
     whichever is larger. Not the largest product's leading bit: where two significands multiply to 2 or more the
     product leads at 2^(e + 1), and the hardware's grid stays that of 2^e (recorded H100 bits, field notes 13; the
     rule before, the product's, made the grid twice too coarse there). Each addend is cut toward zero to the grid
     2^(e - frac_bits) (the bits shifted out are dropped, no guard, round or sticky bits: Fasi et al.'s finding for
     Volta/Ampere, kept here for Hopper);
  3. the aligned addends are summed exactly (a wide adder), the sum normalised, and its significand again cut toward
     zero to `frac_bits` fraction bits: the new S. A carry out of the top bit therefore loses a low bit too.
"promote": the same accumulator, started from zero every `promote_every` products; its value is then added into an
FP32 accumulator (one FP32 add, round to nearest: the partial sum has <= frac_bits + 1 bits, exact in FP32).
k_splits (cuBLAS's split-K, chosen by cuBLAS for some shapes: on the H100 M = N = 64 or 128 with K = 8192, three
ways): K cut into that many contiguous parts, each accumulated as above, their results added in FP32 in order.

Parameters and what they are fitted to (benchmarks/fp8/accumulator_error.py, results/fp8/accumulator_error.md):
  * frac_bits = 13 (an e8m13 accumulator; DeepSeek's "about 14 bits" counts the leading one) is FITTED to the
    all-positive fast-accumulation errors (K = 512, 1024, 4096: 0.65%, 1.5%, 6.9%), which depend on frac_bits almost
    alone (relative error ~ K 2^-frac_bits / 6: every product loses on average half a unit in the last place of the
    growing sum); 12 and 14 miss them by a factor of ~2 either way. group = 32 is not fitted (those errors barely
    move between 16 and 64): it is a Hopper FP8 wgmma instruction's k.
  * The random-normal errors (fast and promoted, K = 1024..8192, median and largest over the largest output) were
    not used to choose the parameters: they are the model's PREDICTIONS, compared in the same table.
On the CPU the model runs fused once a GEMM shape is hot (`_model`, lab/formats/kernels.py: its products never
stored, ~5x faster, the same bits as its eager steps, probed per shape and tested).
Against the hardware: with the exponent-sum rule the model reproduced recorded H100 FP8 GEMM bits in every case tried
(8, field notes 13; those bits are not in this repository, so no test replays them); with the product rule it gave
the hardware's bits for all-positive sums (where S leads every step but the first) but only 60-68% of them for
signed operands of mixed magnitude. Not established: ties, the order inside an instruction, whether a zero operand
counts at the minimum exponent (here it never sets the alignment), cuBLAS's split boundaries, and any shape or kernel
not tried. Scales: the model applies them inside the products (operands are dequantized values). For a per-tensor or
per-row scale that is a power of two this is what the hardware does; a block scale that varies along K is, on the
hardware, applied at promotion (DeepSeek), which this model does not separate. An FP8 subnormal counts at its
format's smallest normal exponent only where the caller passes the floor (the operand's scale shifts it): the
recipes' layers (lab/fp8/linear.py) do not, so there a subnormal element counts at its own exponent.
"""
from __future__ import annotations

import torch

from lab.formats.kernels import fused, fusing

MODES = ("fp32", "fast", "promote")
FRAC_BITS = 13  # fraction bits of the aligned addends and of the running sum (fitted; see above)
GROUP = 32      # products added per MMA step (one FP8 wgmma's k on Hopper)
PROMOTE_EVERY = 128  # DeepSeek-V3's N_C: 4 wgmma instructions of k = 32
CHUNK_ELEMENTS = 1 << 19  # products held at once (2-4 MiB): see gemm
#: calls of one GEMM shape before its model is compiled (lab/formats/kernels.py): compiling costs ~1-3 s, a call
#: compiled saves ~5-20 ms of the eager model's ~7-26 ms on the LM's shapes, so within a 300-step run it pays
HOT_AFTER = 50
#: an FP8 format's smallest normal exponent: where the tensor core counts its subnormals (gemm's a_floor, b_floor)
MIN_EXPONENT = {"e4m3": -6, "e5m2": -14}
ZERO_EXPONENT = -2000  # a zero operand's: its products never set a step's alignment (below any zero sum's lead)


def _cut(x: torch.Tensor, lead: torch.Tensor, frac_bits: int) -> torch.Tensor:
    """x cut toward zero to the grid of 2^(lead - frac_bits): its bits below `frac_bits` fraction bits of a number
    whose leading bit is 2^lead. In x's dtype: scaling by a power of two in range is exact (_lead keeps the unit
    finite), and trunc is round toward zero."""
    unit = torch.exp2((frac_bits - lead).to(x.dtype))
    return torch.trunc(x * unit) / unit


def _lead(x: torch.Tensor) -> torch.Tensor:
    """The exponent of x's leading bit (x = m 2^lead, 1 <= |m| < 2); zero gets one below every other (it never
    leads): -1000 in FP64, -100 in FP32, where the unit 2^(frac_bits - lead) must stay finite (gemm's range check
    keeps every non-zero FP32 lead above it: products >= 2^-80, cut < 40 bits below them)."""
    zero = -100 if x.dtype == torch.float32 else -1000
    if fusing():  # normal or zero (the model's range in either dtype): the exponent bits, frexp's, and they fuse
        if x.dtype == torch.float32:
            return torch.where(x == 0, zero, ((x.view(torch.int32) >> 23) & 0xFF) - 127)
        return torch.where(x == 0, zero, ((x.view(torch.int64) >> 52) & 0x7FF) - 1023)
    _, e = torch.frexp(x)  # x = m 2^e with 0.5 <= |m| < 1
    return torch.where(x == 0, torch.full_like(e, zero), e - 1)


def _fp32_exact(x: torch.Tensor) -> bool:
    """Whether products of such values (FP32, finite) are exact in FP32, and the model's scaled addends in range
    there: each non-zero one normal with at most 12 significant bits (its 11 lowest mantissa bits zero; an E4M3
    value times a power-of-two scale has 4) and its leading bit 2^-40..2^40. Read from the bits: one pass of
    integer steps, ~8x faster than frexp and masking (the check runs on both operands of every call)."""
    bits = x.view(torch.int32)
    lead = ((bits >> 23) & 0xFF) - 127  # a subnormal's field (0) reads -127: out of range, as it is
    return bool((((bits & 0x7FF) == 0) & (lead.abs() <= 40) | (x == 0)).all())


def _exponents(x: torch.Tensor, floor) -> torch.Tensor:
    """Each operand element's exponent as the hardware counts it in a step's alignment (int32, x's shape): its
    leading bit's, at least `floor` (an int or a tensor broadcastable to x; None: no floor), because the tensor core
    takes an FP8 subnormal at its format's smallest normal exponent (an exponent field of 0 reads as 1, field notes
    13); a zero element gets ZERO_EXPONENT, so that no product with it ever sets the alignment."""
    e = _lead(x).to(torch.int32)
    if floor is not None:
        e = torch.maximum(e, torch.as_tensor(floor, dtype=torch.int32))
    return torch.where(x == 0, ZERO_EXPONENT, e)


def _accumulate(a: torch.Tensor, b: torch.Tensor, ea: torch.Tensor, eb: torch.Tensor, s: torch.Tensor, group: int,
                frac_bits: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Add the products of a (M,k) and b (k,N) into the running sums s (M,N), `group` at a time, by the model; ea
    and eb are a's and b's exponents (_exponents). a, b and s share a dtype in which every product is exact (FP64
    always; FP32 where _fp32_exact says so). Returns the new sums and, per step, its alignment unit
    2^(frac_bits - lead) and its new sums (M,N each): see _model."""
    fused_ = fusing()  # fused: functional steps, the products never stored (each of the kernel's loops recomputes)
    buf = None if fused_ else torch.empty(s.shape[0], group, s.shape[1], dtype=a.dtype, device=a.device)
    ebuf = None if fused_ else torch.empty(s.shape[0], group, s.shape[1], dtype=torch.int32, device=a.device)
    whole = torch.int32 if a.dtype == torch.float32 else torch.int64  # holds frac_bits + 2 + log2(group + 1) bits
    steps = []
    for k0 in range(0, a.shape[1], group):
        # (M, g, N) products and exponent sums: one MMA step's addends for every output at once
        if fused_:
            p = a[:, k0:k0 + group, None] * b[None, k0:k0 + group, :]
            e = ea[:, k0:k0 + group, None] + eb[None, k0:k0 + group, :]
        else:  # into buffers reused each step
            p = buf[:, :min(group, a.shape[1] - k0)]
            e = ebuf[:, :p.shape[1]]
            torch.mul(a[:, k0:k0 + group, None], b[None, k0:k0 + group, :], out=p)
            torch.add(ea[:, k0:k0 + group, None], eb[None, k0:k0 + group, :], out=e)
        # the hardware aligns to the largest sum of the operands' exponents (not the largest product's leading bit,
        # one higher where two significands multiply to 2 or more: field notes 13) or the running sum's leading bit,
        # whichever is larger: the grid 2^(lead - frac_bits). Scaling by 2^(frac_bits - lead) (a power of two:
        # exact) makes that grid the integers, and trunc drops what is below (an all-zero step's lead is the zero
        # sum's, whose unit is finite, and leaves its zeros zero)
        lead = torch.maximum(e.amax(dim=1), _lead(s).to(torch.int32))
        unit = torch.exp2((frac_bits - lead).to(p.dtype))
        steps.append(unit)
        # the aligned addends are integers below 2^(frac_bits + 2) (a product may lead one bit above the alignment):
        # their sum is exact (frac_bits + 2 + log2(group + 1) bits, <= 24 where FP32 is used, else <= 53), as the
        # hardware's wide adder is. Cut toward zero by the conversion to an integer (C's truncation: trunc's values,
        # ~10x faster than trunc_ on the CPU) and summed in integers, exact either way (finite operands: gemm checks)
        aligned = p * unit[:, None, :] if fused_ else p.mul_(unit[:, None, :])
        ints = aligned.to(whole).sum(dim=1, dtype=whole) + (s * unit).to(whole)
        total = ints.to(p.dtype) / unit
        s = _cut(total, _lead(total), frac_bits)  # normalise, then cut toward zero again
        steps.append(s)
    return s, steps


def gemm(a: torch.Tensor, b: torch.Tensor, accumulate: str = "fp32", promote_every: int = PROMOTE_EVERY,
         group: int = GROUP, frac_bits: int = FRAC_BITS, k_splits: int = 1, a_floor=None,
         b_floor=None) -> torch.Tensor:
    """a (M,K) @ b (K,N) for FP32 operands holding dequantized FP8 values, accumulated as `accumulate` says:
    fp32: torch.mm(a, b), bit for bit (the lab's contract); fast: the tensor-core model above, never promoted;
    promote: the model's partial sum added into an FP32 accumulator every `promote_every` products (a multiple of
    `group`, as a kernel promotes after whole MMA instructions). Returns FP32 (M,N).
    k_splits: K cut into that many contiguous parts (_parts), each accumulated on its own, their results added in
    FP32 in order (cuBLAS's split-K, reduced in the compute type: FP32 for FP8 GEMMs); 1: one chain (the default).
    a_floor, b_floor: the exponent below which an element of a (b) counts at that exponent in a step's alignment:
    the element format's smallest normal exponent (MIN_EXPONENT: E4M3 -6, E5M2 -14) plus log2 of the operand's
    power-of-two scale, an int or a tensor broadcastable to the operand; None (the default): every element at its
    own exponent (dequantized operands whose scale the caller does not pass: only FP8 subnormals differ)."""
    if accumulate not in MODES:
        raise ValueError(f"accumulate={accumulate!r}: one of {MODES}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm needs (M,K) and (K,N) operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"gemm takes FP32 operands (dequantized values), got {a.dtype} and {b.dtype}")
    if not isinstance(k_splits, int) or k_splits < 1:
        raise ValueError(f"k_splits={k_splits!r}: a positive integer")
    if accumulate == "fp32":
        return _add_parts([torch.mm(a[:, k], b[k]) for k in _parts(a.shape[1], k_splits, 1)])
    if not 1 <= group <= 4096 or not 1 <= frac_bits <= 36:
        raise ValueError(f"group={group}, frac_bits={frac_bits}: 1 <= group <= 4096, 1 <= frac_bits <= 36 (FP64 exact)")
    if accumulate == "promote" and (promote_every < 1 or promote_every % group):
        raise ValueError(f"promote_every={promote_every} must be a positive multiple of group={group}")
    # the model is of finite values (its integer sums have no NaN): an output a non-finite operand reaches is NaN
    if not bool(a.isfinite().all() and b.isfinite().all()):
        bad_rows, bad_cols = ~a.isfinite().all(dim=1), ~b.isfinite().all(dim=0)
        out = gemm(a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0), accumulate, promote_every, group,
                   frac_bits, k_splits, a_floor, b_floor)
        out[bad_rows] = float("nan")
        out[:, bad_cols] = float("nan")
        return out
    # FP32 where it is exact (E4M3 operands: about twice as fast as FP64), FP64 otherwise (24 + 24 bits <= 53)
    fp32 = (group + 1) << (frac_bits + 2) <= 1 << 24 and _fp32_exact(a) and _fp32_exact(b)
    dtype = torch.float32 if fp32 else torch.float64
    # contiguous: the fused model reads b along N in its vector loops (a transposed weight, strided, ran ~8x slower)
    a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
    ea, eb = _exponents(a, a_floor), _exponents(b, b_floor)
    step = promote_every if accumulate == "promote" else group
    return _add_parts([_model(a[:, k].contiguous(), b[k], ea[:, k].contiguous(), eb[k], accumulate, promote_every,
                              group, frac_bits)[0] for k in _parts(a.shape[1], k_splits, step)])


def _parts(k: int, k_splits: int, step: int) -> list[slice]:
    """K cut into k_splits contiguous parts of ceil(K / k_splits) rounded up to a multiple of `step` (an MMA step, or
    a promotion block, never straddles two parts), the last one shorter (fewer parts where K is short). Which
    boundaries cuBLAS chooses was not recorded: this is the plain rule."""
    size = -(-k // k_splits)  # ceil(K / k_splits)
    size = -(-size // step) * step
    return [slice(k0, min(k0 + size, k)) for k0 in range(0, k, size)] or [slice(0, 0)]


def _add_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """The split parts' results added in FP32 in order (round to nearest each add); one part is returned as is."""
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


def _probe(a, b, ea, eb, accumulate, promote_every, group, frac_bits) -> list[tuple]:
    """Operand pairs of a and b's shapes, exact in FP32 as gemm's FP32 path needs (E4M3 values times powers of two,
    products 2^-46..2^27), for `fused` to compare the compiled model with the eager one: random signs and
    magnitudes spread along k (alignment shifts past frac_bits inside a step), all positive (growing sums: carries
    out of the top bit), and products cancelling in pairs with a zero row and column (all-zero steps, zero sums);
    each pair's exponents without a floor, the first pair's also with floors that lift its smaller elements (an FP8
    subnormal counted at its format's smallest normal exponent). From a generator of their own."""
    (m, k), n = a.shape, b.shape[1]
    g = torch.Generator().manual_seed(0)

    def e4m3(x):
        return (x * (448.0 / x.abs().amax().clamp(min=1e-30))).to(torch.float8_e4m3fn).float()
    pa = e4m3(torch.randn(m, k, generator=g)) * torch.exp2(torch.randint(-16, 12, (m, k), generator=g).float())
    pb = e4m3(torch.randn(k, n, generator=g)) * torch.exp2(torch.randint(-12, 1, (k, n), generator=g).float())
    ca, cb = pa.clone(), pb.clone()
    pairs = k - k % 2
    ca[:, 1:pairs:2], cb[1:pairs:2] = -ca[:, 0:pairs:2], cb[0:pairs:2]
    ca[0], cb[:, 0] = 0.0, 0.0
    floors = [(None, None), (None, None), (None, None), (-4, -8)]
    pairs = [(pa, pb), (pa.abs(), pb.abs()), (ca, cb), (pa, pb)]
    if a.dtype == torch.float64:  # FP64's operands: FP32 values of 24 significant bits (a scale not a power of two)
        pairs.append((pa * 0.7316, pb * 1.2437))
        floors.append((None, None))
    return [(x, y, _exponents(x, fa), _exponents(y, fb), accumulate, promote_every, group, frac_bits)
            for (x, y), (fa, fb) in zip(pairs, floors)]


@fused(_probe, after=HOT_AFTER)
def _model(a: torch.Tensor, b: torch.Tensor, ea: torch.Tensor, eb: torch.Tensor, accumulate: str, promote_every: int,
           group: int, frac_bits: int) -> tuple[torch.Tensor, ...]:
    """gemm's fast or promote accumulation (operands already in the exact dtype, with their exponents: _exponents):
    the (M,N) FP32 result, then each MMA step's alignment units and sums. Eager, in chunks of rows whose (rows,
    group, N) products stay in a core's L2 cache (every output row is independent; the model's passes over its
    products run ~3x faster there than through memory, LM shapes, AMD EPYC). Fused (lab/formats/kernels.py): whole,
    the products never stored; the steps' units and sums are returned because a kernel output gets a loop of its
    own, where inlined into the products' loops each was recomputed for every product (the units: ~2.5x the
    kernel's time)."""
    rows = a.shape[0] if fusing() else max(8, CHUNK_ELEMENTS // (group * b.shape[1]))
    parts = [_rows(a[m0:m0 + rows], b, ea[m0:m0 + rows], eb, accumulate, promote_every, group, frac_bits)
             for m0 in range(0, a.shape[0], rows)]
    return parts[0] if len(parts) == 1 else tuple(torch.cat(t) for t in zip(*parts))


def _rows(a: torch.Tensor, b: torch.Tensor, ea: torch.Tensor, eb: torch.Tensor, accumulate: str, promote_every: int,
          group: int, frac_bits: int) -> tuple[torch.Tensor, ...]:
    """_model of a few output rows."""
    zero = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    if accumulate == "fast":
        s, steps = _accumulate(a, b, ea, eb, zero, group, frac_bits)
        return (s.float(), *steps)  # <= frac_bits + 1 bits: exact in FP32
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    steps = []
    for k0 in range(0, a.shape[1], promote_every):
        k = slice(k0, k0 + promote_every)
        part, block_steps = _accumulate(a[:, k], b[k], ea[:, k], eb[k], zero, group, frac_bits)
        acc = acc + part.float()  # the CUDA cores' FP32 add, round to nearest
        steps += block_steps
    return (acc, *steps)
