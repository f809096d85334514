"""FP8 checkpoints with 128x128 block scales (``quant_method: fp8``, ``weight_block_size: [128, 128]``), as
DeepSeek-V3/R1 and the MiniMax/GLM FP8 releases ship them (docs/sources.md).

Per projection: ``weight [N, K]`` float8_e4m3fn and ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` fp32, the
value being ``weight * weight_scale_inv`` of its block. The reader dequantizes: each element's fp32 product
with its block's scale (one rounding), cast to bf16 (round to nearest even), as DeepSeek's own
``fp8_cast_bf16`` and transformers' ``Fp8Dequantize`` do. vLLM has no dequantization of its own to follow
here: 0.34.0's online requantization (``OnlineMoEMethodBase`` with a source method's ``dequantize_weight``)
is not implemented by its FP8 MoE method, so ``moeconvert quantize --format mxfp4`` on such a checkpoint
is this dequantization followed by vLLM's online MXFP4 quantization of the bf16 experts.

The canonical block is therefore float (bf16): ``quantize`` takes it like any bf16 checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, config_value, show_value
from moeconvert.readers.base import ROLES, Expert, Projection, Reader, expect_dtype, expect_shape, suffix_list
from moeconvert.readers.registry import register
from moeconvert.schemes import FloatScheme, Scheme
from moeconvert.sources import Source

BLOCK = 128
#: the dtype the weights are dequantized to (the dtype of the models these checkpoints are made from)
DEQUANT_DTYPE = "bfloat16"


@dataclass(frozen=True)
class FP8BlockConfig:
    ignored: tuple[str, ...]  # module prefixes left unquantized (``ignored_layers`` / ``modules_to_not_convert``)


def _refuse(section: str, key: str, message: str, expected: str, value) -> MoeConvertError:
    return MoeConvertError(message, file=CONFIG_NAME, tensor=section + key, expected=expected, found=show_value(value))


def block_scales(scale_inv: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``[ceil(n/128), ceil(k/128)]`` block scales -> one per element ``[n, k]`` (the last blocks partial)."""
    return scale_inv.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[n, k]`` x fp32 block scales -> bf16: the fp32 product rounded once, then cast."""
    n, k = weight.shape
    return (weight.float() * block_scales(scale_inv.float(), n, k)).to(torch.bfloat16)


@register
class FP8Block(Reader):
    name = "fp8"
    title = "FP8 e4m3, 128x128 block scales (dequantized to bf16)"
    quant_method = "fp8"
    suffixes = frozenset({"weight", "weight_scale_inv"})
    #: the block scales' suffix (DeepSeek-V4's own checkpoints name it ``scale``: readers/deepseek_v4.py)
    scale_suffix = "weight_scale_inv"

    @classmethod
    def parse_config(cls, qc: dict, section: str) -> FP8BlockConfig:
        block = qc.get("weight_block_size")
        if block != [BLOCK, BLOCK]:
            # per-tensor FP8 (no block size) and other block shapes are other formats
            raise _refuse(section, "weight_block_size", "only 128x128 block scales are read", "[128, 128]", block)
        fmt = config_value(qc, "fmt", str, default="e4m3", section=section)
        if fmt != "e4m3":
            raise _refuse(section, "fmt", "only e4m3 weights are read", "e4m3", fmt)
        # vLLM's Fp8Config: activation_scheme is required, and block-wise weights take dynamic activations only
        scheme = config_value(qc, "activation_scheme", str, section=section)
        if scheme != "dynamic":
            raise _refuse(section, "activation_scheme", "vLLM's block-wise FP8 takes dynamic activations only",
                          "dynamic", scheme)
        # its ignored layers: ``ignored_layers``, else ``modules_to_not_convert``
        ignored = config_value(qc, "ignored_layers", list, default=None, section=section) or []
        key = "ignored_layers"
        if not ignored:
            key, ignored = "modules_to_not_convert", config_value(qc, "modules_to_not_convert", list, default=None,
                                                                  section=section) or []
        for i, m in enumerate(ignored):
            if not isinstance(m, str):
                raise _refuse(section, f"{key}[{i}]", "not a module name", "a string", m)
        return FP8BlockConfig(tuple(ignored))

    def quantizes(self, config: FP8BlockConfig, prefix: str) -> bool:
        """vLLM leaves the experts unquantized when their layer's name is in the list (``is_layer_skipped``,
        its default "exact" match)."""
        return prefix not in config.ignored

    def scheme(self, source: Source, prefix: str, first: Expert, config) -> Scheme:
        if not {"weight", self.scale_suffix} <= set(first["gate"]):
            raise MoeConvertError("quantization_config says the experts are FP8 with block scales, but their "
                                  "tensors are not", file=str(source.ident), tensor=f"{prefix}.0",
                                  expected=f"weight + {self.scale_suffix}", found=suffix_list(first))
        return FloatScheme(DEQUANT_DTYPE)

    def required(self, scheme: Scheme) -> frozenset[str]:
        return self.suffixes

    def shapes(self, source: Source, prefix: str, first: Expert, scheme: Scheme) -> tuple[int, int]:
        I, H = source.tensors[first["gate"]["weight"]].shape
        for r, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            expect_dtype(source, first[r]["weight"], ("F8_E4M3",))
            expect_dtype(source, first[r][self.scale_suffix], ("F32", "BF16"))
            expect_shape(source, first[r]["weight"], (n, k))
            expect_shape(source, first[r][self.scale_suffix], (-(-n // BLOCK), -(-k // BLOCK)))
        return H, I

    def projection(self, source: Source, names: dict[str, str], scheme: Scheme, config, n: int, k: int) -> Projection:
        w, s = source.read(names["weight"]), source.read(names[self.scale_suffix])
        bad = ~torch.isfinite(s)
        if bool(bad.any()):
            raise MoeConvertError("FP8 block scales must be finite", file=source.info(names[self.scale_suffix]).file.name,
                                  tensor=names[self.scale_suffix], expected="finite values",
                                  found=f"{int(bad.sum())} NaN/inf")
        nan = (w.view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            raise MoeConvertError("NaN FP8 weight", file=source.info(names["weight"]).file.name, tensor=names["weight"],
                                  expected="finite e4m3 values", found=f"{int(nan.sum())} NaN")
        return Projection(dequantize_fp8_block(w, s))
