"""Weight schemes of MoE experts, and the parsing of a checkpoint's `quantization_config` into them.

A scheme says what the canonical expert block holds (see ``canonical.py``):

* :class:`FloatScheme`  – bf16/fp16/fp32 weights.
* :class:`WNA16Scheme`  – integer codes with group (or channel) scales, optional zero points
  (compressed-tensors ``pack-quantized``; docs/format.md).
* :class:`MXFP4Scheme`  – e2m1 values with one e8m0 scale per 32 along K.
* :class:`NVFP4Scheme`  – e2m1 values with one e4m3 scale per 16 along K and one fp32 scale per expert
  and projection (compressed-tensors ``nvfp4-pack-quantized``).

The config is read by our own parser of compressed-tensors' models and target matching (below), which
refuses all they refuse and never imports compressed-tensors, pydantic or transformers; it is refused
where vLLM 0.33.0 refuses it when it parses the config (spec §6). Limits of one backend (bits, group
sizes, divisibility) are not checked here: they belong to that layout's ``check``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Union

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, FLOAT_DTYPES, config_int, config_number, config_value, show_value


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


@dataclass(frozen=True)
class NVFP4Scheme:
    group_size: int = 16
    kind: str = "nvfp4"

    def describe(self) -> str:
        return "nvfp4"

    def to_json(self) -> dict:
        return asdict(self)


Scheme = Union[FloatScheme, WNA16Scheme, MXFP4Scheme, NVFP4Scheme]


def scheme_from_json(d: dict) -> Scheme:
    kind = d.get("kind")
    fields = {k: v for k, v in d.items() if k != "kind"}
    if kind == "float":
        return FloatScheme(**fields)
    if kind == "wna16":
        return WNA16Scheme(**fields)
    if kind == "mxfp4":
        return MXFP4Scheme(**fields)
    if kind == "nvfp4":
        return NVFP4Scheme(**fields)
    raise MoeConvertError("unknown scheme kind", found=kind, expected="float, wna16, mxfp4 or nvfp4")


# ---------------------------------------------------------------------------------------------------
# compressed-tensors quantization_config
#
# Our own reading of compressed-tensors 0.20.1's pydantic models (quant_config.py QuantizationConfig,
# quant_scheme.py QuantizationScheme, quant_args.py QuantizationArgs) and of its name matching
# (utils/match.py), so that a conversion never imports compressed-tensors, pydantic or transformers
# (2 s of start-up). Everything those models refuse is refused here too, naming the key
# (tests/test_quant_config.py holds the two side by side). What pydantic's lax mode would coerce is
# refused as well ("4", 4.0 or true for num_bits; "yes" or 1 for symmetric; 0 for dynamic): a config that
# says those is broken, as format/config.py says of config.json. The case folding compressed-tensors does
# itself is kept: `type`, `strategy` and `dynamic` are lower-cased by its field validators, so "INT" is
# int; `quantization_status`, a group's `format` and `actorder` are plain enums, matched case and all.

_SECTION = "quantization_config."

#: QuantizationArgs' fields (it forbids any other key)
_ARGS_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
              "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs")
#: QuantizationScheme's fields, the value of one config group (it forbids any other key)
_GROUP_KEYS = ("targets", "weights", "input_activations", "output_activations", "format")
_TYPES = ("int", "float")
_STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
_STATUSES = ("initialized", "calibration", "frozen", "compressed", "decompressed")
#: CompressionFormat's values, which a group's `format` must be (the config's own `format` is any string)
_FORMATS = ("dense", "sparse-bitmask", "sparse-24-bitmask", "int-quantized", "float-quantized", "naive-quantized",
            "pack-quantized", "marlin-24", "mixed-precision", "nvfp4-pack-quantized", "mxfp4-pack-quantized",
            "mxfp6-pack-quantized", "mxfp8-quantized")
#: the class name that targets (or ignores) every expert projection: compressed-tensors matches a Linear by
#: its class, and vLLM gives FusedMoE the scheme of "Linear" (`_add_fused_moe_to_target_scheme_map`)
_LINEAR = "Linear"
_REQUIRED = object()


@dataclass(frozen=True)
class QuantArgs:
    """One compressed-tensors ``QuantizationArgs``, checked, with ``strategy`` inferred as it infers it."""

    num_bits: int
    type: str  # "int" or "float"
    symmetric: bool
    strategy: str  # one of _STRATEGIES; from group_size when the config leaves it out
    group_size: int | None
    dynamic: bool | str  # false, true or "local"
    actorder: str | None  # "weight" or "static" (the same ordering), or None
    block_structure: tuple[int, int] | None
    scale_dtype: str | None
    zp_dtype: str | None
    observer: str | None
    observer_kwargs: dict


@dataclass(frozen=True)
class QuantGroup:
    """One config group: the module names it targets and how it quantizes them."""

    name: str
    targets: tuple[str, ...]
    weights: QuantArgs | None
    input_activations: QuantArgs | None
    output_activations: QuantArgs | None
    format: str | None  # None: the config's own `format`


def _invalid(section: str, key: str, expected: str, value) -> MoeConvertError:
    return MoeConvertError("invalid value", file=CONFIG_NAME, tensor=section + key, expected=expected,
                           found=show_value(value))


def _not_null(obj: dict, section: str, **expected: str) -> None:
    """Keys compressed-tensors gives a default but no None: pydantic refuses an explicit null there."""
    for key, words in expected.items():
        if key in obj and obj[key] is None:
            raise MoeConvertError("must not be null", file=CONFIG_NAME, tensor=section + key, expected=words)


def _known_keys(obj: dict, section: str, keys: tuple[str, ...]) -> None:
    for key in obj:
        if key not in keys:
            raise MoeConvertError("unknown key, which compressed-tensors refuses", file=CONFIG_NAME,
                                  tensor=section + str(key), expected="one of " + ", ".join(keys))


def _choice(obj: dict, key: str, choices: tuple[str, ...], section: str, *, default=_REQUIRED,
            fold_case: bool = False) -> str | None:
    value = (config_value(obj, key, str, section=section) if default is _REQUIRED
             else config_value(obj, key, str, default=default, section=section))
    chosen = value.lower() if fold_case and isinstance(value, str) else value
    if chosen is not None and chosen not in choices:
        raise _invalid(section, key, "one of " + ", ".join(choices), value)
    return chosen


def _names(obj: dict, key: str, section: str, *, default=_REQUIRED) -> tuple[str, ...]:
    """A list of module names, class names or ``re:`` regular expressions (targets, ignore)."""
    names = (config_value(obj, key, list, section=section) if default is _REQUIRED
             else config_value(obj, key, list, default=default, section=section))
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise _invalid(section, f"{key}[{i}]", "a string", name)
        if name.startswith("re:"):
            # compressed-tensors would only fail when it first matches a name; refused here, naming it
            try:
                re.compile(name[3:])
            except re.error as e:
                raise MoeConvertError(f"not a regular expression after 're:': {e}", file=CONFIG_NAME,
                                      tensor=f"{section}{key}[{i}]", found=show_value(name)) from None
    return tuple(names)


def _actorder(obj: dict, section: str) -> str | None:
    value = obj.get("actorder")
    if value is None or value is False:  # false means none (validate_actorder)
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("group", "dynamic")):
        # compressed-tensors 0.20 removed group ordering (true was its old spelling), and vLLM 0.33.0 refuses it
        raise MoeConvertError(
            f"compressed-tensors group/dynamic activation ordering (actorder={value!r}) is not supported "
            "(vLLM 0.33.0 refuses it too); use a checkpoint with static/weight activation ordering or without "
            "activation ordering", file=CONFIG_NAME, tensor=section + "actorder")
    if value not in ("weight", "static"):
        raise _invalid(section, "actorder", 'null, false, "weight" or "static"', value)
    return value


def _dynamic(obj: dict, section: str) -> bool | str:
    value = obj.get("dynamic", False)
    if isinstance(value, str) and value.lower() == "local":
        return "local"
    if type(value) is not bool:
        raise _invalid(section, "dynamic", 'true, false or "local"', value)
    return value


def _block_structure(obj: dict, section: str) -> tuple[int, int] | None:
    value = obj.get("block_structure")
    if value is None:
        return None
    # "128x128" is compressed-tensors' older spelling of [128, 128]
    m = re.fullmatch(r"(\d+)x(\d+)", value) if isinstance(value, str) else None
    parts = [int(m[1]), int(m[2])] if m else value
    if not isinstance(parts, list) or len(parts) != 2 or any(type(p) is not int or p <= 0 for p in parts):
        raise _invalid(section, "block_structure", "[rows, cols] of positive integers", value)
    return parts[0], parts[1]


def _torch_dtype(obj: dict, key: str, section: str) -> str | None:
    name = config_value(obj, key, str, default=None, section=section)
    if name is not None and not isinstance(getattr(torch, name.removeprefix("torch."), None), torch.dtype):
        raise _invalid(section, key, "a torch dtype (torch.int8)", name)
    return name


def _quant_args(value: dict | None, section: str) -> QuantArgs | None:
    """compressed-tensors' QuantizationArgs: its field checks, then ``validate_model_after``."""
    if value is None:
        return None
    _known_keys(value, section, _ARGS_KEYS)
    _not_null(value, section, num_bits="an integer", type="int or float", symmetric="true or false",
              dynamic='true, false or "local"', observer_kwargs="an object")
    num_bits = config_int(value, "num_bits", default=8, section=section)
    qtype = _choice(value, "type", _TYPES, section, default="int", fold_case=True)
    group_size = config_int(value, "group_size", min=-1, default=None, section=section)
    strategy = _choice(value, "strategy", _STRATEGIES, section, default=None, fold_case=True)
    block = _block_structure(value, section)
    dynamic = _dynamic(value, section)

    def refuse(key: str, message: str, expected: str):
        raise MoeConvertError(message, file=CONFIG_NAME, tensor=section + key, expected=expected,
                              found=show_value(value.get(key)))

    if strategy is None:  # inferred from group_size
        if group_size == 0:
            refuse("group_size", "no strategy to infer", "> 0 (strategy group) or -1 (channel)")
        strategy = "tensor" if group_size is None else "group" if group_size > 0 else "channel"
    if strategy in ("group", "tensor_group") and (group_size is None or group_size <= 0):
        refuse("group_size", f"strategy {strategy} needs a group size", "> 0")
    if group_size is not None and group_size > 0 and strategy not in ("group", "tensor_group"):
        refuse("group_size", f"a group size needs strategy group, not {strategy}", "null or -1")
    if (strategy == "block") != (block is not None):
        refuse("block_structure", "block_structure goes with strategy block, and only with it",
               "[rows, cols]" if strategy == "block" else "null")
    if strategy == "token" and not dynamic:
        refuse("dynamic", "strategy token quantizes dynamically", "true")
    if dynamic and strategy not in ("token", "tensor", "tensor_group", "group"):
        refuse("dynamic", f"strategy {strategy} cannot be dynamic", "false")
    if dynamic == "local" and strategy != "tensor_group":
        refuse("dynamic", "dynamic local needs strategy tensor_group", "true or false")
    zp_dtype = _torch_dtype(value, "zp_dtype", section)
    if zp_dtype is None and qtype == "float" and num_bits not in (4, 6, 8):
        refuse("num_bits", "compressed-tensors has no float type of this width", "4, 6 or 8")
    return QuantArgs(num_bits=num_bits, type=qtype,
                     symmetric=config_value(value, "symmetric", bool, default=True, section=section),
                     strategy=strategy, group_size=group_size, dynamic=dynamic,
                     actorder=_actorder(value, section), block_structure=block,
                     scale_dtype=_torch_dtype(value, "scale_dtype", section), zp_dtype=zp_dtype,
                     observer=config_value(value, "observer", str, default=None, section=section),
                     observer_kwargs=config_value(value, "observer_kwargs", dict, default={}, section=section))


def _group(name: str, value) -> QuantGroup:
    """compressed-tensors' QuantizationScheme: one value of ``config_groups``."""
    section = f"{_SECTION}config_groups.{name}."
    if isinstance(value, list):
        # vLLM reads `targets` from every group value, so only the full dict form works there
        # (spec §1.1 caveat): refuse the preset shorthand `"W4A16": ["Linear"]` the same way.
        raise MoeConvertError(f"config group '{name}' is a preset shorthand, which vLLM cannot parse",
                              file=CONFIG_NAME, tensor=section.rstrip("."),
                              expected="an object with targets and weights", found=show_value(value))
    if not isinstance(value, dict):
        raise _invalid(f"{_SECTION}config_groups.", name, "an object with targets and weights", value)
    _known_keys(value, section, _GROUP_KEYS)
    args = {key: _quant_args(config_value(value, key, dict, default=None, section=section), f"{section}{key}.")
            for key in ("weights", "input_activations", "output_activations")}
    fmt = _choice(value, "format", _FORMATS, section, default=None)
    if fmt == "mixed-precision":
        raise _invalid(section, "format", "the format of one group (mixed-precision is the whole config's)", fmt)
    inputs, outputs = args["input_activations"], args["output_activations"]
    if inputs is not None and inputs.strategy not in ("token", "tensor", "group", "tensor_group", "attn_head"):
        raise _invalid(section, "input_activations.strategy", "token, tensor, group, tensor_group or attn_head",
                       inputs.strategy)
    for key, acts in (("input_activations", inputs), ("output_activations", outputs)):
        if acts is not None and acts.actorder is not None:
            raise _invalid(section, f"{key}.actorder", "null (activation ordering is for weights)", acts.actorder)
    return QuantGroup(name=name, targets=_names(value, "targets", section), weights=args["weights"],
                      input_activations=inputs, output_activations=outputs, format=fmt)


def _check_expert_sparsity(raw: dict) -> None:
    """``moe_sparsity_config`` is read by nothing here, but compressed-tensors refuses a malformed one."""
    section = f"{_SECTION}moe_sparsity_config."
    sparsity = config_value(raw, "moe_sparsity_config", dict, default=None, section=_SECTION)
    if sparsity is not None:
        _choice(sparsity, "method", ("prune", "novice"), section)
        for i, n in enumerate(config_value(sparsity, "num_experts", list, section=section)):
            if n is not None and type(n) is not int:
                raise _invalid(section, f"num_experts[{i}]", "an integer or null", n)


def _name_matches(name: str, target: str) -> bool:
    """compressed-tensors' ``match_name``: ``re:`` and a regular expression matched from the start of the
    name, or else the whole name."""
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def _where(config_file: str) -> str:
    return f"{config_file} quantization_config"


class CompressedTensorsConfig:
    """A parsed compressed-tensors ``quantization_config`` that resolves the scheme of a module name."""

    def __init__(self, raw: dict, config_file: str):
        self.raw = raw
        self.config_file = config_file
        _not_null(raw, _SECTION, quant_method="a string", format="a string",
                  quantization_status="one of " + ", ".join(_STATUSES))
        config_value(raw, "quant_method", str, default="compressed-tensors", section=_SECTION)
        groups = config_value(raw, "config_groups", dict, section=_SECTION)
        self.groups: dict[str, QuantGroup] = {name: _group(name, value) for name, value in groups.items()}
        self.format: str = config_value(raw, "format", str, default="fakequant", section=_SECTION)
        self.ignore: tuple[str, ...] = _names(raw, "ignore", _SECTION, default=[])
        _quant_args(config_value(raw, "kv_cache_scheme", dict, default=None, section=_SECTION),
                    f"{_SECTION}kv_cache_scheme.")
        config_number(raw, "global_compression_ratio", default=None, section=_SECTION)
        _check_expert_sparsity(raw)
        self.quantization_status = _choice(raw, "quantization_status", _STATUSES, _SECTION, default="initialized")
        if self.quantization_status != "compressed":
            raise MoeConvertError("quantization_status must be 'compressed' (weights stored packed)",
                                  file=CONFIG_NAME, tensor=f"{_SECTION}quantization_status",
                                  expected="compressed", found=self.quantization_status)
        # target -> the group it selects. A target listed by two groups selects the later one, in the place
        # of its first listing: compressed-tensors' apply (an OrderedDict) and vLLM's target_scheme_map agree.
        self._target_group: dict[str, str] = {}
        for group in self.groups.values():
            for target in group.targets:
                self._target_group[target] = group.name

    def _scheme_key(self, group: QuantGroup | None):
        """What vLLM's ``get_moe_method`` compares between projections (its ``scheme_dict``)."""
        if group is None:
            return None
        return group.weights, group.input_activations, group.format or self.format

    def _group_for(self, module_name: str) -> QuantGroup | None:
        """The group that quantizes ``module_name`` as an nn.Linear, or None when it stays unquantized."""
        # compressed-tensors' is_match also ignores by class name; vLLM's should_ignore_layer does not, but
        # an ignored "Linear" means nothing was quantized, which the tensors then show
        if any(ign == _LINEAR or _name_matches(module_name, ign) for ign in self.ignore):
            return None
        named = [t for t in self._target_group if _name_matches(module_name, t)]
        if not named:
            return self.groups[self._target_group[_LINEAR]] if _LINEAR in self._target_group else None
        # A name beats a class name in both. Among names, vLLM takes the first target in config order
        # (utils.py find_matched_target); compressed-tensors, which wrote the weights, takes an exact name
        # first and then the regexes in sorted order (match.py match_targets). Where they pick different
        # schemes, the checkpoint means two things.
        vllm, ct = named[0], min(named, key=lambda t: ("re:" in t, t))
        picked = self.groups[self._target_group[vllm]]
        other = self.groups[self._target_group[ct]]
        if self._scheme_key(picked) != self._scheme_key(other):
            raise MoeConvertError(
                f"{module_name} is matched by target '{vllm}' (config group '{picked.name}') first in config "
                f"order, which vLLM follows, but by '{ct}' (config group '{other.name}') first in "
                "compressed-tensors' order (exact names, then regexes sorted), and the two schemes differ",
                file=_where(self.config_file))
        return picked

    def expert_group(self, module_names: dict[str, str]) -> QuantGroup | None:
        """The config group of one expert's projections (role -> module name). None = not quantized.

        Mirrors vLLM's ``get_moe_method``: all projections must resolve to the same scheme.
        """
        resolved = {role: self._group_for(name) for role, name in module_names.items()}
        keys = [self._scheme_key(group) for group in resolved.values()]
        if any(key != keys[0] for key in keys):
            raise MoeConvertError(
                "All MoE projections need to have same quantization scheme but found multiple: "
                + ", ".join(f"{module_names[r]} -> {g.name if g else 'unquantized'}" for r, g in resolved.items()),
                file=_where(self.config_file),
            )
        return next(iter(resolved.values()))

    def format_of(self, group: QuantGroup) -> tuple[str, str]:
        """The group's format (its own, else the config's) and the key that says it."""
        if group.format:
            return group.format, f"{_SECTION}config_groups.{group.name}.format"
        return self.format, _SECTION + "format"

    def scheme_for(self, module_names: dict[str, str], scale_dtype: str) -> WNA16Scheme | None:
        """The WNA16 scheme of one expert's projections (role -> module name). None = not quantized."""
        group = self.expert_group(module_names)
        return None if group is None else self._wna16(group, scale_dtype)

    def _wna16(self, group: QuantGroup, scale_dtype: str) -> WNA16Scheme:
        """The group as a WNA16 scheme, refused where vLLM 0.33.0's WNA16 MoE method refuses it."""
        section = f"{_SECTION}config_groups.{group.name}."
        w = group.weights

        def refuse(key: str, message: str, expected=None, found=None):
            raise MoeConvertError(message, file=CONFIG_NAME, tensor=key, expected=expected, found=found)

        if w is None:
            refuse(section + "weights", f"config group '{group.name}' quantizes no weights", "an object")
        fmt, fmt_key = self.format_of(group)
        if fmt != "pack-quantized":
            refuse(fmt_key, "for Fused MoE layers only format pack-quantized is supported", "pack-quantized", fmt)
        if w.type != "int":
            refuse(section + "weights.type", "not an integer (WNA16) scheme", "int", w.type)
        if not 2 <= w.num_bits <= 8:
            refuse(section + "weights.num_bits", "for Fused MoE layers only bits 2..8 are supported", "2..8",
                   w.num_bits)
        if w.dynamic is not False:
            refuse(section + "weights.dynamic", "dynamic weight quantization is not a stored scheme", "false",
                   show_value(w.dynamic))
        if group.input_activations is not None:
            refuse(section + "input_activations",
                   f"config group '{group.name}' quantizes input activations: not a weight-only (WNA16) scheme",
                   "null")
        if w.strategy not in ("group", "channel"):
            refuse(section + "weights.strategy", "not a group or channel scheme", "group or channel", w.strategy)
        # validate_model_after leaves strategy group only with group_size > 0; channel's group_size
        # (null, -1 or even 0) means one group spanning K, as vLLM reads it (`group_size or -1`)
        return WNA16Scheme(bits=w.num_bits, group_size=w.group_size if w.strategy == "group" else -1,
                           symmetric=w.symmetric, scale_dtype=scale_dtype)


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
    if method == "moeconvert":  # a folder written for vLLM: the source's own config covers the other layers
        inner = config_value(qc, "source_quantization_config", dict, default=None, section=f"{key}.")
        return parse_quantization_config({"quantization_config": inner}, config_file) if inner else None
    raise MoeConvertError(
        "unsupported quantization_config.quant_method", file=_where(config_file),
        expected="compressed-tensors (pack-quantized) or none", found=method or "no quant_method",
    )


_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def float_dtype_name(st_dtype: str) -> str | None:
    """safetensors dtype code (BF16/F16/F32) -> torch dtype name, or None if not a float weight dtype."""
    return _DTYPE_NAMES.get(st_dtype)

