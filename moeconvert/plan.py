"""The plan of one conversion: what is written where, fixed before any byte is written.

:func:`plan_conversion` reads only headers and a few tiny tensors: it maps the model, asks the layout
for every layer's constraints (all layers, all problems, before any byte is written) and fixes the
output's shards, every tensor's file and offset (:func:`layout_shards`). Everything above reads the
plan: :mod:`moeconvert.jobs` cuts it into jobs, :mod:`moeconvert.writer` makes its files,
:mod:`moeconvert.convert` runs it. This module imports none of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from dataclasses import dataclass, field

from moeconvert.canonical import LayerShape, Partition
from moeconvert.decode import partition_sizes
from moeconvert.errors import MoeConvertError
from moeconvert.format import TORCH_TO_CODE
from moeconvert.layouts import Layout, TensorSpec, get_layout
from moeconvert.modelmap import ModelMap, MoELayerMap, map_model
from moeconvert.quantize import Quantization, output_problems, padded_sizes
from moeconvert.schemes import FloatScheme, MXFP4Scheme, NVFP4Scheme, Scheme, WNA16Scheme
from moeconvert.sources import Source

JOBS_DIR = ".jobs"  # inside the staging folder; removed before the output is published
PLAN_FILE = "plan.json"  # in JOBS_DIR: the job plan's fingerprint, what --resume compares
DEFAULT_CHUNK_BYTES = 256 << 20
DEFAULT_JOB_BYTES = 1 << 30  # pass-through tensors per copy job


@dataclass
class PlannedTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    nbytes: int
    source: str | None = None  # copied byte for byte from this source tensor
    layer: int | None = None  # else: produced by plan.layers[layer]'s layout ...
    suffix: str | None = None  # ... under this suffix
    shard: int = -1
    offset: int = 0  # absolute offset in the shard file


@dataclass
class Shard:
    filename: str
    tensors: list[PlannedTensor] = field(default_factory=list)
    header: bytes = b""

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def layout_shards(tensors: list[PlannedTensor], max_shard_size: int) -> list[Shard]:
    """Greedy, in plan order: a shard closes when the next tensor would take it past the limit."""
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    shards = []
    for i, group in enumerate(groups):
        shard = Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", group)
        header: dict = {"__metadata__": {"format": "pt"}}
        pos = 0
        for t in group:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
        shard.header = len(raw).to_bytes(8, "little") + raw
        pos = len(shard.header)
        for t in group:
            t.shard, t.offset = i, pos
            pos += t.nbytes
        shards.append(shard)
    return shards


def dtype_code(dt) -> str:
    """The safetensors code of a torch dtype."""
    return TORCH_TO_CODE[dt]


@dataclass
class StoredTP:
    """A TP size whose rank tensors are not a slice of the full ones (``Layout.tp_cuts``), stored in the same
    folder: ``{prefix}.tp{T}.{suffix}`` of shape ``[T, E, ...]``, rank r's encoding at ``[r]``."""

    tp_size: int
    shape: LayerShape  # one rank's (every rank's sizes are the same)
    unpadded: tuple[int, int]  # one rank's real (H, I)
    specs: list[TensorSpec]  # one rank's tensors
    metadata: dict  # what the layout states for one rank's sizes
    tensors: dict[str, PlannedTensor]  # suffix -> the stacked [T, E, ...] output tensor


@dataclass
class LayerPlan:
    map: MoELayerMap
    shape: LayerShape
    expert_start: int  # first global expert of this output
    specs: list[TensorSpec]
    metadata: dict
    warnings: list[str]
    tensors: dict[str, PlannedTensor]  # suffix -> planned output tensor
    scheme: Scheme  # of the output (MXFP4 for quantize), the source's otherwise
    unpadded: tuple[int, int]  # this rank's real (H, I); shape holds the padded ones for MXFP4 output
    quantized: bool = False  # float or int experts quantized here (the manifest gets a quality report)
    #: ``--tp-sizes``: each TP size > 1 asked for -> None (a rank's tensors are the layout's cut of the full
    #: ones) or what is stored for it
    tp_sizes: dict[int, StoredTP | None] = field(default_factory=dict)

    def all_tensors(self) -> list[PlannedTensor]:
        """Every tensor the layer's job writes: the full ones, then each stored TP size's."""
        return list(self.tensors.values()) + [t for st in self.tp_sizes.values() if st for t in st.tensors.values()]


@dataclass
class ConversionPlan:
    source: Source
    model: ModelMap
    layout: Layout
    partition: Partition
    layers: list[LayerPlan]
    tensors: list[PlannedTensor]
    shards: list[Shard]
    dtype: str  # the model dtype the output is for
    quant: Quantization | None = None

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def warnings(self) -> list[str]:
        """Each distinct warning once, with the layers it concerns (one layer, or first .. last and a count)."""
        return group_by_layers((lp.map.prefix, w) for lp in self.layers for w in lp.warnings)


def group_by_layers(items) -> list[str]:
    """``(layer prefix, message)`` pairs -> one line per distinct message, naming the layers."""
    by_message: dict[str, list[str]] = {}
    for prefix, message in items:
        by_message.setdefault(message, []).append(prefix)
    lines = []
    for message, prefixes in by_message.items():
        where = prefixes[0] if len(prefixes) == 1 else f"{len(prefixes)} layers, {prefixes[0]} .. {prefixes[-1]}"
        lines.append(f"{where}: {message}")
    return lines


def output_scheme(layer: MoELayerMap, quant: Quantization | None) -> Scheme:
    """The scheme the output holds: MXFP4 when quantizing (or when the experts are MXFP4 already)."""
    return MXFP4Scheme() if quant is not None or isinstance(layer.scheme, MXFP4Scheme) else layer.scheme


def layer_shape(layer: MoELayerMap, part: Partition, dtype: str, layout: Layout | None = None,
                quant: Quantization | None = None) -> tuple[LayerShape, int]:
    """This rank's sizes for the layout; for MXFP4 output H and I are the padded ones (``extra`` keeps
    the real ones), because the block the layout encodes is padded already."""
    e0, n_local, I_part = partition_sizes(layer, part)
    H, I, extra, bias_dtype = layer.hidden_size, I_part, {}, layer.bias_dtype
    if layout is not None and isinstance(output_scheme(layer, quant), MXFP4Scheme):
        extra = {"hidden_size_unpadded": H, "intermediate_size_unpadded": I}
        H, I = padded_sizes(H, I, layout.pad_multiples)
        bias_dtype = dtype if layer.has_bias else None  # the engine's bias parameters are in the model dtype
    shape = LayerShape(num_experts=n_local, hidden_size=H, intermediate_size=I,
                       has_bias=layer.has_bias, activation=layer.activation, dtype=dtype,
                       bias_dtype=bias_dtype, extra=extra)
    return shape, e0


def decoder_problems(layer: MoELayerMap) -> list[str]:
    """Limits of the decoder itself, whatever the layout."""
    s = layer.scheme
    if isinstance(s, WNA16Scheme) and 32 % s.bits:
        return [f"{s.bits}-bit codes are packed across int32 word boundaries; moeconvert decodes 2-, 4- and "
                "8-bit pack-quantized experts"]
    return []


def scheme_kind(model: ModelMap, quant: Quantization | None = None) -> str | None:
    """The scheme kind of the output's experts, which picks the layout behind a backend name."""
    return output_scheme(model.layers[0], quant).kind if model.layers else None


def planned_as(model: ModelMap, shape: LayerShape) -> LayerShape:
    """The shape a layout checks in a plan (``inspect`` reports the layout's own answer). A plan-only family (families.py: nothing is written for it) is checked
    as a silu layer: its activation decides only which kernel applies it and the order of w13's rows, never
    a tensor's size, so the plan's files, bytes, time and memory are the layout's for these sizes. Which
    layouts' kernels run the family's activation is not claimed (docs/scale-out.md)."""
    if model.family.plan_only and shape.activation != "silu":
        return dataclasses.replace(shape, activation="silu")
    return shape


def check_layers(model: ModelMap, layout: Layout, part: Partition, quant: Quantization | None = None,
                 dtype: str | None = None, planning: bool = False) -> dict[str, list[str]]:
    """Every layer's violated constraints for this layout (only layers with problems appear). ``planning``: for
    a plan (:func:`planned_as`); ``inspect`` reports the layout's own answer."""
    problems = {}
    for layer in model.layers:
        try:
            shape, _ = layer_shape(layer, part, dtype or model.dtype, layout, quant)
        except MoeConvertError as e:
            problems[layer.prefix] = [e.what()]
            continue
        scheme = output_scheme(layer, quant)
        found = decoder_problems(layer) + layout.check(planned_as(model, shape) if planning else shape, scheme)
        found += layout.source_problems(layer.format, shape) if scheme.kind in layout.schemes else []
        if isinstance(scheme, MXFP4Scheme):
            found = output_problems(layer.scheme, shape, quant) + found
        if found:
            problems[layer.prefix] = found
    return problems


def tp_size_plan(layer: MoELayerMap, layout: Layout, shape: LayerShape, scheme: Scheme, tp_size: int,
                 dtype: str, quant: Quantization | None = None) -> tuple[LayerShape, tuple[int, int]] | None:
    """``--tp-sizes``: None when a TP rank of ``tp_size`` is the layout's cut of the full tensors, else the
    rank's (shape, unpadded sizes) to store; a TP size no rank can hold is refused in one line."""
    cuts = layout.tp_cuts(shape, scheme, tp_size)
    if isinstance(cuts, dict):
        return None
    why = [cuts.reason] if not cuts.convertible else []
    try:
        rank, _ = layer_shape(layer, Partition(tp_size, 0), dtype, layout, quant)
    except MoeConvertError as e:
        rank, why = None, [e.what()]
    if rank is not None and not why:
        why = decoder_problems(layer) + layout.check(rank, scheme)
        why += layout.source_problems(layer.format, rank) if scheme.kind in layout.schemes else []
        if isinstance(scheme, MXFP4Scheme):
            why = output_problems(layer.scheme, rank, quant) + why
    if why:
        raise MoeConvertError(f"--tp-sizes {tp_size}: a TP rank of {tp_size} cannot hold this layer in layout "
                              f"{layout.name}: {why[0]}", tensor=layer.prefix)
    unpadded = (rank.extra.get("hidden_size_unpadded", rank.hidden_size),
                rank.extra.get("intermediate_size_unpadded", rank.intermediate_size))
    return rank, unpadded


def plan_conversion(source: Source, backend: str, part: Partition = Partition(),
                    max_shard_size: int = 5 * 10**9, model: ModelMap | None = None,
                    quant: Quantization | None = None, dtype: str | None = None,
                    tp_sizes: tuple[int, ...] = ()) -> ConversionPlan:
    """``backend``: the ``--backend`` word; the layout is the one registered under it for the output's
    scheme kind (the only lookup on the way to the encoder). ``quant``: quantize float experts
    (``moeconvert quantize``); ``dtype``: the model dtype the output is for (default: the checkpoint's).
    ``tp_sizes``: the TP sizes > 1 a full folder serves (``--tp-sizes``); each layer stores the rank
    tensors of those its layout cannot cut out of the full ones (docs/format.md)."""
    model = model or map_model(source)
    dtype = dtype or model.dtype
    layout = get_layout(backend, scheme_kind(model, quant))
    if tp_sizes and part != Partition():
        raise MoeConvertError("--tp-sizes makes a full folder that serves several TP sizes; it takes no "
                              "--tp-size/--tp-rank/--ep-size/--ep-rank", expected="TP 1, EP 1",
                              found=f"TP {part.tp_size} rank {part.tp_rank}, EP {part.ep_size} rank {part.ep_rank}")
    problems = check_layers(model, layout, part, quant, dtype, planning=True)
    if problems:
        n = sum(len(v) for v in problems.values())
        first_prefix, first = next(iter(problems.items()))
        raise MoeConvertError(
            f"backend '{layout.name}' cannot take this checkpoint: {n} problem(s) in {len(problems)} layer(s); "
            f"first: {first[0]} (`moeconvert inspect` lists all)", tensor=first_prefix)
    by_first_tensor: dict[str, MoELayerMap] = {}
    for layer in model.layers:
        by_first_tensor[min(layer.source_tensors(), key=lambda n: (str(source.info(n).file), source.info(n).start))] = layer
    moe_names = model.moe_tensor_names()
    layers: list[LayerPlan] = []
    tensors: list[PlannedTensor] = []
    for name, info in sorted(source.tensors.items(), key=lambda kv: (source.files.index(kv[1].file), kv[1].start)):
        layer = by_first_tensor.get(name)
        if layer is not None:
            shape, e0 = layer_shape(layer, part, dtype, layout, quant)
            scheme = output_scheme(layer, quant)
            specs = layout.plan(shape, scheme)
            planned = {}
            for spec in specs:
                t = PlannedTensor(f"{layer.prefix}.{spec.suffix}", dtype_code(spec.dtype), spec.shape, spec.nbytes,
                                  layer=len(layers), suffix=spec.suffix)
                planned[spec.suffix] = t
                tensors.append(t)
            unpadded = (shape.extra.get("hidden_size_unpadded", shape.hidden_size),
                        shape.extra.get("intermediate_size_unpadded", shape.intermediate_size))
            stored: dict[int, StoredTP | None] = {}
            for T in tp_sizes:
                rank = tp_size_plan(layer, layout, shape, scheme, T, dtype, quant)
                if rank is None:
                    stored[T] = None
                    continue
                rank_shape, rank_unpadded = rank
                rank_specs = layout.plan(rank_shape, scheme)
                st = StoredTP(T, rank_shape, rank_unpadded, rank_specs, layout.layer_metadata(rank_shape, scheme), {})
                for spec in rank_specs:
                    t = PlannedTensor(f"{layer.prefix}.tp{T}.{spec.suffix}", dtype_code(spec.dtype),
                                      (T, *spec.shape), T * spec.nbytes, layer=len(layers), suffix=spec.suffix)
                    st.tensors[spec.suffix] = t
                    tensors.append(t)
                stored[T] = st
            warnings = layout.warnings(shape, scheme)
            if planned_as(model, shape) is not shape and layout.check(shape, scheme):
                # this layout refuses the activation itself: say that the plan stands in silu for it
                warnings = [f"activation {shape.activation}: planned as silu ({model.family.name} is planned, not "
                            "converted; the activation changes no size here)"] + warnings
            layers.append(LayerPlan(layer, shape, e0, specs, layout.layer_metadata(shape, scheme),
                                    warnings, planned, scheme, unpadded,
                                    quant is not None and isinstance(layer.scheme, (FloatScheme, WNA16Scheme, NVFP4Scheme)),
                                    stored))
        elif name not in moe_names:
            tensors.append(PlannedTensor(name, info.dtype, info.shape, info.nbytes, source=name))
    taken = {}
    for t in tensors:
        if t.name in taken:
            raise MoeConvertError("an output tensor name collides with a source tensor", tensor=t.name)
        taken[t.name] = t
    return ConversionPlan(source, model, layout, part, layers, tensors, layout_shards(tensors, max_shard_size),
                          dtype, quant)


def read_small_file(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a link, a FIFO, a device) of at most ``limit``
    bytes, else None. A damaged staging folder can hold anything under a record's name: reading one must
    neither block (FIFO), nor follow a link, nor fill the memory (a device)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)  # what was opened, in case the name was swapped after the lstat
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        data = os.read(fd, limit + 1)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)
