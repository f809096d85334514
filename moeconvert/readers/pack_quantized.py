"""compressed-tensors ``pack-quantized`` experts (int2..int8 WNA16, docs/format.md).

Per projection: ``weight_packed [N, ceil(K/pf)]`` int32 (signed codes + 2^(b-1), packed LSB-first along
K), ``weight_scale [N, G]``, ``weight_shape [2]`` (N, K) and, asymmetric, ``weight_zero_point
[ceil(N/pf), G]`` int32 packed along N. The stored fields are the canonical unsigned codes and zero points.
"""

from __future__ import annotations

from moeconvert.errors import MoeConvertError
from moeconvert.packing import unpack_int32
from moeconvert.readers.base import (INT_DTYPES, Expert, Projection, Reader, expect_dtype, expect_finite,
                                     expect_shape, suffix_list)
from moeconvert.readers.registry import register
from moeconvert.schemes import CompressedTensorsConfig, Scheme, WNA16Scheme, float_dtype_name
from moeconvert.sources import Source


@register
class PackQuantized(Reader):
    name = "pack-quantized"
    title = "compressed-tensors pack-quantized"
    compressed_tensors = True
    suffixes = frozenset({"weight_packed", "weight_scale", "weight_shape", "weight_zero_point"})

    def scheme(self, source: Source, prefix: str, first: Expert, config: CompressedTensorsConfig) -> Scheme:
        suffixes = set(first["gate"])
        if "weight_packed" not in suffixes:
            if "weight" in suffixes:
                raise MoeConvertError("quantization_config says the experts are quantized, but they are stored "
                                      "unpacked (weight, not weight_packed)", file="config.json", tensor=prefix)
            raise MoeConvertError("unrecognised expert tensors", file=str(source.ident), tensor=f"{prefix}.0",
                                  expected="weight_packed + weight_scale", found=suffix_list(first))
        scale_dtype = (float_dtype_name(source.tensors[first["gate"]["weight_scale"]].dtype)
                       if "weight_scale" in suffixes else None)
        if scale_dtype is None:
            raise MoeConvertError("packed experts need a float weight_scale", file=str(source.ident),
                                  tensor=f"{prefix}.0", expected="weight_scale in BF16, F16 or F32",
                                  found=suffix_list(first))
        names = {role: first[role]["weight_packed"].rsplit(".", 1)[0] for role in ("gate", "up", "down")
                 if "weight_packed" in first[role]}
        scheme = config.scheme_for(names, scale_dtype)
        if scheme is None:
            raise MoeConvertError("experts are packed but quantization_config's targets/ignore leave them "
                                  "unquantized", file="config.json", tensor=prefix)
        return scheme

    def required(self, scheme: WNA16Scheme) -> frozenset[str]:
        return self.suffixes if not scheme.symmetric else self.suffixes - {"weight_zero_point"}

    def shapes(self, source: Source, prefix: str, first: Expert, scheme: WNA16Scheme) -> tuple[int, int]:
        t = source.tensors
        for r in ("gate", "up", "down"):
            # every expert matches expert 0 (Reader.check), so expert 0's dtypes speak for the layer
            expect_dtype(source, first[r]["weight_packed"], ("I32",))
            expect_dtype(source, first[r]["weight_shape"], INT_DTYPES)
            expect_shape(source, first[r]["weight_shape"], (2,))
            if not scheme.symmetric:
                expect_dtype(source, first[r]["weight_zero_point"], ("I32",))
        pf = scheme.pack_factor
        shapes = {r: _weight_shape(source, first[r]["weight_shape"]) for r in ("gate", "up", "down")}
        I, H = shapes["gate"]
        expect_shape(source, first["gate"]["weight_packed"], (I, -(-H // pf)))
        for r, shp in (("up", (I, H)), ("down", (H, I))):
            if shapes[r] != shp:
                raise MoeConvertError("weight_shape disagrees with the gate projection", file=str(source.ident),
                                      tensor=first[r]["weight_shape"], expected=list(shp), found=list(shapes[r]))
        for r, (n, k) in (("up", (I, H)), ("down", (H, I))):
            expect_shape(source, first[r]["weight_packed"], (n, -(-k // pf)))
        for r, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            expect_shape(source, first[r]["weight_scale"], (n, scheme.groups(k)))
            if scheme.group_size > 0 and k % scheme.group_size:
                raise MoeConvertError("input size is not a multiple of the group size", file=str(source.ident),
                                      tensor=first[r]["weight_packed"], expected=f"multiple of {scheme.group_size}",
                                      found=k)
            if not scheme.symmetric:
                expect_shape(source, first[r]["weight_zero_point"], (-(-n // pf), scheme.groups(k)))
        return H, I

    def projection(self, source: Source, names: dict[str, str], scheme: WNA16Scheme, config, n: int,
                   k: int) -> Projection:
        # weight_shape is read again for every expert: only expert 0's was read when the layer was mapped
        got = _weight_shape(source, names["weight_shape"])
        if got != (n, k):
            raise MoeConvertError("weight_shape disagrees with the layer", file=source.info(names["weight_shape"]).file.name,
                                  tensor=names["weight_shape"], expected=[n, k], found=list(got))
        zero = None
        if not scheme.symmetric:
            zero = unpack_int32(source.read(names["weight_zero_point"]), scheme.bits, n, dim=0)
        scale = expect_finite(source, names["weight_scale"], source.read(names["weight_scale"]))
        return Projection(unpack_int32(source.read(names["weight_packed"]), scheme.bits, k, dim=1), scale, zero)


def _weight_shape(source: Source, name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in source.read(name).tolist())
