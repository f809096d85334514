"""Weight schemes of MoE experts, and the parsing of a checkpoint's `quantization_config` into them.

A scheme says what the canonical expert block holds (see ``canonical.py``):

* :class:`FloatScheme`  – bf16/fp16/fp32 weights.
* :class:`WNA16Scheme`  – integer codes with group (or channel) scales, optional zero points
  (compressed-tensors ``pack-quantized``; ../specs wna16-layouts.md §1).
* :class:`MXFP4Scheme`  – e2m1 values with one e8m0 scale per 32 along K.

The config is parsed with compressed-tensors' own pydantic models and target matching, and refused
where vLLM 0.33.0 refuses it when it parses the config (spec §6). Limits of one backend (bits, group
sizes, divisibility) are not checked here: they belong to that layout's ``check``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Union

from moeconvert.errors import MoeConvertError
from moeconvert.format import config_value

FLOAT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class FloatScheme:
    dtype: str  # one of FLOAT_DTYPES
    kind: str = "float"

    def describe(self) -> str:
        return self.dtype

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WNA16Scheme:
    bits: int  # 4 or 8 (others parse, but no layout takes them)
    group_size: int  # -1 = channelwise (one group spanning K)
    symmetric: bool
    scale_dtype: str  # dtype of the checkpoint's scales
    kind: str = "wna16"

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def offset(self) -> int:
        """The unsigned field is the signed code plus this (8 for int4, 128 for int8; spec §1.3)."""
        return 1 << (self.bits - 1)

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else k // self.group_size

    def describe(self) -> str:
        g = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"w{self.bits}a16 {g} {'sym' if self.symmetric else 'asym'}"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MXFP4Scheme:
    block_size: int = 32
    kind: str = "mxfp4"

    def describe(self) -> str:
        return "mxfp4"

    def to_json(self) -> dict:
        return asdict(self)


Scheme = Union[FloatScheme, WNA16Scheme, MXFP4Scheme]


def scheme_from_json(d: dict) -> Scheme:
    kind = d.get("kind")
    fields = {k: v for k, v in d.items() if k != "kind"}
    if kind == "float":
        return FloatScheme(**fields)
    if kind == "wna16":
        return WNA16Scheme(**fields)
    if kind == "mxfp4":
        return MXFP4Scheme(**fields)
    raise MoeConvertError("unknown scheme kind", found=kind, expected="float, wna16 or mxfp4")


# ---------------------------------------------------------------------------------------------------
# compressed-tensors quantization_config


def _where(config_file: str) -> str:
    return f"{config_file} quantization_config"


class CompressedTensorsConfig:
    """A parsed compressed-tensors ``quantization_config`` that resolves the scheme of a module name."""

    def __init__(self, raw: dict, config_file: str):
        from compressed_tensors.quantization import QuantizationConfig

        self.raw = raw
        self.config_file = config_file
        groups = config_value(raw, "config_groups", dict, default={}, section="quantization_config.")
        for gname, gval in groups.items():
            # vLLM reads `targets` from every group value, so only the full dict form works there
            # (spec §1.1 caveat): refuse the preset shorthand `"W4A16": ["Linear"]` the same way.
            if not isinstance(gval, dict):
                raise MoeConvertError(
                    f"config group '{gname}' is a preset shorthand, which vLLM cannot parse",
                    file=_where(config_file),
                    expected="a dict with targets/weights",
                    found=type(gval).__name__,
                )
            weights = config_value(gval, "weights", dict, default={},
                                   section=f"quantization_config.config_groups.{gname}.")
            actorder = weights.get("actorder")
            if actorder in ("group", "dynamic"):
                # vLLM 0.33.0 refuses this at config parse (newer compressed-tensors too).
                raise MoeConvertError(
                    f"config group '{gname}': compressed-tensors group/dynamic activation ordering "
                    f"(actorder='{actorder}') is not supported (vLLM 0.33.0 refuses it too); use a checkpoint "
                    "with static/weight activation ordering or without activation ordering",
                    file=_where(config_file),
                )
        try:
            self.config = QuantizationConfig.model_validate(raw)
        except Exception as e:  # pydantic's ValidationError: summarise on one line
            first = str(e).splitlines()
            raise MoeConvertError(
                f"compressed-tensors rejects the config: {' '.join(first[:3])}", file=_where(config_file)
            ) from e
        status = str(self.config.quantization_status.value if hasattr(self.config.quantization_status, "value")
                     else self.config.quantization_status)
        if status != "compressed":
            raise MoeConvertError(
                "quantization_status must be 'compressed' (weights stored packed)",
                file=_where(config_file),
                expected="compressed",
                found=status,
            )

    def _group_for(self, module_name: str):
        """The (group name, scheme) whose targets match ``module_name`` as an nn.Linear, or None."""
        from compressed_tensors.utils.match import match_name

        ignore = self.config.ignore or []
        if any(match_name(module_name, ign) or ign == "Linear" for ign in ignore):
            return None
        for gname, scheme in self.config.config_groups.items():
            for target in scheme.targets:
                if target == "Linear" or match_name(module_name, target):
                    return gname, scheme
        return None

    def scheme_for(self, module_names: dict[str, str], scale_dtype: str) -> WNA16Scheme | None:
        """Resolve the scheme of one expert's projections (role -> module name). None = not quantized.

        Mirrors vLLM's ``get_moe_method``: all projections must resolve to the same scheme.
        """
        resolved = {role: self._group_for(name) for role, name in module_names.items()}
        keys = {role: (None if r is None else r[0]) for role, r in resolved.items()}
        if len(set(keys.values())) > 1:
            raise MoeConvertError(
                "All MoE projections need to have same quantization scheme but found multiple: "
                + ", ".join(f"{module_names[r]} -> {k or 'unquantized'}" for r, k in keys.items()),
                file=_where(self.config_file),
            )
        first = next(iter(resolved.values()))
        if first is None:
            return None
        gname, scheme = first
        return self._wna16(gname, scheme, scale_dtype)

    def _wna16(self, gname: str, scheme, scale_dtype: str) -> WNA16Scheme:
        where = _where(self.config_file)
        fmt = scheme.format or self.config.format
        w = scheme.weights
        if w is None:
            raise MoeConvertError(f"config group '{gname}' quantizes no weights", file=where)
        bits = int(w.num_bits)
        if fmt != "pack-quantized":
            raise MoeConvertError(
                f"config group '{gname}': for Fused MoE layers only format pack-quantized is supported",
                file=where, expected="pack-quantized", found=fmt,
            )
        wtype = getattr(w.type, "value", w.type)
        if wtype != "int":
            raise MoeConvertError(f"config group '{gname}': weights.type", file=where, expected="int", found=wtype)
        if not 2 <= bits <= 8:
            raise MoeConvertError(
                f"config group '{gname}': for Fused MoE layers only bits 2..8 are supported",
                file=where, expected="2..8", found=bits,
            )
        actorder = getattr(w.actorder, "value", w.actorder)
        if actorder in ("group", "dynamic"):
            raise MoeConvertError(
                f"config group '{gname}': compressed-tensors group/dynamic activation ordering "
                f"(actorder='{actorder}') is not supported (vLLM 0.33.0 refuses it too); use a checkpoint "
                "with static/weight activation ordering or without activation ordering",
                file=where,
            )
        dynamic = getattr(w.dynamic, "value", w.dynamic)
        if dynamic not in (False, None):
            raise MoeConvertError(f"config group '{gname}': weights.dynamic", file=where, expected=False, found=dynamic)
        if scheme.input_activations is not None:
            raise MoeConvertError(
                f"config group '{gname}' quantizes input activations: not a weight-only (WNA16) scheme",
                file=where,
            )
        strategy = getattr(w.strategy, "value", w.strategy)
        if strategy == "group":
            group_size = int(w.group_size)
            if group_size <= 0:
                raise MoeConvertError(f"config group '{gname}': group_size", file=where, expected="> 0", found=group_size)
        elif strategy == "channel":
            group_size = -1
        else:
            raise MoeConvertError(
                f"config group '{gname}': weights.strategy", file=where, expected="group or channel", found=strategy
            )
        return WNA16Scheme(bits=bits, group_size=group_size, symmetric=bool(w.symmetric), scale_dtype=scale_dtype)


def parse_quantization_config(config: dict, config_file: str) -> CompressedTensorsConfig | None:
    """The checkpoint's quantization config, or None for an unquantized checkpoint.

    Read where transformers reads it (``quantization_config``, or the older ``compression_config``);
    a value that is not an object is refused naming the key, before compressed-tensors sees it.
    """
    key = "quantization_config" if config.get("quantization_config") is not None else "compression_config"
    qc = config_value(config, key, dict, default=None)
    if not qc:
        return None
    method = config_value(qc, "quant_method", str, default=None, section=f"{key}.")
    if method == "compressed-tensors":
        return CompressedTensorsConfig(qc, config_file)
    if method == "mxfp4":
        return None  # gpt-oss MXFP4: recognised by its tensor names (`*_blocks` / `*_scales`)
    raise MoeConvertError(
        "unsupported quantization_config.quant_method", file=_where(config_file),
        expected="compressed-tensors (pack-quantized) or none", found=method or "no quant_method",
    )


_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def float_dtype_name(st_dtype: str) -> str | None:
    """safetensors dtype code (BF16/F16/F32) -> torch dtype name, or None if not a float weight dtype."""
    return _DTYPE_NAMES.get(st_dtype)

