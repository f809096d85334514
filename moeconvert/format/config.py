"""config.json values read with their type and range checked, so that a broken config is refused naming
its key instead of failing later (or looping over a number nobody checked); and the model family a config
names, which both the conversion and the manifest check read from it."""

from __future__ import annotations

import math

from moeconvert.errors import MoeConvertError
from moeconvert.format.families import FAMILIES, MODEL_TYPES, WRAPPERS  # noqa: F401 (re-exported)
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
# the model family (the declared table: moeconvert/format/families.py)


def family_name(cfg: dict) -> str:
    """The family a config.json names by ``model_type``, or, for a multimodal wrapper, by its
    ``text_config``'s ``model_type`` (which must be a family the wrapper holds). A family whose facts do
    not fit the table is refused with its one-line reason."""
    mt = config_value(cfg, "model_type", str, default=None)
    own = next((f for f in FAMILIES if mt in f.model_types), None)
    if own is None and (mt in WRAPPERS or cfg.get("text_config") is not None):
        text = config_value(cfg, "text_config", dict, default=None)
        if text is None:
            raise MoeConvertError(f"{mt} is a multimodal wrapper, but config.json has no text_config",
                                  file=CONFIG_NAME, tensor="text_config", expected="an object", found="missing")
        inner = config_value(text, "model_type", str, default=None, section="text_config.")
        own = next((f for f in FAMILIES if inner in f.model_types), None)
        if mt in WRAPPERS and (own is None or own.name not in WRAPPERS[mt]):
            allowed = ", ".join(t for f in FAMILIES if f.name in WRAPPERS[mt] for t in f.model_types)
            raise MoeConvertError(f"text_config of the wrong type for {mt}", file=CONFIG_NAME,
                                  tensor="text_config.model_type", expected=f"one of {allowed}", found=inner)
        mt = inner
    if own is None:
        known = ", ".join(t for f in FAMILIES if not f.refused for t in f.model_types)
        raise MoeConvertError("unknown model family", file=CONFIG_NAME, tensor="model_type",
                              expected=f"one of {known}", found=mt)
    if own.refused:
        raise MoeConvertError(f"{own.name} is not supported: {own.refused}", file=CONFIG_NAME, tensor="model_type",
                              found=mt)
    return own.name
