"""HF's `fsdp` / `fsdp_config` as raytrain's FSDP2 options: transformers' own _process_fsdp_args reads them (legacy
strings, the `fsdp_` prefixes, its defaults and refusals), and what it hands accelerate's FSDP plugin becomes
distributed.fsdp; what raytrain's FSDP2 cannot do is refused in one line."""

from __future__ import annotations

import copy
import json
import os
import types
from typing import Any


def fsdp_options(fsdp: Any, fsdp_config: Any, activation_checkpointing: bool) -> tuple[dict, dict]:
    """(HF's normalised fsdp_config, distributed.fsdp options) for TrainingArguments' fsdp and fsdp_config."""
    from transformers import TrainingArguments as HFArgs

    config = copy.deepcopy(fsdp_config) if isinstance(fsdp_config, dict) else fsdp_config
    shim = types.SimpleNamespace(fsdp=fsdp, fsdp_config=config, activation_checkpointing=activation_checkpointing,
                                 _apply_legacy_fsdp_to_config=HFArgs._apply_legacy_fsdp_to_config)
    before = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")
    try:
        plugin = HFArgs._process_fsdp_args(shim)
    except FileNotFoundError:
        raise ValueError(f"fsdp_config: file not found: {fsdp_config!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"fsdp_config: {fsdp_config!r} is not a JSON object ({e.msg})") from None
    finally:  # HF sets it for accelerate's loader; raytrain loads the model in the driver
        if before is None:
            os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
        else:
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = before
    config = shim.fsdp_config
    if plugin is None:  # HF's XLA path
        raise ValueError("fsdp_config.xla: FSDP on TPUs (XLA) is not supported here; raytrain runs FSDP2 on GPUs or CPUs")
    return config, _options(plugin, activation_checkpointing)


def _options(plugin: dict, activation_checkpointing: bool) -> dict:
    """accelerate's FullyShardedDataParallelPlugin arguments as distributed.fsdp options."""
    if plugin["fsdp_version"] != 2:
        raise ValueError(f"fsdp_config.version: {plugin['fsdp_version']} (FSDP1) is not supported; raytrain runs "
                         "FSDP2 (version 2)")
    if plugin["cpu_ram_efficient_loading"]:
        raise ValueError("fsdp_config.cpu_ram_efficient_loading: not supported (the model is built before the "
                         "workers start and sent to them); leave it false")
    if plugin["state_dict_type"] != "FULL_STATE_DICT":
        raise ValueError(f"fsdp_config.state_dict_type: {plugin['state_dict_type']} is not supported; checkpoints "
                         "hold the whole model.safetensors and the optimizer sharded (FULL_STATE_DICT)")
    if plugin["auto_wrap_policy"] == "NO_WRAP":
        raise ValueError("fsdp_config.auto_wrap_policy: NO_WRAP is not supported; raytrain shards the model's "
                         "blocks (TRANSFORMER_BASED_WRAP) or its submodules by size (SIZE_BASED_WRAP)")
    if plugin.get("activation_checkpointing") and activation_checkpointing:
        raise ValueError("fsdp_config.activation_checkpointing and activation_checkpointing: set only one (HF's "
                         "Trainer refuses both: FSDP's own recomputes each block)")
    options: dict[str, Any] = {"reshard_after_forward": plugin["reshard_after_forward"]}
    if plugin.get("cpu_offload"):
        options["cpu_offload"] = True
    if plugin.get("activation_checkpointing"):
        options["activation_checkpointing"] = True
    if plugin.get("transformer_cls_names_to_wrap"):
        options["wrap_classes"] = plugin["transformer_cls_names_to_wrap"].split(",")
    if plugin.get("min_num_params"):
        options["min_num_params"] = plugin["min_num_params"]
    return options
