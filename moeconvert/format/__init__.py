"""The output format, in one place (docs/format.md): safetensors headers (read and validated), config.json
values, and the manifest ``moeconvert.json`` (its name, version, reading and checking). The converter
(sources, writer, convert), ``verify`` and the runtime all read these names from here."""

from moeconvert.format.config import CONFIG_NAME, MODEL_TYPES, config_int, config_number, config_value, family_name
from moeconvert.format.safetensors import DTYPES, INDEX_NAME, TORCH_TO_CODE, TensorInfo, read_header, show_value

# The manifest's names load on first use: the manifest checker reads the canonical block and the
# layouts, whose schemes read config values from here (an eager import would be a cycle).
_MANIFEST = ("FORMAT_VERSION", "HEADER_CHECKSUMS_SINCE", "MANIFEST_NAME", "CheckedLayer", "CheckedOutput",
             "check_output", "header_sha256", "read_manifest")


def __getattr__(name: str):
    if name in _MANIFEST:
        from moeconvert.format import manifest

        return getattr(manifest, name)
    raise AttributeError(f"module 'moeconvert.format' has no attribute {name!r}")


__all__ = ["CONFIG_NAME", "DTYPES", "INDEX_NAME", "MODEL_TYPES", "TORCH_TO_CODE", "TensorInfo", "config_int",
           "config_number", "config_value", "family_name", "read_header", "show_value", *_MANIFEST]
