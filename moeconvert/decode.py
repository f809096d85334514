"""Decode: a chunk of one layer's experts, read from the source, to the canonical block.

Integers in, integers out: each format's reader (moeconvert.readers) unpacks its words to the unsigned
fields, scales keep their stored dtype, nothing is dequantized. TP/EP cuts follow vLLM 0.33.0's loader
(docs/format.md), so the block equals what one rank holds before backend processing:

* gate and up rows are cut contiguously per rank (``[r*I/tp, (r+1)*I/tp)`` of each);
* down is cut along K (its I columns), its group scales / zero points on group columns;
* channelwise down scales ``[H, 1]`` are not cut: every rank holds the whole tensor;
* EP takes the rank's experts ("linear" placement, :meth:`Partition.expert_range`).
"""

from __future__ import annotations

from moeconvert.canonical import ExpertBlock, Partition
from moeconvert.errors import MoeConvertError
from moeconvert.modelmap import MoELayerMap
from moeconvert.readers import get_reader
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
    """Canonical block of global experts [e0, e1) of ``layer``, cut for ``part``'s TP rank, by the reader
    of the layer's checkpoint format (moeconvert.readers)."""
    partition_sizes(layer, part)
    return get_reader(layer.format).decode(source, layer, part, e0, e1)
