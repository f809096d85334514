"""config.json values read with their type and range checked, so that a broken config is refused naming
its key instead of failing later (or looping over a number nobody checked); and the model family a config
names, which both the conversion and the manifest check read from it."""

from __future__ import annotations

import math

from moeconvert.errors import MoeConvertError
from moeconvert.format.safetensors import show_value

CONFIG_NAME = "config.json"

_REQUIRED = object()


def _absent(cfg: dict, key: str, default, section: str, expected: str):
    if default is _REQUIRED:
        raise MoeConvertError("missing" if key not in cfg else "must not be null", file=CONFIG_NAME,
                              tensor=section + key, expected=expected)
    return default


def config_int(cfg: dict, key: str, *, min: int = 1, default=_REQUIRED, section: str = "") -> int | None:
    """``cfg[key]`` as an integer >= ``min``; absent or null gives ``default`` (refused when required).

    true/false, 8.0 and "8" are refused rather than coerced: transformers would fail on them or do
    something else, and a config that says them is broken. ``section`` prefixes the key in messages
    (``text_config.``).
    """
    expected = "a positive integer" if min == 1 else f"an integer >= {min}"
    value = cfg.get(key)
    if value is None:
        return _absent(cfg, key, default, section, expected)
    if type(value) is not int or value < min:
        raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=section + key,
                              expected=expected, found=show_value(value))
    return value


def config_number(cfg: dict, key: str, *, default=_REQUIRED, positive: bool = False,
                  section: str = "") -> float | None:
    """``cfg[key]`` as a finite real number (int or float, never a bool), > 0 when ``positive``."""
    expected = "a finite number" + (" > 0" if positive else "")
    value = cfg.get(key)
    if value is None:
        return _absent(cfg, key, default, section, expected)
    if type(value) not in (int, float) or not math.isfinite(value) or (positive and value <= 0):
        raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=section + key,
                              expected=expected, found=show_value(value))
    return value


_KIND_WORDS = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}


def config_value(cfg: dict, key: str, kind: type, *, default=_REQUIRED, section: str = ""):
    """``cfg[key]`` checked to be a JSON object / list / string / boolean (``kind`` dict, list, str, bool)."""
    value = cfg.get(key)
    if value is None:
        return _absent(cfg, key, default, section, _KIND_WORDS[kind])
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=section + key,
                              expected=_KIND_WORDS[kind], found=show_value(value))
    return value



# ---------------------------------------------------------------------------------------------------
# the model family

#: family name (the manifest's ``family``) -> the config ``model_type`` values that name it, in the
#: order families are tried; moeconvert.modelmap has each family's tensor naming and config keys
MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "mixtral": ("mixtral",),
    "qwen2-moe": ("qwen2_moe",),
    "qwen3-moe": ("qwen3_moe",),
    "deepseek-v2": ("deepseek_v2",),
    "deepseek-v3": ("deepseek_v3", "kimi_k2"),
    "glm4-moe": ("glm4_moe",),
    "gpt-oss": ("gpt_oss",),
}


def family_name(cfg: dict) -> str:
    """The family a config.json names by ``model_type`` (or its ``text_config``'s, for a multimodal
    wrapper whose own ``model_type`` names no family)."""
    mt = config_value(cfg, "model_type", str, default=None)
    text = config_value(cfg, "text_config", dict, default=None)
    if text is not None and not any(mt in types for types in MODEL_TYPES.values()):
        mt = config_value(text, "model_type", str, default=mt, section="text_config.")
    for name, types in MODEL_TYPES.items():
        if mt in types:
            return name
    known = ", ".join(t for types in MODEL_TYPES.values() for t in types)
    raise MoeConvertError("unknown model family", file=CONFIG_NAME, tensor="model_type",
                          expected=f"one of {known}", found=mt)
