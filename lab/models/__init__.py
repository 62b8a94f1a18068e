"""Models: presets.py (the preset registry: `@register_preset`, `create_model`) and gpt.py (the GPT-style decoder
of the language-model family; its gradient checkpointing is lab.numerics.recompute's).
Imports only lab.core and lab.numerics."""
