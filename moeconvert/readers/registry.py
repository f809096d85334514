"""The readers, by the format string config.json writes, and what a checkpoint's config says its format is."""

from __future__ import annotations

from dataclasses import dataclass

from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, config_value
from moeconvert.readers.base import LEFT_FLOAT, LayerNames, Reader
from moeconvert.schemes import CompressedTensorsConfig

#: DeepSeek-V4's own format (readers/deepseek_v4.py), chosen from the model's config as well as its
#: quant_method: one reader per ``expert_dtype``
DEEPSEEK_V4 = "deepseek_v4_fp8"
#: AutoRound's own format (readers/auto_round.py): one reader per packing_format
AUTO_ROUND = "auto-round"

_READERS: dict[str, Reader] = {}


def register(cls: type[Reader]) -> type[Reader]:
    """Class decorator: one instance of each reader, under its ``name``."""
    assert cls.name not in _READERS, f"two readers named {cls.name}"
    _READERS[cls.name] = cls()
    return cls


def reader_names() -> list[str]:
    return sorted(_READERS)


def get_reader(name: str) -> Reader:
    if name not in _READERS:
        raise MoeConvertError("unknown checkpoint format", expected="one of " + ", ".join(reader_names()),
                              found=name)
    return _READERS[name]


def _quant_methods() -> dict[str, Reader]:
    """quant_method -> the reader it selects at once (compressed-tensors picks one per layer, by format)."""
    return {r.quant_method: r for r in _READERS.values() if r.quant_method}


def _compressed_tensors_formats() -> dict[str, Reader]:
    return {r.name: r for r in _READERS.values() if r.compressed_tensors}


@dataclass(frozen=True)
class SourceFormat:
    """What config.json says a checkpoint's weights are: its ``quant_method`` (``none`` when it has no
    quantization_config) and that method's parsed config, which the readers read."""

    method: str
    config: object = None

    def layer(self, names: LayerNames) -> tuple[Reader, object]:
        """The reader of one MoE layer and the config its experts are read with: the format's own, with its
        per-module rules for the layer applied; the float reader where those rules leave it unquantized."""
        if self.method == "none":
            return _READERS["float"], None
        if self.method == "compressed-tensors":
            # each config group names its own format; experts left unquantized are float
            cfg: CompressedTensorsConfig = self.config
            group = cfg.expert_group(names.first)
            if group is None:
                return _READERS["float"], cfg
            fmt, key = cfg.format_of(group)
            formats = _compressed_tensors_formats()
            if fmt not in formats:
                raise MoeConvertError("compressed-tensors format not read for MoE experts", file=CONFIG_NAME,
                                      tensor=key, expected="one of " + ", ".join(sorted(formats)), found=fmt)
            return formats[fmt], cfg
        reader = (_READERS[self.config.reader_name()] if self.method in (DEEPSEEK_V4, AUTO_ROUND)
                  else _quant_methods()[self.method])
        layer_config = reader.layer_config(self.config, names)
        return (reader, layer_config) if layer_config is not LEFT_FLOAT else (_READERS["float"], self.config)

    def describe(self) -> str:
        if self.method == "compressed-tensors":
            return f"compressed-tensors ({self.config.format})"
        if self.method == DEEPSEEK_V4:
            return f"{self.method} (expert_dtype {self.config.expert_dtype})"
        if self.method == AUTO_ROUND:
            return f"{self.method} ({self.config.packing})"
        return self.method


def source_format(config: dict) -> SourceFormat:
    """The checkpoint's format, read where transformers reads it (``quantization_config``, or the older
    ``compression_config``); an unknown ``quant_method`` is refused naming those this tool reads."""
    key = "quantization_config" if config.get("quantization_config") is not None else "compression_config"
    qc = config_value(config, key, dict, default=None)
    if not qc:
        return SourceFormat("none")
    section = f"{key}."
    method = config_value(qc, "quant_method", str, default=None, section=section)
    if method == "moeconvert":  # a folder written for vLLM: the source's own config covers the other layers
        inner = config_value(qc, "source_quantization_config", dict, default=None, section=section)
        return source_format({"quantization_config": inner}) if inner else SourceFormat("none")
    if method == "compressed-tensors":
        return SourceFormat(method, CompressedTensorsConfig(qc, CONFIG_NAME))
    if method in ("fp8", DEEPSEEK_V4) and config.get("model_type") == "deepseek_v4":
        # vLLM's DeepseekV4FP8Config.override_quantization_method: fp8 on a DeepSeek-V4 model is its own
        from moeconvert.readers.deepseek_v4 import parse_config

        return SourceFormat(DEEPSEEK_V4, parse_config(config, qc, section))
    if method == AUTO_ROUND:
        from moeconvert.readers.auto_round import parse_config

        return SourceFormat(AUTO_ROUND, parse_config(qc, section))
    methods = _quant_methods()
    if method not in methods:
        raise MoeConvertError("unsupported quantization_config.quant_method", file=CONFIG_NAME,
                              tensor=section + "quant_method",
                              expected="one of " + ", ".join(sorted([*methods, AUTO_ROUND, "compressed-tensors"])) + " or none",
                              found=method or "no quant_method")
    return SourceFormat(method, methods[method].parse_config(qc, section))
