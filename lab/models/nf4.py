"""A QLoRA base: the frozen base's linear layers in torchao's 4-bit NormalFloat (NF4) format, the rest of the base in
the run's dtype (FP16 for an FP16 mode), LoRA adapters over it (lab/models/lora.py, ``finetune.base_quant: nf4``).

QLoRA (Dettmers et al. 2023) stores each weight as 4-bit codes of the NF4 table, one absmax scale per block of 64
values, the scales themselves quantized to int8 per block of 256 scales ("double quantization"); a forward pass
dequantizes the weight to the compute dtype and runs an ordinary matmul. torchao's ``to_nf4`` builds that tensor
(``NF4Tensor``) and its ``linear_nf4`` is the matmul: F.linear on a layer whose weight is an NF4Tensor routes there.

``NF4Linear`` keeps the NF4Tensor's parts (torchao's own ``__tensor_flatten__``: codes, scales, their factors, the
table) as buffers and gives ``weight`` back as the NF4Tensor (``__tensor_unflatten__``), so that:

* peft wraps it as any ``nn.Linear`` (it is one), and its forward is nn.Linear's: F.linear -> torchao's linear_nf4,
  or under CPU autocast the lab's tensor-core contract on the weight torchao dequantizes (lab/numerics/contract.py);
* its state_dict is plain tensors (the codes, not a tensor subclass): the run's initial-weights digest, checkpoints
  loaded with ``weights_only=True`` and resume work unchanged;
* nothing casts it: ``widened_to_fp32`` and the evaluation casts (lab/models/lora.py) skip ``nf4_storage``, so the
  codes and their dtype are the same in every pass; the weight dequantizes to whatever dtype its input asks for.

The dequantization dtype is the dtype the base had when it was quantized: the mode's (FP16 for FP16 modes, FP32 for
fp32, BF16 for bf16), as a user loads a base in FP16 and quantizes it.
"""
from __future__ import annotations

import torch
from torch import nn

#: QLoRA's block of weights per absmax scale (the paper's and torchao's default)
BLOCK_SIZE = 64
#: QLoRA's block of scales per int8 factor; a layer with fewer blocks (or a count it does not divide) takes the
#: largest power of two that divides its number of blocks (torchao requires a divisor)
SCALER_BLOCK_SIZE = 256
#: ``finetune.base_quant`` values: none (the base in the mode's dtype) or nf4
BASE_QUANTS = ("none", "nf4")


class NF4Error(ValueError):
    """A base that cannot be quantized to NF4: no linear layer to quantize, or a weight NF4's blocks do not tile."""


def scaler_block_size(n_blocks: int) -> int:
    """The scales' block: SCALER_BLOCK_SIZE, or the largest power of two below it that divides ``n_blocks``."""
    size = SCALER_BLOCK_SIZE
    while n_blocks % size:
        size //= 2
    return size


class NF4Linear(nn.Linear):
    """``nn.Linear`` with a frozen NF4 weight (torchao's NF4Tensor, rebuilt from buffers on each access); the bias
    stays a parameter in the base's dtype. Built from a linear layer whose weight is in the dtype to dequantize to."""

    def __init__(self, linear: nn.Linear, block_size: int = BLOCK_SIZE):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight parameter
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if weight.numel() % block_size:
            raise NF4Error(f"a weight of {tuple(weight.shape)} ({weight.numel()} values) is not a whole number of NF4 "
                           f"blocks of {block_size}")
        self.block_size = block_size
        self.scaler_block_size = scaler_block_size(weight.numel() // block_size)
        nf4 = to_nf4(weight.contiguous(), block_size, self.scaler_block_size)
        names, self._meta = nf4.__tensor_flatten__()
        self._names = tuple(names)
        for name in names:
            # fresh row-major copies: torchao leaves a one-element factor strided (its view of a wider tensor),
            # which byte views of the state_dict (the run's weights digest) refuse
            part = getattr(nf4, name)
            fresh = torch.empty(part.shape, dtype=part.dtype, device=part.device).copy_(part)
            self.register_buffer(f"nf4_{name}", fresh)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self):
        """The NF4Tensor, on the buffers' device (torchao's __tensor_unflatten__ of the stored parts)."""
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs
        parts = {name: getattr(self, f"nf4_{name}") for name in self._names}
        meta = dict(self._meta)
        meta["tensor_meta"] = SubclassTensorArgs(torch.Size((self.out_features, self.in_features)),
                                                 (self.in_features, 1), 0, parts["nf4"].dtype,
                                                 parts["quantized_data"].device, False)
        return NF4Tensor.__tensor_unflatten__(parts, meta, None, None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"nf4 blocks {self.block_size}/{self.scaler_block_size}, dequantized to {self.nf4_nf4.dtype}")


def quantize_nf4(model: nn.Module, block_size: int = BLOCK_SIZE) -> dict:
    """Replace every ``nn.Linear`` of ``model`` whose weight no other module shares (a head tied to the embedding
    stays as it is, as QLoRA leaves embeddings and the LM head unquantized) by an NF4Linear, in place. Returns what
    the run records: the method, the block sizes and each layer's scale block."""
    shared = _shared_weights(model)
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and id(m.weight) not in shared]
    if not targets:
        raise NF4Error("finetune.base_quant nf4: the base has no nn.Linear layer of its own to quantize (GPT-2's "
                       "Conv1D layers and a head tied to the embedding are not)")
    layers = {}
    for name, linear in targets:
        parent, _, attr = name.rpartition(".")
        try:
            q = NF4Linear(linear, block_size)
        except NF4Error as e:
            raise NF4Error(f"finetune.base_quant nf4: layer {name}: {e}") from None
        setattr(model.get_submodule(parent) if parent else model, attr, q)
        layers[name] = q.scaler_block_size
    return {"method": "nf4", "block_size": block_size, "scaler_block_sizes": layers,
            "dequantized_to": str(next(iter(_nf4_layers(model))).nf4_nf4.dtype).replace("torch.", "")}


def _shared_weights(model: nn.Module) -> set[int]:
    seen, shared = set(), set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (shared if id(p) in seen else seen).add(id(p))
    return shared


def _nf4_layers(model: nn.Module):
    return (m for m in model.modules() if isinstance(m, NF4Linear))


def nf4_storage(model: nn.Module) -> set[int]:
    """ids of the NF4 layers' stored parts (codes, scales, table): tensors no cast may touch."""
    return {id(b) for m in _nf4_layers(model) for b in m.buffers(recurse=False)}
