"""Decode: a chunk of one layer's experts, read from the source, to the canonical block.

Integers in, integers out: compressed-tensors words are unpacked to the stored unsigned fields, scales
keep their stored dtype, nothing is dequantized. TP/EP cuts follow vLLM 0.33.0's loader
(docs/format.md), so the block equals what one rank holds before backend processing:

* gate and up rows are cut contiguously per rank (``[r*I/tp, (r+1)*I/tp)`` of each);
* down is cut along K (its I columns), its group scales / zero points on group columns;
* channelwise down scales ``[H, 1]`` are not cut: every rank holds the whole tensor;
* EP takes the rank's experts ("linear" placement, :meth:`Partition.expert_range`).
"""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock, Partition
from moeconvert.errors import MoeConvertError
from moeconvert.format.families import FUSED, FUSED_INTERLEAVED
from moeconvert.modelmap import MoELayerMap
from moeconvert.packing import unpack_int32
from moeconvert.schemes import MXFP4Scheme, WNA16Scheme
from moeconvert.sources import Source


def partition_sizes(layer: MoELayerMap, part: Partition) -> tuple[int, int, int]:
    """(first local expert, local experts, I per TP rank) after checking the cut is possible."""
    if not 0 <= part.tp_rank < part.tp_size or not 0 <= part.ep_rank < part.ep_size:
        raise MoeConvertError("rank out of range", expected=f"tp_rank < {part.tp_size}, ep_rank < {part.ep_size}",
                              found=f"tp_rank {part.tp_rank}, ep_rank {part.ep_rank}")
    if part.ep_size > layer.num_experts:
        raise MoeConvertError("more EP ranks than experts", tensor=layer.prefix,
                              expected=f"ep_size <= {layer.num_experts}", found=part.ep_size)
    I = layer.intermediate_size
    if I % part.tp_size:
        raise MoeConvertError("intermediate size is not divisible by the TP size", tensor=layer.prefix,
                              expected=f"a multiple of {part.tp_size}", found=I)
    e0, e1 = part.expert_range(layer.num_experts)
    return e0, e1 - e0, I // part.tp_size


def decode_chunk(source: Source, layer: MoELayerMap, part: Partition, e0: int, e1: int) -> ExpertBlock:
    """Canonical block of global experts [e0, e1) of ``layer``, cut for ``part``'s TP rank."""
    if layer.fused:
        return _decode_fused(source, layer, part, e0, e1)
    experts = layer.experts[e0:e1]
    s = layer.scheme
    _, _, Ip = partition_sizes(layer, part)
    r = part.tp_rank
    rows = slice(r * Ip, (r + 1) * Ip)  # gate/up rows of this rank; down K columns of this rank

    def stack(role: str, suffix: str, fn) -> torch.Tensor:
        return torch.stack([fn(source.read(ex[role][suffix]), ex[role][suffix]) for ex in experts])

    kw = {}
    if isinstance(s, WNA16Scheme):
        H, I = layer.hidden_size, layer.intermediate_size
        for ex in experts:
            _check_weight_shape(source, ex, H, I)

        def codes(k: int):
            return lambda t, _n: unpack_int32(t, s.bits, k, dim=1)

        def zeros(n: int):
            return lambda t, _n: unpack_int32(t, s.bits, n, dim=0)

        gate, up = stack("gate", "weight_packed", codes(H)), stack("up", "weight_packed", codes(H))
        kw["w13"] = torch.cat([gate[:, rows], up[:, rows]], 1)
        kw["w2"] = stack("down", "weight_packed", codes(I))[:, :, rows].contiguous()
        kw["w13_scale"] = torch.cat([stack("gate", "weight_scale", _same)[:, rows],
                                     stack("up", "weight_scale", _same)[:, rows]], 1)
        gcols = slice(None) if s.group_size == -1 else slice(r * Ip // s.group_size, (r + 1) * Ip // s.group_size)
        kw["w2_scale"] = stack("down", "weight_scale", _same)[:, :, gcols].contiguous()
        if not s.symmetric:
            kw["w13_zero"] = torch.cat([stack("gate", "weight_zero_point", zeros(I))[:, rows],
                                        stack("up", "weight_zero_point", zeros(I))[:, rows]], 1)
            kw["w2_zero"] = stack("down", "weight_zero_point", zeros(H))[:, :, gcols].contiguous()
    else:
        kw["w13"] = torch.cat([stack("gate", "weight", _same)[:, rows], stack("up", "weight", _same)[:, rows]], 1)
        kw["w2"] = stack("down", "weight", _same)[:, :, rows].contiguous()
    if layer.has_bias:
        kw["w13_bias"] = torch.cat([stack("gate", "bias", _same)[:, rows], stack("up", "bias", _same)[:, rows]], 1)
        kw["w2_bias"] = stack("down", "bias", _same)
    return ExpertBlock(scheme=s, **kw)


def _same(t: torch.Tensor, _name: str) -> torch.Tensor:
    return t


def _check_weight_shape(source: Source, ex: dict, H: int, I: int) -> None:
    for role, want in (("gate", [I, H]), ("up", [I, H]), ("down", [H, I])):
        name = ex[role]["weight_shape"]
        got = [int(x) for x in source.read(name).tolist()]
        if got != want:
            raise MoeConvertError("weight_shape disagrees with the layer", file=source.info(name).file.name,
                                  tensor=name, expected=want, found=got)


def _decode_fused(source: Source, layer: MoELayerMap, part: Partition, e0: int, e1: int) -> ExpertBlock:
    """Fused 3-D experts, read one chunk of experts at a time (``rows=(e0, e1)``: the chunk's bytes only,
    never the whole tensor), in the orientation the family declares (moeconvert/format/families.py):

    * gpt-oss (``fused-transposed-interleaved``): gate/up interleaved (row 2j gate j, 2j+1 up j) -> [gate; up]
      rows. Float: ``gate_up_proj [E, H, 2I]`` (x @ W), ``down_proj [E, I, H]``. MXFP4 (docs/format.md):
      ``gate_up_proj_blocks [E, 2I, H/32, 16]`` / ``_scales [E, 2I, H/32]``, ``down_proj_blocks [E, H, I/32, 16]``
      / ``_scales [E, H, I/32]``. vLLM's gpt-oss loader gives the down bias to TP rank 0 only (the others
      hold zeros, so the all-reduce adds it once).
    * ``fused`` (Qwen3.5): ``gate_up_proj [E, 2I, H]``, gate rows then up rows; ``down_proj [E, H, I]``.
    * ``fused-transposed`` (Llama 4): ``gate_up_proj [E, H, 2I]``, gate columns then up columns; ``down_proj
      [E, I, H]`` (vLLM's Llama4 loader transposes both and chunks gate_up in two along 2I).
    """
    _, _, Ip = partition_sizes(layer, part)
    r = part.tp_rank
    rows = slice(r * Ip, (r + 1) * Ip)
    I = layer.intermediate_size
    gu_names, dn_names = layer.fused_names["gate_up"], layer.fused_names["down"]
    interleaved = layer.storage == FUSED_INTERLEAVED

    def split(t: torch.Tensor) -> torch.Tensor:  # [e, 2I, ...] -> [e, 2Ip, ...] as [gate; up] of this rank
        if interleaved:
            return torch.cat([t[:, 0::2][:, rows], t[:, 1::2][:, rows]], 1).contiguous()
        return torch.cat([t[:, :I][:, rows], t[:, I:][:, rows]], 1).contiguous()

    kw = {}
    if isinstance(layer.scheme, MXFP4Scheme):
        if Ip % 32:
            raise MoeConvertError("MXFP4 experts cut for TP need whole 32-blocks per rank (vLLM's uneven "
                                  "last-rank split is not written)", tensor=layer.prefix,
                                  expected="intermediate_size / tp_size a multiple of 32", found=Ip)
        n = e1 - e0
        gu = source.read(gu_names["_blocks"], rows=(e0, e1))
        kw["w13"] = split(gu.view(n, gu.shape[1], -1))
        kw["w13_scale"] = split(_finite_e8m0(source, gu_names["_scales"], e0, e1))
        dn = source.read(dn_names["_blocks"], rows=(e0, e1))
        kw["w2"] = dn.view(n, dn.shape[1], -1)[:, :, r * Ip // 2:(r + 1) * Ip // 2].contiguous()
        kw["w2_scale"] = _finite_e8m0(source, dn_names["_scales"], e0, e1)[:, :, r * Ip // 32:(r + 1) * Ip // 32].contiguous()
    elif layer.storage == FUSED:
        kw["w13"] = split(source.read(gu_names["weight"], rows=(e0, e1)))
        kw["w2"] = source.read(dn_names["weight"], rows=(e0, e1))[:, :, rows].contiguous()
    else:
        kw["w13"] = split(source.read(gu_names["weight"], rows=(e0, e1)).transpose(1, 2))
        kw["w2"] = source.read(dn_names["weight"], rows=(e0, e1)).transpose(1, 2)[:, :, rows].contiguous()
    if layer.has_bias:
        kw["w13_bias"] = split(source.read(gu_names["_bias"], rows=(e0, e1)))
        b2 = source.read(dn_names["_bias"], rows=(e0, e1))
        kw["w2_bias"] = torch.zeros_like(b2) if part.tp_size > 1 and r != 0 else b2
    return ExpertBlock(scheme=layer.scheme, **kw)


def _finite_e8m0(source: Source, name: str, e0: int, e1: int) -> torch.Tensor:
    """e8m0 scale bytes of experts [e0, e1); 0xFF is e8m0's NaN, which no quantizer writes and no kernel
    reads as a scale: refused (as the float path refuses non-finite weights), never carried into the output."""
    t = source.read(name, rows=(e0, e1))
    bad = (t == 255).nonzero()
    if len(bad):
        e, *rest = (int(x) for x in bad[0])
        raise MoeConvertError("non-finite e8m0 scale (0xFF is NaN)", file=source.info(name).file.name,
                              tensor=f"{name}[{e0 + e}, {', '.join(map(str, rest))}]", expected="0..254", found=255)
    return t
