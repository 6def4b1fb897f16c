"""The executor on Hugging Face model definitions (Llama, Qwen2, Qwen3, Qwen3-MoE): names, checkpoints, scenarios.

Needs ``safetensors`` to read or write files; never ``transformers`` (``arch.hf_config`` imports it
when called). See README.md.
"""
