"""Pure data about networks: ModelSpec, presets, Hugging Face config ingestion, tensor inventory."""
from nereus.models.inventory import TensorInfo, check_tp, pp_layer_range, stage_tensors, tensor_inventory, tp_shard
from nereus.models.spec import ModelSpec, from_hf_config, from_hf_dict, load_model, preset, preset_names

__all__ = [
    "ModelSpec", "TensorInfo", "check_tp", "from_hf_config", "from_hf_dict", "load_model", "pp_layer_range", "preset",
    "preset_names", "stage_tensors", "tensor_inventory", "tp_shard",
]
