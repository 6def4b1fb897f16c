"""What a corpus row names, in the cost model's terms: the architecture behind a model name, the
GPU behind a hardware name, the precision, the engine.

Architectures are the public Hugging Face / framework configs. Models whose MLP has two matrices
(MPT, GPT-2, OPT, GPT-3, Nemotron: GELU, ReLU or squared-ReLU, width 4h) get the SwiGLU width with the same
parameter count, f = 2/3 of theirs, since the cost model's blocks are SwiGLU. Mixture-of-experts
models are not in this catalog (``resolve_model`` skips their rows, with the reason); the rows that
name their own expert layout take the model's preset (``moe_preset``; categories ``moe``, and the
``async`` category's weight-sync rows, whose bytes are all a sync needs).
"""
from __future__ import annotations

import re
from dataclasses import replace

from nereus.errors import SpecError
from nereus.models.spec import ModelSpec, preset
from nereus.planner.specs import GPU_PRESETS, GPUSpec


def _m(name: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int, head_dim: int = 128,
       **kw) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads, vocab=vocab,
                     head_dim=head_dim, **kw)


def _two_matrix(width: int) -> int:
    """SwiGLU width with the parameters of a 2-matrix MLP of ``width``."""
    return round(2 * width / 3)


ARCHITECTURES: dict[str, ModelSpec] = {
    "llama-2-7b": _m("llama-2-7b", 32, 4096, 11008, 32, 32, 32000),
    "llama-2-13b": _m("llama-2-13b", 40, 5120, 13824, 40, 40, 32000),
    "llama-2-70b": _m("llama-2-70b", 80, 8192, 28672, 64, 8, 32000),
    "llama-3-8b": preset("llama-3.1-8b"),
    "llama-3.1-8b": preset("llama-3.1-8b"),
    "llama-3-70b": preset("llama-3.1-70b"),
    "llama-3.1-70b": preset("llama-3.1-70b"),
    "llama-3.3-70b": preset("llama-3.1-70b"),
    "llama-3.1-405b": _m("llama-3.1-405b", 126, 16384, 53248, 128, 8, 128256),
    "mistral-7b": _m("mistral-7b", 32, 4096, 14336, 32, 8, 32000),
    "qwen2-7b": _m("qwen2-7b", 28, 3584, 18944, 28, 4, 152064, qkv_bias=True),
    "qwen2.5-14b": _m("qwen2.5-14b", 48, 5120, 13824, 40, 8, 152064, qkv_bias=True),
    "qwen3-32b": _m("qwen3-32b", 64, 5120, 25600, 64, 8, 151936, qk_norm=True),
    "llama-3.2-1b": preset("llama-3.2-1b"),
    "qwen2.5-0.5b": preset("qwen2.5-0.5b"),
    "qwen2.5-1.5b": preset("qwen2.5-1.5b"),
    "qwen2.5-3b": preset("qwen2.5-3b"),
    "llama-3.2-3b": preset("llama-3.2-3b"),
    "qwen2.5-7b": preset("qwen2.5-7b"),
    "qwen2.5-math-7b": preset("qwen2.5-7b"),
    "qwen2.5-32b": preset("qwen2.5-32b"),
    "qwen2.5-72b": preset("qwen2.5-72b"),
    "qwen3-0.6b": preset("qwen3-0.6b"),
    "gpt2": _m("gpt2", 12, 768, _two_matrix(3072), 12, 12, 50257, 64, tie_embeddings=True),
    "opt-125m": _m("opt-125m", 12, 768, _two_matrix(3072), 12, 12, 50272, 64, tie_embeddings=True),
    "qwen3-4b": preset("qwen3-4b"),
    "qwen3-8b": preset("qwen3-8b"),
    "qwen3-14b": preset("qwen3-14b"),
    "mpt-7b": _m("mpt-7b", 32, 4096, _two_matrix(16384), 32, 32, 50432),
    "mpt-13b": _m("mpt-13b", 40, 5120, _two_matrix(20480), 40, 40, 50368),
    "mpt-30b": _m("mpt-30b", 48, 7168, _two_matrix(28672), 64, 64, 50432, 112),
    "mpt-70b": _m("mpt-70b", 80, 8192, _two_matrix(32768), 64, 64, 50368),
    "gpt3-5b": _m("gpt3-5b", 24, 4096, _two_matrix(16384), 32, 32, 50304),
    "gpt3-20b": _m("gpt3-20b", 44, 6144, _two_matrix(24576), 48, 48, 50304),
    "gpt3-175b": _m("gpt3-175b", 96, 12288, _two_matrix(49152), 96, 96, 50304),
    "nemotron-8b": _m("nemotron-8b", 32, 4096, _two_matrix(16384), 32, 32, 256000),
    "nemotron-22b": _m("nemotron-22b", 40, 6144, _two_matrix(24576), 48, 48, 256000),
    "nemotron-340b": _m("nemotron-340b", 96, 18432, _two_matrix(73728), 96, 8, 256000, 192),
}

HARDWARE_ALIASES = {
    "a100": "a100-80gb",
    "h100": "h100-80gb",
    "h100 (variant not stated)": "h100-80gb",
    "a800": "a800-80gb",
}
FP8_CAPABLE = ("h100-80gb", "h200", "h20", "h800", "mi300x", "l40s")


def model_key(name: str) -> str:
    """'Llama-3.1-8B-Instruct-FP8' -> 'llama-3.1-8b'; 'GPT-3 175B (vocab 131072)' -> 'gpt3-175b'."""
    s = name.lower()
    s = re.sub(r"\(.*?\)", " ", s)
    s = s.replace("gpt-3", "gpt3").replace("gpt3 ", "gpt3-")
    s = re.sub(r"[-_ ](instruct|base|chat|fp8|hf)\b", " ", s)
    s = re.sub(r"\s+", " ", s).strip().replace(" ", "-")
    return s


def resolve_model(name: str, vocab_note: str = "") -> tuple[ModelSpec | None, str]:
    """(architecture, '') or (None, why not)."""
    if not name:
        return None, "no model named"
    if "moe" in name.lower() or "mixtral" in name.lower() or "a3b" in name.lower():
        return None, "mixture-of-experts model: not modelled"
    key = model_key(name)
    m = ARCHITECTURES.get(key)
    if m is None:
        for family in ("llama-2-7b", "llama-2-13b", "llama-2-70b"):  # "Llama-2-7B-class (size 7B ...)"
            if key.startswith(family):
                return ARCHITECTURES[family], ""
        return None, f"architecture of {name!r} not in the catalog"
    vocab = re.search(r"vocab (\d+)", name.lower())
    if vocab:
        m = replace(m, vocab=int(vocab.group(1)))
    return m, ""


def moe_preset(name: str) -> ModelSpec | None:
    """The ``nereus.models`` preset of a mixture-of-experts model name ('Qwen3-30B-A3B (MoE)',
    'Qwen3-235B-A22B', 'Qwen3-30B-A3B-Base' -> its preset), or None where no preset has that name."""
    key = model_key(name).removesuffix("-base")
    try:
        return preset(key)
    except SpecError:
        return None


def resolve_gpu(hardware: str) -> tuple[GPUSpec | None, str]:
    h = hardware.strip().lower()
    h = HARDWARE_ALIASES.get(h, h)
    if h.startswith("h100-96gb"):  # Meta's Grand Teton H100: 96 GB HBM2e, power-capped at 500 W
        return replace(GPU_PRESETS["h100-80gb"], name="h100-80gb", memory_gib=96), ""
    if h in GPU_PRESETS:
        return GPU_PRESETS[h], ""
    return None, f"hardware {hardware!r} unknown"


def power_capped(hardware: str) -> bool:
    """A variant run below its chip's power limit (the corpus writes it as a ``-<watts>w`` suffix,
    e.g. Meta's Grand Teton H100s, ``h100-96gb-hbm2e-500w``): its sustained tensor-core throughput
    is below the chip's (``CostParams.power_cap_flops_scale``)."""
    return re.search(r"-\d+w$", hardware.strip().lower()) is not None


def profile_gpu(gpu: GPUSpec) -> str:
    """The GPU whose fitted profile predicts rows of ``gpu`` (variants share their chip's)."""
    return {"h800": "h100-80gb", "a800-80gb": "a100-80gb", "a100-40gb": "a100-80gb"}.get(gpu.name, gpu.name)


def eight_bit(dtype: str | None) -> bool:
    """A corpus dtype of 1-byte weights (FP8 / INT8); anything else is read as bf16/fp16."""
    return (dtype or "bf16").lower().startswith(("fp8", "int8", "w8"))


def with_precision(model: ModelSpec, gpu: GPUSpec, dtype: str | None) -> tuple[ModelSpec, GPUSpec, str]:
    """FP8 / INT8 weights: 1 byte per parameter (and per KV element) and twice the bf16 peak on
    GPUs with FP8 tensor cores; anything else is bf16/fp16."""
    d = (dtype or "bf16").lower()
    if eight_bit(d):
        if gpu.name not in FP8_CAPABLE and not d.startswith("int8"):
            return model, gpu, f"{dtype} on {gpu.name}: no FP8 tensor cores"
        return replace(model, dtype_bytes=1), replace(gpu, tflops_bf16=2 * gpu.tflops_bf16), ""
    return model, gpu, ""


VLLM_V1_DEFAULT = (0, 8)
"""The first vLLM release whose default engine is V1 (0.8.0); earlier releases run V0 only."""


def engine_of(engine: str, vllm_engine: str | None = None) -> str:
    """The cost model's engine for a corpus row's engine text: sglang, tensorrt-llm, or vLLM split
    by engine generation. ``vllm-v0`` when the row's ``vllm_engine`` key says v0 (a log showing the
    fall-back, ``VLLM_USE_V1=0``), when the text names V0, or when it names a release before 0.8.0;
    ``vllm`` (V1) otherwise, including a vLLM whose release is not stated."""
    e = engine.lower()
    if "sglang" in e:
        return "sglang"
    if "tensorrt" in e or "trt" in e:
        return "tensorrt-llm"
    if vllm_engine is not None:
        v = vllm_engine.strip().lower()
        if v not in ("v0", "v1"):
            raise SpecError(f"vllm_engine must be v0 or v1, got {vllm_engine!r}")
        return "vllm-v0" if v == "v0" else "vllm"
    if re.search(r"\bv0\b(?!\.)", e):
        return "vllm-v0"
    if re.search(r"\bv1\b(?!\.)", e):
        return "vllm"
    m = re.search(r"vllm[\s=(]*v?(\d+)\.(\d+)", e)  # the release written right after "vllm"
    if m and (int(m.group(1)), int(m.group(2))) < VLLM_V1_DEFAULT:
        return "vllm-v0"
    return "vllm"
