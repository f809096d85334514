"""DeepSeek-V4's own checkpoints (docs/sources.md, "DeepSeek-V4"): ``quant_method: fp8`` with 128x128 block
scales for the linear layers, and routed experts in the dtype config.json's top-level ``expert_dtype`` names.

vLLM 0.33.0 / 0.34.0 serve them through ``DeepseekV4FP8Config`` (vllm/models/deepseek_v4/quant_config.py),
which a DeepSeek-V4 config gets in place of ``fp8`` (its ``override_quantization_method``). Its
``get_quant_method`` picks the routed experts' method by ``expert_dtype`` (absent: ``fp4``):

* ``fp4`` (DeepSeek-V4-Flash / Pro): ``Mxfp4MoEMethod``. Each expert projection ``ffn.experts.E.w{1,2,3}``
  holds ``weight [N, K/2]`` int8, two e2m1 codes a byte, and ``scale [N, K/32]`` float8_e8m0fnu, one
  power-of-two scale per 32 along K. The model's weights mapper (``_make_deepseek_v4_weights_mapper``)
  renames the experts' ``.scale`` to ``.weight_scale``; its ``load_weights`` views e8m0 scales as uint8 and
  the expert loader copies the int8 codes into the method's uint8 parameters, bits unchanged. That is the
  canonical MXFP4 block as it is (e2m1 code 2j in the low nibble of byte j, the e8m0 byte), the same bytes
  compressed-tensors' ``mxfp4-pack-quantized`` stores: the reader is that one with DeepSeek's names.
* ``fp8`` (DeepSeek-V4-Flash-Base): ``Fp8MoEMethod`` with block scales. ``weight [N, K]`` float8_e4m3fn and
  ``scale [ceil(N/128), ceil(K/128)]`` fp32 (the mapper renames ``.scale`` to ``.weight_scale_inv``):
  the FP8 block reader's format under DeepSeek's scale name, dequantized to bf16 as that reader does.

Experts of a layer in the config's ``ignored_layers`` are left unquantized by vLLM (``is_layer_skipped``)
and read as float, as for ``fp8``. vLLM's NVFP4 routed experts (``moe_quant_algo: NVFP4``) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, show_value
from moeconvert.readers.base import Expert
from moeconvert.readers.ct_fp4 import MXFP4PackQuantized
from moeconvert.readers.fp8_block import FP8Block, FP8BlockConfig
from moeconvert.readers.registry import register
from moeconvert.schemes import MXFP4Scheme, Scheme
from moeconvert.sources import Source

#: ``DeepseekV4FP8Config``'s ``_DEEPSEEK_V4_EXPERT_DTYPES``
EXPERT_DTYPES = ("fp4", "fp8")


@dataclass(frozen=True)
class DeepseekV4Config:
    expert_dtype: str  # config.json ``expert_dtype``: fp4 or fp8
    ignored: tuple[str, ...]  # as FP8BlockConfig's

    def reader_name(self) -> str:
        return f"deepseek-v4-{self.expert_dtype}"


def parse_config(config: dict, qc: dict, section: str) -> DeepseekV4Config:
    """The checkpoint's quantization: the FP8 block config (as ``fp8``'s) and the experts' ``expert_dtype``."""
    dtype = config.get("expert_dtype", "fp4")
    if dtype not in EXPERT_DTYPES:
        # DeepseekV4FP8Config.expert_dtype raises for any other value
        raise MoeConvertError("unsupported DeepSeek-V4 expert_dtype", file=CONFIG_NAME, tensor="expert_dtype",
                              expected=" or ".join(EXPERT_DTYPES), found=show_value(dtype))
    algo = qc.get("moe_quant_algo")
    if algo:
        # DeepseekV4FP8Config.get_quant_method: NVFP4 routed experts (ModelOptNvFp4FusedMoE), not read here
        raise MoeConvertError("DeepSeek-V4 routed experts in another format than its own are not read",
                              file=CONFIG_NAME, tensor=section + "moe_quant_algo", expected="absent",
                              found=show_value(algo))
    fp8: FP8BlockConfig = FP8Block.parse_config(qc, section)
    return DeepseekV4Config(dtype, fp8.ignored)


@register
class DeepseekV4Fp4(MXFP4PackQuantized):
    name = "deepseek-v4-fp4"
    title = "DeepSeek-V4 FP4 experts (MXFP4: int8 e2m1 pairs, e8m0 scales)"
    compressed_tensors = False
    weight_suffix, scale_suffix = "weight", "scale"
    weight_dtypes = ("I8", "U8")
    suffixes = required_suffixes = frozenset({"weight", "scale"})

    def quantizes(self, config: DeepseekV4Config, prefix: str) -> bool:
        return prefix not in config.ignored

    def scheme(self, source: Source, prefix: str, first: Expert, config: DeepseekV4Config) -> Scheme:
        if not {"weight", "scale"} <= set(first["gate"]):
            raise MoeConvertError("config.json says DeepSeek-V4's experts are FP4 (expert_dtype), but their tensors "
                                  "are not", file=str(source.ident), tensor=f"{prefix}.0",
                                  expected="weight + scale", found=", ".join(sorted(first["gate"])))
        return MXFP4Scheme()


@register
class DeepseekV4Fp8(FP8Block):
    name = "deepseek-v4-fp8"
    title = "DeepSeek-V4 FP8 experts, 128x128 block scales (dequantized to bf16)"
    quant_method = None  # chosen by expert_dtype (registry.SourceFormat.layer)
    scale_suffix = "scale"
    suffixes = frozenset({"weight", "scale"})

    def quantizes(self, config: DeepseekV4Config, prefix: str) -> bool:
        return prefix not in config.ignored
