"""The output format, in one place (docs/format.md): safetensors headers (read and validated), config.json
values, and the manifest ``moeconvert.json`` (its name, version, reading and field validation). The
converter (sources, writer, convert), ``verify`` and the runtime all read these names from here.

This is the bottom layer: it imports nothing of moeconvert but its error type. Checking an output against
the layouts that wrote it is ``moeconvert.layouts.output.check_output``."""

from moeconvert.format.config import CONFIG_NAME, MODEL_TYPES, config_int, config_number, config_value, family_name
from moeconvert.format.manifest import (FORMAT_VERSION, HEADER_CHECKSUMS_SINCE, MANIFEST_NAME, header_sha256,
                                        read_manifest)
from moeconvert.format.safetensors import (DTYPES, FLOAT_DTYPES, INDEX_NAME, TORCH_TO_CODE, TensorInfo, read_header,
                                           show_value)

__all__ = ["CONFIG_NAME", "DTYPES", "FLOAT_DTYPES", "FORMAT_VERSION", "HEADER_CHECKSUMS_SINCE", "INDEX_NAME",
           "MANIFEST_NAME", "MODEL_TYPES", "TORCH_TO_CODE", "TensorInfo", "config_int", "config_number",
           "config_value", "family_name", "header_sha256", "read_header", "read_manifest", "show_value"]
