"""Plan and run one conversion: Source -> ModelMap -> Decode -> Layout.encode -> Writer.

:func:`plan_conversion` reads only headers and a few tiny tensors: it maps the model, asks the layout
for every layer's constraints (all layers, all problems, before any byte is written) and fixes the
output's shards. :func:`run_conversion` then streams: pass-through tensors are copied byte for byte,
MoE layers are decoded and encoded a chunk of experts at a time.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moeconvert import __version__
from moeconvert.format import FORMAT_VERSION
from moeconvert.canonical import ExpertBlock, LayerShape, Partition
from moeconvert.decode import decode_chunk, partition_sizes
from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.layouts import Layout, TensorSpec, get_layout
from moeconvert.modelmap import ModelMap, MoELayerMap, map_model
from moeconvert.quantize import Quality, Quantization, output_block, output_problems, padded_sizes
from moeconvert.schemes import FloatScheme, MXFP4Scheme, Scheme, WNA16Scheme
from moeconvert.sources import Source
from moeconvert.writer import PlannedTensor, Shard, StagedOutput, dtype_code, layout_shards, tensor_bytes

DEFAULT_CHUNK_BYTES = 256 << 20


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
    quality: Quality | None = None  # filled while quantizing


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


def check_layers(model: ModelMap, layout: Layout, part: Partition, quant: Quantization | None = None,
                 dtype: str | None = None) -> dict[str, list[str]]:
    """Every layer's violated constraints for this layout (only layers with problems appear)."""
    problems = {}
    for layer in model.layers:
        try:
            shape, _ = layer_shape(layer, part, dtype or model.dtype, layout, quant)
        except MoeConvertError as e:
            problems[layer.prefix] = [e.what()]
            continue
        scheme = output_scheme(layer, quant)
        found = decoder_problems(layer) + layout.check(shape, scheme)
        if isinstance(scheme, MXFP4Scheme):
            found = output_problems(layer.scheme, shape, quant) + found
        if found:
            problems[layer.prefix] = found
    return problems


def plan_conversion(source: Source, backend: str, part: Partition = Partition(),
                    max_shard_size: int = 5 * 10**9, model: ModelMap | None = None,
                    quant: Quantization | None = None, dtype: str | None = None) -> ConversionPlan:
    """``backend``: the ``--backend`` word; the layout is the one registered under it for the output's
    scheme kind (the only lookup on the way to the encoder). ``quant``: quantize float experts
    (``moeconvert quantize``); ``dtype``: the model dtype the output is for (default: the checkpoint's)."""
    model = model or map_model(source)
    dtype = dtype or model.dtype
    layout = get_layout(backend, scheme_kind(model, quant))
    problems = check_layers(model, layout, part, quant, dtype)
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
            layers.append(LayerPlan(layer, shape, e0, specs, layout.layer_metadata(shape, scheme),
                                    layout.warnings(shape, scheme), planned, scheme, unpadded,
                                    Quality() if quant is not None and isinstance(layer.scheme, FloatScheme) else None))
        elif name not in moe_names:
            tensors.append(PlannedTensor(name, info.dtype, info.shape, info.nbytes, source=name))
    taken = {}
    for t in tensors:
        if t.name in taken:
            raise MoeConvertError("an output tensor name collides with a source tensor", tensor=t.name)
        taken[t.name] = t
    return ConversionPlan(source, model, layout, part, layers, tensors, layout_shards(tensors, max_shard_size),
                          dtype, quant)


def experts_per_chunk(lp: LayerPlan, chunk_bytes: int) -> int:
    per_expert = sum(s.nbytes for s in lp.specs) // max(lp.shape.num_experts, 1)
    # decoding holds unpacked codes and the source words beside the encoded chunk: about 4x the output;
    # quantizing holds the float chunk and temporaries of ~6x it (mxfp4.py; the error report's fp64)
    factor = 4 if lp.quality is None else 6 * 4
    return max(1, min(lp.shape.num_experts, chunk_bytes // max(factor * per_expert, 1)))


def layer_output_block(plan: ConversionPlan, lp: LayerPlan, a: int, b: int, quality: Quality | None) -> ExpertBlock:
    """Local experts [a, b) of a layer as the canonical block its layout encodes."""
    block = decode_chunk(plan.source, lp.map, plan.partition, lp.expert_start + a, lp.expert_start + b)
    if isinstance(lp.scheme, MXFP4Scheme):
        block = output_block(block, lp.shape, lp.unpadded, plan.quant, prefix=lp.map.prefix,
                             expert_offset=lp.expert_start + a, quality=quality)
    return block


def run_conversion(plan: ConversionPlan, out: Path, *, overwrite: bool = False,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Callable[[int], None] | None = None) -> dict:
    """Write the planned output to ``out``; returns the manifest."""
    progress = progress or (lambda n: None)
    source = plan.source
    with ThreadPoolExecutor(max_workers=2) as pool, StagedOutput(out, plan.shards, overwrite) as staged:
        digests = {f: pool.submit(source.file_digest, f) for f in source.files}
        for t in plan.tensors:
            if t.source is None:
                continue
            at = 0
            for buf in source.read_raw(t.source):
                staged.write(t, at, buf)
                at += len(buf)
                progress(len(buf))
        for lp in plan.layers:
            step = experts_per_chunk(lp, chunk_bytes)
            n = lp.shape.num_experts
            for a in range(0, n, step):
                b = min(n, a + step)
                block = layer_output_block(plan, lp, a, b, lp.quality)
                encoded = plan.layout.encode(block, lp.shape)
                _write_layer_chunk(staged, lp, encoded, a, b)
                progress(sum(lp.tensors[s.suffix].nbytes * (b - a) // n for s in lp.specs))
                del block, encoded
        copies = source.other_files()  # listed once: the manifest's checksums are of exactly these
        manifest = build_manifest(plan, staged, {f: fut.result() for f, fut in digests.items()}, copies)
        index = {"metadata": {"total_size": sum(t.nbytes for t in plan.tensors)},
                 "weight_map": {t.name: plan.shards[t.shard].filename for t in plan.tensors}}
        staged.finish(index, copies, manifest)
    return manifest


def _write_layer_chunk(staged: StagedOutput, lp: LayerPlan, encoded: dict, a: int, b: int) -> None:
    if set(encoded) != {s.suffix for s in lp.specs}:
        raise InternalError(f"{lp.map.prefix}: layout wrote {sorted(encoded)}, planned {[s.suffix for s in lp.specs]}")
    for spec in lp.specs:
        t = encoded[spec.suffix]
        want = (b - a, *spec.shape[1:])
        if tuple(t.shape) != want or t.dtype != spec.dtype:
            raise InternalError(f"{lp.map.prefix}.{spec.suffix}: encoded {tuple(t.shape)} {t.dtype}, "
                                f"planned {want} {spec.dtype}")
        planned = lp.tensors[spec.suffix]
        staged.write(planned, a * (planned.nbytes // lp.shape.num_experts), tensor_bytes(t))


def build_manifest(plan: ConversionPlan, staged: StagedOutput, source_digests: dict, copies: list[Path]) -> dict:
    """The manifest (docs/format.md): every tensor's sha256 as written, every shard header's, and those
    of the files copied through (``copies``), so that ``verify`` and ``load(verify=True)`` can check
    every byte of the output without its source."""
    src = plan.source
    entry = lambda t: {"name": t.name, "file": plan.shards[t.shard].filename, "shape": list(t.shape),
                       "dtype": t.dtype, "sha256": staged.digest(t)}
    layouts = plan.layout
    schemes = {lp.scheme for lp in plan.layers}
    layers = []
    for lp in plan.layers:
        m = lp.map
        layers.append({
            "prefix": m.prefix,
            "layer": m.layer,
            "num_experts": lp.shape.num_experts,
            "num_experts_global": m.num_experts,
            "expert_offset": lp.expert_start,
            "top_k": m.top_k,
            "hidden_size": m.hidden_size,
            "intermediate_size": lp.unpadded[1],
            "intermediate_size_total": m.intermediate_size,
            "intermediate_size_padded": lp.metadata.get("intermediate_size_padded", lp.shape.intermediate_size),
            "hidden_size_padded": lp.metadata.get("hidden_size_padded", lp.shape.hidden_size),
            "activation": m.activation,
            "activation_params": m.activation_params,
            "has_bias": m.has_bias,
            "bias_dtype": lp.shape.bias_dtype,
            "scheme": lp.scheme.to_json(),
            "source_scheme": m.scheme.to_json(),
            "router": m.router,
            "shared_experts": m.shared,
            "layout_metadata": lp.metadata,
            "warnings": lp.warnings,
            "tensors": {suffix: entry(t) for suffix, t in lp.tensors.items()},
            **({"quality": lp.quality.to_json()} if lp.quality is not None else {}),
        })
    return {
        "format": "moeconvert",
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "source": {
            "id": src.ident,
            "revision": src.revision,
            "files": {f.name: d for f, d in sorted(source_digests.items(), key=lambda kv: kv[0].name)},
        },
        "family": plan.model.family.name,
        "dtype": plan.dtype,
        "quantization": plan.quant.to_json() if plan.quant is not None else None,
        "scheme": next(iter(schemes)).to_json() if len(schemes) == 1 else None,
        "backend": layouts.name,
        "layout": {"name": layouts.name, "version": layouts.version, "kernel": layouts.kernel,
                   "made_for": dict(layouts.made_for)},
        "partition": plan.partition.to_json(),
        "moe_layers": layers,
        "tensors": {t.name: entry(t) for t in plan.tensors if t.source is not None},
        # a header's sha256 covers everything before the shard's data (its 8-byte length, the JSON,
        # ``__metadata__`` and padding included); the tensors' digests cover the rest
        "shards": [{"file": s.filename, "size": s.size, "header_sha256": hashlib.sha256(s.header).hexdigest()}
                   for s in plan.shards],
        "copied_files": {p.name: src.file_digest(p) for p in copies},
    }
