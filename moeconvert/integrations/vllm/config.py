"""``quant_method: "moeconvert"``: the quantization config vLLM builds from a converted folder's config.json.

MoE layers the folder's manifest holds get our method (their tensors load as they are); every other
layer goes to the source checkpoint's own quantization config (compressed-tensors for a W4A16 source),
or is unquantized, exactly as vLLM would load the source.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from moeconvert.integrations.vllm import SUPPORTED_VLLM

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# our stacked names under a layer's experts container -> the parameter of vLLM's RoutedExperts child
_STACKED = re.compile(r"\.experts\.((?:w13|w2)_(?:weight|weight_scale|weight_zero_point|bias))$")


class MoeconvertConfig(QuantizationConfig):
    def __init__(self, raw: dict):
        super().__init__()
        self.raw = raw
        dtype = raw.get("dtype")
        if dtype not in _DTYPES:
            raise ValueError(f"moeconvert: quantization_config.dtype must be one of {sorted(_DTYPES)}, found {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.layers: dict[str, dict] = {}  # MoE layer prefix -> its manifest entry (maybe_update_config)
        self.manifest: dict | None = None
        self.inner = None
        source = raw.get("source_quantization_config")
        if source:
            if source.get("quant_method") != "compressed-tensors":
                raise ValueError("moeconvert: the source's quantization_config must be compressed-tensors, found "
                                 f"{source.get('quant_method')!r}")
            from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
                CompressedTensorsConfig)

            self.inner = CompressedTensorsConfig.from_config(source)
            self.inner.packed_modules_mapping = self.packed_modules_mapping  # one mapping, updated by the model

    # -- what vLLM asks of every quantization config ---------------------------------------------------

    def get_name(self) -> str:
        return "moeconvert"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [self.dtype]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75  # Marlin's MoE kernel (and compressed-tensors' linear layers need no more)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> "MoeconvertConfig":
        return cls(config)

    @staticmethod
    def get_checkpoint_weight_mapper():
        from vllm.model_executor.models.utils import WeightsMapper

        # vLLM's own mapper (it drops activation-order metadata), then ours: a stacked MoE tensor goes to
        # the RoutedExperts child that holds the parameter (idempotent: the new name no longer matches)
        return QuantizationConfig.get_checkpoint_weight_mapper() | WeightsMapper(
            orig_to_new_regex={_STACKED: r".experts.routed_experts.\1"})

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.inner is not None:
            self.inner.apply_vllm_mapper(hf_to_vllm_mapper)

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Read the folder's manifest (checked as ``moeconvert verify`` checks it, without hashing data)."""
        from moeconvert.format.manifest import check_output

        root = Path(model_name)
        if not root.is_dir():
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(model_name, revision=revision, local_files_only=True))
        self.use_manifest(check_output(root).manifest)

    def use_manifest(self, manifest: dict) -> None:
        made_for = manifest["layout"]["made_for"].get("vllm")
        if made_for not in SUPPORTED_VLLM:
            raise ValueError(f"moeconvert: this folder's layout was made for vLLM {made_for}; the plugin supports "
                             f"{', '.join(SUPPORTED_VLLM)}")
        if manifest["layout"]["name"] != "marlin" or manifest["scheme"] is None or manifest["scheme"]["kind"] != "wna16":
            raise ValueError(f"moeconvert: the vLLM plugin serves Marlin WNA16 folders; this one is "
                             f"{manifest['layout']['name']} {manifest['scheme']}")
        if manifest["dtype"] != self.raw["dtype"]:
            raise ValueError(f"moeconvert: config.json says dtype {self.raw['dtype']}, the manifest {manifest['dtype']}")
        self.manifest = manifest
        self.layers = {m["prefix"]: m for m in manifest["moe_layers"]}

    # -- per layer -------------------------------------------------------------------------------------

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        if isinstance(layer, RoutedExperts):
            from moeconvert.integrations.vllm.method import MarlinWNA16Method

            owner = prefix.removesuffix(".routed_experts")
            if self.manifest is None:
                raise ValueError("moeconvert: the folder's manifest was not read (maybe_update_config)")
            entry = self.layers.get(owner)
            if entry is None:
                raise ValueError(f"moeconvert: {owner} is an MoE layer the folder's manifest does not hold")
            return MarlinWNA16Method(layer.moe_config, entry, self.manifest)
        if self.inner is not None:
            return self.inner.get_quant_method(layer, prefix)
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None
