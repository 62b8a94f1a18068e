"""Models: presets.py (the preset registry: `@register_preset`, `create_model`) and gpt.py (the GPT-style decoder
of the language-model family). Imports only lab.core."""
