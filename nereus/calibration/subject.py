"""The model stage timing runs on (``TIMED_MODEL``): shared by both timing backends and the fit."""
from __future__ import annotations

from nereus.models.spec import ModelSpec

TIMED_MODEL = ModelSpec(name="calib-4l-256h", layers=4, hidden=256, ffn=768, heads=8, kv_heads=4, head_dim=32,
                        vocab=2048, dtype_bytes=4)
"""Small enough for a 2-core CPU, large enough that matmuls (not Python) dominate a forward."""
