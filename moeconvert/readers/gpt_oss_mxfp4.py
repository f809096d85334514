"""gpt-oss' own MXFP4 (``quant_method: mxfp4``; docs/quantize.md): fused experts, N-first, rows of
gate_up interleaved gate/up, low nibble = even k, one e8m0 scale per 32 along K.

``gate_up_proj_blocks [E, 2I, H/32, 16]`` / ``_scales [E, 2I, H/32]``, ``down_proj_blocks
[E, H, I/32, 16]`` / ``_scales [E, H, I/32]``, optional ``_bias`` as the float form's.
"""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock, Partition
from moeconvert.errors import MoeConvertError
from moeconvert.format.families import FUSED_INTERLEAVED
from moeconvert.readers.base import Reader, expect_shape
from moeconvert.readers.registry import register
from moeconvert.readers.unquantized import check_fused_bias, deinterleave, fused_bias
from moeconvert.schemes import MXFP4Scheme, Scheme
from moeconvert.sources import Source


@register
class GptOssMxfp4(Reader):
    name = "mxfp4"
    title = "gpt-oss MXFP4"
    quant_method = "mxfp4"
    suffixes = frozenset()  # no per-expert form
    fused_suffixes = frozenset({"_blocks", "_scales", "_bias"})

    def scheme(self, source: Source, prefix: str, first, config) -> Scheme:
        raise MoeConvertError("gpt-oss MXFP4 experts are stored fused (gate_up_proj_blocks / down_proj_blocks), "
                              "not per expert", file=str(source.ident), tensor=f"{prefix}.0")

    def fused_scheme(self, source: Source, prefix: str, names, sizes, storage: str) -> Scheme:
        t = source.tensors
        gu, dn = names.get("gate_up", {}), names.get("down", {})
        E, H, I = sizes.E, sizes.H, sizes.I
        if storage != FUSED_INTERLEAVED:
            # the blocks/scales form is gpt-oss' own: no other family stores its experts this way
            name = next((by[k] for by in (gu, dn) for k in ("_blocks", "_scales") if k in by), prefix)
            raise MoeConvertError("experts in gpt-oss' MXFP4 blocks/scales form, but the family stores them "
                                  f"{storage}", file=str(source.ident), tensor=name,
                                  expected=FUSED_INTERLEAVED + " (gpt-oss)", found=storage)
        for proj, by in (("gate_up_proj", gu), ("down_proj", dn)):
            if "weight" in by:
                raise MoeConvertError("quant_method mxfp4 but the experts are stored unquantized", file="config.json",
                                      tensor=by["weight"], expected=f"{proj}_blocks and {proj}_scales",
                                      found=proj)
            for suffix in ("_blocks", "_scales"):
                if suffix not in by:
                    raise MoeConvertError("missing expert tensor", file=str(source.ident),
                                          tensor=f"{prefix}.{proj}{suffix}", expected="present", found="missing")
                if t[by[suffix]].dtype != "U8":
                    raise MoeConvertError("MXFP4 blocks and scales must be uint8", file=t[by[suffix]].file.name,
                                          tensor=by[suffix], expected="U8", found=t[by[suffix]].dtype)
        for n, k, blocks, scales in ((2 * I, H, gu["_blocks"], gu["_scales"]), (H, I, dn["_blocks"], dn["_scales"])):
            if k % 32:
                raise MoeConvertError("MXFP4 experts need K divisible by 32", tensor=blocks,
                                      expected="a multiple of 32", found=k)
            expect_shape(source, blocks, (E, n, k // 32, 16))
            expect_shape(source, scales, (E, n, k // 32))
        check_fused_bias(source, prefix, gu, dn, E, H, I)
        return MXFP4Scheme()

    def decode_fused(self, source: Source, layer, part: Partition, e0: int, e1: int) -> ExpertBlock:
        Ip = layer.intermediate_size // part.tp_size
        r = part.tp_rank
        if Ip % 32:
            raise MoeConvertError("MXFP4 experts cut for TP need whole 32-blocks per rank (vLLM's uneven "
                                  "last-rank split is not written)", tensor=layer.prefix,
                                  expected="intermediate_size / tp_size a multiple of 32", found=Ip)
        rows = slice(r * Ip, (r + 1) * Ip)
        gu, dn = layer.fused_names["gate_up"], layer.fused_names["down"]
        n = e1 - e0
        w13 = source.read(gu["_blocks"], rows=(e0, e1))
        w2 = source.read(dn["_blocks"], rows=(e0, e1))
        kw = {"w13": deinterleave(w13.view(n, w13.shape[1], -1), rows),
              "w13_scale": deinterleave(finite_e8m0(source, gu["_scales"], e0, e1), rows),
              "w2": w2.view(n, w2.shape[1], -1)[:, :, r * Ip // 2:(r + 1) * Ip // 2].contiguous(),
              "w2_scale": finite_e8m0(source, dn["_scales"], e0, e1)[:, :, r * Ip // 32:(r + 1) * Ip // 32].contiguous()}
        kw.update(fused_bias(source, layer, part, e0, e1, rows))
        return ExpertBlock(scheme=layer.scheme, **kw)


def finite_e8m0(source: Source, name: str, e0: int, e1: int) -> torch.Tensor:
    """e8m0 scale bytes of experts [e0, e1); 0xFF is e8m0's NaN, which no quantizer writes and no kernel
    reads as a scale: refused (as the float path refuses non-finite weights), never carried into the output."""
    t = source.read(name, rows=(e0, e1))
    bad = (t == 255).nonzero()
    if len(bad):
        e, *rest = (int(x) for x in bad[0])
        raise MoeConvertError("non-finite e8m0 scale (0xFF is NaN)", file=source.info(name).file.name,
                              tensor=f"{name}[{e0 + e}, {', '.join(map(str, rest))}]", expected="0..254", found=255)
    return t
