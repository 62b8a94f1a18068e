"""A vision-language model in the shape of LLaVA and Qwen-VL, small enough for a CPU: a ViT encoder whose
features are pooled, projected into a GPT-style decoder's width and read by it as a prefix to the question's
tokens; the decoder's last position answers (the source's multimodal case).

    image -> encoder (timm ViT) -> residual stream after the last block, before the final LayerNorm
          -> 2x2 average pooling of the patch tokens (+ the class token) -> projector (Linear)
          -> [visual tokens ; question tokens] -> decoder (GPT blocks, causal) -> logits over the vocabulary

The encoder is the study's own ViT pre-trained on the digits (`models.<family>.encoder`: a run of the study whose
weights it loads), as Qwen-VL's and LLaVA's encoders are pre-trained CLIP models: their features are taken from
the residual stream (hidden states, no final norm), whose spread pre-training has grown. Nothing is scaled by hand:
the spread is what the pre-trained encoder has (docs/multimodal.md measures it: a standard deviation of 0.56 at
timm's initialisation, 3-4 after the pre-training).

Parameter names say the branch: ``encoder.*`` (vision), ``projector.*``, ``decoder.*`` (language).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lab.core import runfiles
from lab.models.gpt import GPT, GPTConfig

BRANCHES = ("encoder", "projector", "decoder")


@dataclass
class VLMConfig:
    vocab_size: int
    image_size: int
    in_chans: int = 1
    question_len: int = 4
    encoder_preset: str = "vit-tiny-digits"
    encoder_classes: int = 10  # the pre-training's classes: the encoder is built as the base run's model
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64

    def build(self, encoder: nn.Module) -> "VisionLanguageModel":
        """The model around ``encoder``: a timm VisionTransformer of ``encoder_preset`` (lab/models/presets.py
        builds it, with ``encoder_classes`` classes, as the encoder's pre-training run has it)."""
        return VisionLanguageModel(self, encoder)


def branch_of(parameter_name: str) -> str:
    """The branch a parameter (or module) belongs to: 'encoder' (vision), 'projector' or 'decoder' (language);
    '' for a name outside the three."""
    head = parameter_name.split(".", 1)[0]
    return head if head in BRANCHES else ""


class VisionLanguageModel(nn.Module):
    def __init__(self, cfg: VLMConfig, encoder: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.encoder = encoder
        # the classifier of the encoder's pre-training and its final norm are not used (features are taken before
        # them): gone, so that every parameter gets a gradient (DDP, the census) and none is trained for nothing
        self.encoder.norm, self.encoder.fc_norm, self.encoder.head = nn.Identity(), nn.Identity(), nn.Identity()
        self.grid = cfg.image_size // self.encoder.patch_embed.patch_size[0]
        pooled = (self.grid // 2) ** 2 + self.encoder.num_prefix_tokens
        self.projector = nn.Linear(self.encoder.embed_dim, cfg.d_model)
        self.decoder = GPT(GPTConfig(vocab_size=cfg.vocab_size, context=pooled + cfg.question_len,
                                     n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model))
        GPT._init(self.projector)  # the decoder's initialisation (normal, std 0.02), as LLaVA's projector has

    def unpack(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, question token ids) from lab/data/vqa.py's packed rows."""
        c, s = self.cfg.in_chans, self.cfg.image_size
        return x[:, :c * s * s].reshape(-1, c, s, s), x[:, c * s * s:].round().long()

    def visual_features(self, images: torch.Tensor) -> torch.Tensor:
        """The encoder's residual stream after its last block (no final norm): (batch, tokens, width)."""
        e = self.encoder
        h = e.norm_pre(e._pos_embed(e.patch_embed(images)))
        for block in e.blocks:
            h = block(h)
        return h

    def visual_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """The features pooled 2x2 over the patch grid (the class token kept) and projected to the decoder."""
        k = self.encoder.num_prefix_tokens
        b, _, w = features.shape
        grid = features[:, k:].transpose(1, 2).reshape(b, w, self.grid, self.grid)
        pooled = F.avg_pool2d(grid, 2).flatten(2).transpose(1, 2)
        return self.projector(torch.cat([features[:, :k], pooled], dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, question = self.unpack(x)
        d = self.decoder
        h = d.hidden(torch.cat([self.visual_tokens(self.visual_features(images)), d.tok(question)], dim=1))
        return d.head(d.ln_f(h[:, -1]))  # the answer: one word from the last position


class EncoderError(ValueError):
    """The pre-trained encoder's weights are missing or do not fit the model's encoder."""


def check_encoder_weights(weights: str) -> Path:
    """The encoder's weights file, or an EncoderError naming where it was expected."""
    path = Path(weights)
    if not path.is_file():
        raise EncoderError(f"models.<family>.encoder: expected the encoder's weights at {path} (its run, trained "
                           "with train.save_weights: true); found nothing there")
    return path


def load_encoder(model: nn.Module, weights: str) -> None:
    """The encoder's weights from a run of its preset (weights.pt of `models.<family>.encoder`'s run). A model
    built on the meta device (sizing, the faults' name check) keeps its place-holders."""
    if not isinstance(model, VisionLanguageModel):
        raise EncoderError(f"models.<family>.encoder: the preset builds a {type(model).__name__}, which has no "
                           "pre-trained encoder to load (a vision-language preset: vlm-digits)")
    if any(p.is_meta for p in model.parameters()):
        return
    path = check_encoder_weights(weights)
    state = runfiles.read_tensors(path, map_location="cpu")  # RunFileError naming a cut or damaged file
    unused = ("norm.", "fc_norm.", "head.")  # the pre-training's final norm and classifier (see __init__)
    try:
        model.encoder.load_state_dict({k: v for k, v in state.items() if not k.startswith(unused)})
    except RuntimeError as e:
        raise EncoderError(f"{path}: the weights do not fit the encoder ({str(e).splitlines()[0]}); the encoder's "
                           f"run must use the preset {model.cfg.encoder_preset!r} with {model.cfg.encoder_classes} "
                           "classes at the same image size") from None
