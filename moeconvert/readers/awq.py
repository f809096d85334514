"""AWQ experts (``quant_method: awq``, ``version: gemm``, as AutoAWQ and AutoRound write them; docs/sources.md).

Per projection: ``qweight [K, N/8]`` int32 packed along N, ``qzeros [G, N/8]`` int32 packed the same way,
``scales [G, N]`` (fp16), optional ``bias [N]``. AWQ's GEMM packing puts column ``8j + ORDER[i]`` in bits
``[4i, 4i + 4)`` of word ``j``, ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``; the weight is ``(q - z) * s``.

Read as vLLM 0.33.0 / 0.34.0 serve AWQ MoE (quantization/auto_awq.py ``AutoAWQConfig`` and
``AutoAWQMoEMethod``): 4 bits only, with zero points (its Marlin path refuses a layer without them),
groups of ``group_size`` along K; ``modules_to_not_convert`` leaves a layer float when one of its entries
is a substring of the layer's name (``is_layer_skipped``, match_mode "substring"). The canonical block
is the natural-order codes and zero points (unsigned, as stored) with the scales: the asymmetric WNA16
block compressed-tensors checkpoints decode to as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, config_int, config_value, show_value
from moeconvert.packing import unpack_int32
from moeconvert.readers.base import (FLOAT_DTYPES, Expert, Projection, Reader, expect_dtype, expect_finite,
                                     expect_shape, suffix_list)
from moeconvert.readers.registry import register
from moeconvert.schemes import Scheme, WNA16Scheme, float_dtype_name
from moeconvert.sources import Source

#: AWQ's order of columns within a word (AutoAWQ's GEMM pack); its inverse reads them back in order, as
#: vLLM's auto_awq.py ``_REVERSE_AWQ_PACK_ORDER`` does
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_UNDO = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])


@dataclass(frozen=True)
class AWQConfig:
    group_size: int
    modules_to_not_convert: tuple[str, ...]


def _refuse(section: str, key: str, message: str, expected: str, value) -> MoeConvertError:
    return MoeConvertError(message, file=CONFIG_NAME, tensor=section + key, expected=expected,
                           found=show_value(value))


def _first_key(qc: dict, keys: tuple[str, ...]) -> str:
    """vLLM's ``get_from_keys``: the first of ``keys`` the config has (the first when it has none)."""
    return next((k for k in keys if k in qc), keys[0])


@register
class AWQ(Reader):
    name = "awq"
    title = "AWQ (GEMM)"
    quant_method = "awq"
    suffixes = frozenset({"qweight", "qzeros", "scales"})

    @classmethod
    def parse_config(cls, qc: dict, section: str) -> AWQConfig:
        version = config_value(qc, "version", str, default="gemm", section=section)
        if version.lower() != "gemm":
            # GEMV and the others pack differently; vLLM reads every AWQ checkpoint as GEMM
            raise _refuse(section, "version", "only AWQ's GEMM packing is read", "gemm", version)
        bits_key = _first_key(qc, ("w_bit", "bits"))
        bits = config_int(qc, bits_key, section=section)
        if bits != 4:
            raise _refuse(section, bits_key, "vLLM serves AWQ MoE experts with 4 bits only (AutoAWQMoEMethod)", "4",
                          bits)
        group_key = _first_key(qc, ("q_group_size", "group_size"))
        group_size = config_int(qc, group_key, min=-1, section=section)
        if group_size <= 0:
            raise _refuse(section, group_key, "AWQ MoE experts need groups along K (vLLM divides by the group "
                          "size)", "> 0", group_size)
        zero_point = config_value(qc, "zero_point", bool, section=section)
        if not zero_point:
            raise _refuse(section, "zero_point", "vLLM's AWQ MoE Marlin path needs zero points", "true", zero_point)
        skip = config_value(qc, "modules_to_not_convert", list, default=[], section=section)
        for i, m in enumerate(skip):
            if not isinstance(m, str):
                raise _refuse(section, f"modules_to_not_convert[{i}]", "invalid value", "a string", m)
        return AWQConfig(group_size=group_size, modules_to_not_convert=tuple(skip))

    def quantizes(self, config: AWQConfig, prefix: str) -> bool:
        return not any(m in prefix for m in config.modules_to_not_convert)

    def scheme(self, source: Source, prefix: str, first: Expert, config: AWQConfig) -> Scheme:
        suffixes = set(first["gate"])
        if "qweight" not in suffixes or "scales" not in suffixes:
            raise MoeConvertError("quant_method awq, but the experts are not AWQ-packed", file=str(source.ident),
                                  tensor=f"{prefix}.0", expected="qweight, qzeros, scales", found=suffix_list(first))
        scale_dtype = float_dtype_name(source.tensors[first["gate"]["scales"]].dtype)
        if scale_dtype is None:
            raise MoeConvertError("unexpected dtype", file=str(source.ident), tensor=first["gate"]["scales"],
                                  expected="F16, BF16 or F32", found=source.tensors[first["gate"]["scales"]].dtype)
        return WNA16Scheme(bits=4, group_size=config.group_size, symmetric=False, scale_dtype=scale_dtype)

    def shapes(self, source: Source, prefix: str, first: Expert, scheme: WNA16Scheme) -> tuple[int, int]:
        t = source.tensors
        for r in ("gate", "up", "down"):
            expect_dtype(source, first[r]["qweight"], ("I32",))
            expect_dtype(source, first[r]["qzeros"], ("I32",))
            expect_dtype(source, first[r]["scales"], FLOAT_DTYPES)
        H, _ = t[first["gate"]["qweight"]].shape
        I, _ = t[first["down"]["qweight"]].shape
        for r, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            if n % 8:
                raise MoeConvertError("AWQ packs whole int32 words along N", file=str(source.ident),
                                      tensor=first[r]["qweight"], expected="N a multiple of 8", found=n)
            if k % scheme.group_size:
                raise MoeConvertError("input size is not a multiple of the group size", file=str(source.ident),
                                      tensor=first[r]["qweight"], expected=f"multiple of {scheme.group_size}",
                                      found=k)
            expect_shape(source, first[r]["qweight"], (k, n // 8))
            expect_shape(source, first[r]["qzeros"], (k // scheme.group_size, n // 8))
            expect_shape(source, first[r]["scales"], (k // scheme.group_size, n))
        return H, I

    def projection(self, source: Source, names: dict[str, str], scheme: WNA16Scheme, config, n: int,
                   k: int) -> Projection:
        codes = unpack_awq(source.read(names["qweight"]), n).T.contiguous()
        zero = unpack_awq(source.read(names["qzeros"]), n).T.contiguous()
        scale = expect_finite(source, names["scales"], source.read(names["scales"])).T.contiguous()
        return Projection(codes, scale, zero)


def unpack_awq(words: torch.Tensor, n: int) -> torch.Tensor:
    """``[rows, n/8]`` AWQ words -> ``[rows, n]`` unsigned 4-bit fields in natural column order (uint8)."""
    fields = unpack_int32(words, 4, n, dim=1)  # column 8j + i holds AWQ column 8j + AWQ_ORDER[i]
    return fields.view(fields.shape[0], n // 8, 8)[:, :, _UNDO].reshape(fields.shape[0], n)
