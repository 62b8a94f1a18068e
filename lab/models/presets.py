"""Model presets: a registry of small functions that build a timm model with random weights.

Adding a model is one decorated function (timm's `register_model` idea):

    @register_preset("resnet18")
    def resnet18(num_classes, in_chans, input_size):
        return timm.create_model("resnet18", num_classes=num_classes, in_chans=in_chans)

`input_size` is the image side in pixels, or a language model's context in tokens (`num_classes` is then
the vocabulary size and `in_chans` 0).

The digits presets keep each family's block types (bottleneck residual blocks; MobileNet-v2 inverted
residuals with ReLU6; pre-norm transformer blocks) and shrink depth, width and resolution so that the
whole default study fits a 2-core CPU.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import nn

# timm is imported inside the image presets: importing it (and torchvision) costs ~2 s per training process,
# which a language-model run does not need; torch inside every preset: listing the presets (a study's
# validation, in Snakemake's process) needs no torch.

_PRESETS: dict[str, Callable[..., nn.Module]] = {}


def register_preset(name: str):
    def add(fn):
        if name in _PRESETS:
            raise ValueError(f"model preset {name!r} is already registered")
        _PRESETS[name] = fn
        return fn
    return add


def available_presets() -> list[str]:
    return sorted(_PRESETS)


def create_model(preset: str, num_classes: int, in_chans: int, input_size: int) -> nn.Module:
    if preset not in _PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; available: {', '.join(available_presets())}")
    return _PRESETS[preset](num_classes=num_classes, in_chans=in_chans, input_size=input_size)


# --- full-size presets (configs/imagenet.yaml) --------------------------------------------------------
@register_preset("resnet50")
def resnet50(num_classes, in_chans, input_size):
    import timm
    return timm.create_model("resnet50", pretrained=False, num_classes=num_classes, in_chans=in_chans)


@register_preset("mobilenetv2_100")
def mobilenetv2_100(num_classes, in_chans, input_size):
    import timm
    return timm.create_model("mobilenetv2_100", pretrained=False, num_classes=num_classes, in_chans=in_chans)


@register_preset("vit_small_patch16")
def vit_small_patch16(num_classes, in_chans, input_size):
    import timm
    return timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=num_classes,
                             in_chans=in_chans, img_size=input_size)


# --- CPU-sized presets (configs/default.yaml) ---------------------------------------------------------
@register_preset("resnet50-digits")
def resnet50_digits(num_classes, in_chans, input_size):
    # ResNet-50's bottleneck blocks, one per stage, a quarter of the width.
    from timm.models.resnet import Bottleneck, ResNet
    return ResNet(block=Bottleneck, layers=(1, 1, 1, 1), channels=(16, 32, 64, 128), stem_width=16,
                  num_classes=num_classes, in_chans=in_chans)


@register_preset("mobilenetv2-digits")
def mobilenetv2_digits(num_classes, in_chans, input_size):
    # MobileNet-v2's stages (depthwise-separable stem block, inverted residuals, expansion 6, ReLU6) with one
    # block per stage, width x0.35, and the last two downsamplings removed so a 32 px input keeps 4x4 maps.
    from timm.models._efficientnet_builder import decode_arch_def, round_channels
    from timm.models.efficientnet import EfficientNet
    from torch import nn
    arch = [["ds_r1_k3_s1_c16"], ["ir_r1_k3_s2_e6_c24"], ["ir_r1_k3_s2_e6_c32"], ["ir_r1_k3_s2_e6_c64"],
            ["ir_r1_k3_s1_e6_c96"], ["ir_r1_k3_s1_e6_c160"], ["ir_r1_k3_s1_e6_c320"]]
    round_chs = partial(round_channels, multiplier=0.35)
    return EfficientNet(block_args=decode_arch_def(arch), num_features=round_chs(1280), stem_size=32,
                        round_chs_fn=round_chs, act_layer=nn.ReLU6, num_classes=num_classes, in_chans=in_chans)


@register_preset("vit-tiny-digits")
def vit_tiny_digits(num_classes, in_chans, input_size):
    # A ViT-Tiny-like encoder (pre-norm blocks, class token), 4 blocks of width 96; patch 4 on 16 px.
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=input_size, patch_size=4, in_chans=in_chans, num_classes=num_classes,
                             embed_dim=96, depth=4, num_heads=3, mlp_ratio=2.0)


# --- language models (data: pydoc or text) -------------------------------------------------------------
@register_preset("gpt2-small")
def gpt2_small(num_classes, in_chans, input_size):
    # GPT-2 small's shape (124M parameters with GPT-2's 50257-token vocabulary): 12 layers, 12 heads, 768
    from lab.models.gpt import GPTConfig
    return GPTConfig(vocab_size=num_classes, context=input_size, n_layer=12, n_head=12, d_model=768).build()


@register_preset("gpt-tiny")
def gpt_tiny(num_classes, in_chans, input_size):
    # The CPU study's decoder: GPT-2's blocks (pre-norm, causal attention, GELU MLP, tied head), 2 x 64 wide
    from lab.models.gpt import GPTConfig
    return GPTConfig(vocab_size=num_classes, context=input_size, n_layer=2, n_head=4, d_model=64).build()


@register_preset("hf-causal-lm")
def hf_causal_lm(num_classes, in_chans, input_size):
    # A family fine-tuned from a local Hugging Face folder (models.X.finetune.base_model): the folder is the model
    raise ValueError("preset hf-causal-lm is a model loaded from models.<family>.finetune.base_model (a local "
                     "Hugging Face folder); give the family a finetune.base_model")


# --- vision-language (data: digits-vqa) ---------------------------------------------------------------------
@register_preset("vlm-digits")
def vlm_digits(num_classes, in_chans, input_size):
    # vit-tiny-digits' encoder (models.<family>.encoder loads a pre-trained one) feeding gpt-tiny's decoder
    from lab.models.multimodal import VLMConfig
    cfg = VLMConfig(vocab_size=num_classes, image_size=input_size, in_chans=in_chans)
    return cfg.build(create_model(cfg.encoder_preset, num_classes=cfg.encoder_classes, in_chans=in_chans,
                                  input_size=input_size))
