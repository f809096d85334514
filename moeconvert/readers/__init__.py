"""Source-format readers: one per checkpoint format, registered under the string config.json uses for it
(docs/architecture.md, "Readers"). Importing this package registers every reader."""

from moeconvert.readers.base import Expert, LayerNames, Projection, Reader
from moeconvert.readers.registry import SourceFormat, get_reader, reader_names, register, source_format

# one module per format; importing it registers its reader
from moeconvert.readers import unquantized, pack_quantized, gpt_oss_mxfp4, gptq, awq, auto_round, ct_fp4, fp8_block, deepseek_v4  # noqa: E402,F401  isort: skip

__all__ = ["Expert", "LayerNames", "Projection", "Reader", "SourceFormat", "get_reader", "reader_names", "register",
           "source_format"]
