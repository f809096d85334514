"""verify: is a converted folder exactly what its manifest says, and exactly its source?

1. The manifest is read and every shard's header checked against it (names, files, shapes, dtypes;
   nothing missing, nothing extra).
2. Every tensor's sha256 is recomputed.
3. Every MoE layer is decoded back to the canonical block through its layout's ``decode``; with
   ``--against SRC`` it is compared, bit for bit, with the canonical block decoded from the source
   (same TP/EP cut), and every pass-through tensor's bytes with the source's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from moeconvert import FORMAT_VERSION
from moeconvert.canonical import LayerShape, Partition
from moeconvert.decode import decode_chunk
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import get_layout
from moeconvert.modelmap import map_model
from moeconvert.quantize import Quality, Quantization, output_block
from moeconvert.schemes import scheme_from_json
from moeconvert.sources import MANIFEST_NAME, Source, open_source

CHUNK_EXPERTS_BYTES = 256 << 20


def read_manifest(out: Path) -> dict:
    path = out / MANIFEST_NAME
    if not out.is_dir():
        raise MoeConvertError("no such output folder", file=str(out))
    if not path.is_file():
        raise MoeConvertError("incomplete or not a moeconvert output: no moeconvert.json", file=str(out))
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeConvertError(f"corrupt manifest: {e}", file=str(path)) from e
    if manifest.get("format") != "moeconvert":
        raise MoeConvertError("not a moeconvert manifest", file=str(path), tensor="format",
                              expected="moeconvert", found=manifest.get("format"))
    if manifest.get("format_version") != FORMAT_VERSION:
        raise MoeConvertError("unsupported output format version (made by another moeconvert version)",
                              file=str(path), expected=FORMAT_VERSION, found=manifest.get("format_version"))
    return manifest


def layer_shape_from_manifest(entry: dict, dtype: str) -> LayerShape:
    """The LayerShape the layout planned with: padded sizes (and the real ones in ``extra``) for MXFP4."""
    H, I, extra = entry["hidden_size"], entry["intermediate_size"], {}
    if entry["scheme"]["kind"] == "mxfp4":
        extra = {"hidden_size_unpadded": H, "intermediate_size_unpadded": I}
        H, I = entry["hidden_size_padded"], entry["intermediate_size_padded"]
    return LayerShape(num_experts=entry["num_experts"], hidden_size=H, intermediate_size=I,
                      has_bias=entry["has_bias"], activation=entry["activation"], dtype=dtype,
                      bias_dtype=entry.get("bias_dtype"), extra=extra)


@dataclass
class LayerReport:
    prefix: str
    tensors: int
    checksum_errors: list[str] = field(default_factory=list)
    decode_errors: list[str] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    compared: bool = False
    quality: dict | None = None  # recomputed from the source (quantized outputs)

    @property
    def ok(self) -> bool:
        return not (self.checksum_errors or self.decode_errors or self.differences)


@dataclass
class VerifyReport:
    out: str
    against: str | None
    layers: list[LayerReport]
    other_tensors: int
    other_errors: list[str]

    @property
    def ok(self) -> bool:
        return not self.other_errors and all(lr.ok for lr in self.layers)

    def to_json(self) -> dict:
        return {"ok": self.ok, "output": self.out, "against": self.against, "other_tensors": self.other_tensors,
                "other_errors": self.other_errors,
                "layers": [{"prefix": lr.prefix, "ok": lr.ok, "tensors": lr.tensors, "compared": lr.compared,
                            "checksum_errors": lr.checksum_errors, "decode_errors": lr.decode_errors,
                            "differences": lr.differences, "quality": lr.quality} for lr in self.layers]}


def _quality_differences(stored: dict, recomputed: dict) -> list[str]:
    """The manifest's error report against a recomputation (sums over other chunkings: 1e-9 relative)."""
    out = []
    for proj, stats in recomputed.items():
        for key, value in stats.items():
            was = stored.get(proj, {}).get(key)
            if was is None or abs(was - value) > 1e-9 * max(abs(value), abs(was), 1e-30):
                out.append(f"quality {proj}.{key}: manifest says {was}, recomputed {value}")
    return out


def _sha256(src: Source, name: str) -> str:
    h = hashlib.sha256()
    for buf in src.read_raw(name):
        h.update(buf)
    return h.hexdigest()


def verify_output(out: Path, against: str | None = None, revision: str | None = None,
                  progress=None) -> VerifyReport:
    progress = progress or (lambda n: None)
    manifest = read_manifest(out)
    produced = Source(out, str(out))
    kinds = {scheme_from_json(layer["scheme"]).kind for layer in manifest["moe_layers"]}
    layout = get_layout(manifest["layout"]["name"], next(iter(kinds)) if len(kinds) == 1 else None)
    if manifest["layout"]["version"] != layout.version:
        raise MoeConvertError("layout version differs from this moeconvert's", file=MANIFEST_NAME,
                              tensor=f"layout {layout.name}", expected=layout.version,
                              found=manifest["layout"]["version"])
    listed = {e["name"]: e for e in manifest["tensors"].values()}
    for layer in manifest["moe_layers"]:
        listed.update({e["name"]: e for e in layer["tensors"].values()})
    other_errors = []
    for name, e in listed.items():
        info = produced.tensors.get(name)
        if info is None:
            other_errors.append(f"{name}: in the manifest but in no shard")
        elif (info.file.name, list(info.shape), info.dtype) != (e["file"], e["shape"], e["dtype"]):
            other_errors.append(f"{name}: shard says {info.file.name} {list(info.shape)} {info.dtype}, manifest says "
                                f"{e['file']} {e['shape']} {e['dtype']}")
    for name in produced.tensors:
        if name not in listed:
            other_errors.append(f"{name}: in a shard but not in the manifest")
    ok_names = {n for n in listed if n in produced.tensors and not any(err.startswith(n + ":") for err in other_errors)}

    source = model = None
    part = Partition(**manifest["partition"])
    if against is not None:
        source = open_source(against, revision)
        model = map_model(source)
    by_prefix = {lm.prefix: lm for lm in model.layers} if model else {}

    for name, e in manifest["tensors"].items():
        if name not in ok_names:
            continue
        digest = _sha256(produced, name)
        progress(produced.info(name).nbytes)
        if digest != e["sha256"]:
            other_errors.append(f"{name}: sha256 mismatch (file changed after conversion)")
        elif source is not None:
            if name not in source.tensors:
                other_errors.append(f"{name}: not in the source")
            elif _sha256(source, name) != digest:
                other_errors.append(f"{name}: bytes differ from the source")
    if source is not None:
        missing = set(source.tensors) - set(manifest["tensors"]) - model.moe_tensor_names()
        other_errors += [f"{n}: in the source but not in the output" for n in sorted(missing)]

    reports = []
    for entry in manifest["moe_layers"]:
        rep = LayerReport(entry["prefix"], len(entry["tensors"]))
        reports.append(rep)
        for suffix, e in entry["tensors"].items():
            if e["name"] not in ok_names:
                rep.checksum_errors.append(f"{suffix}: missing or mismatched (see above)")
                continue
            if _sha256(produced, e["name"]) != e["sha256"]:
                rep.checksum_errors.append(f"{suffix}: sha256 mismatch")
            progress(produced.info(e["name"]).nbytes)
        if rep.checksum_errors:
            continue
        scheme = scheme_from_json(entry["scheme"])
        shape = layer_shape_from_manifest(entry, manifest["dtype"])
        src_layer = by_prefix.get(entry["prefix"])
        if source is not None and src_layer is None:
            rep.differences.append("no such MoE layer in the source")
            continue
        quant = Quantization(**manifest["quantization"]) if manifest.get("quantization") else None
        quality = Quality() if source is not None and "quality" in entry else None
        n = shape.num_experts
        per_expert = sum(produced.info(e["name"]).nbytes for e in entry["tensors"].values()) // max(n, 1)
        step = max(1, min(n, CHUNK_EXPERTS_BYTES // max(4 * per_expert, 1)))
        for a in range(0, n, step):
            b = min(n, a + step)
            tensors = {suffix: produced.read(e["name"], rows=(a, b)) for suffix, e in entry["tensors"].items()}
            try:
                block = layout.decode(tensors, shape, scheme)
            except (RuntimeError, ValueError, KeyError, IndexError) as exc:
                rep.decode_errors.append(f"experts {a}..{b - 1}: {exc}")
                break
            if source is not None:
                rep.compared = True
                e0 = entry["expert_offset"]
                want = decode_chunk(source, src_layer, part, e0 + a, e0 + b)
                if scheme.kind == "mxfp4":
                    unpadded = (shape.extra["hidden_size_unpadded"], shape.extra["intermediate_size_unpadded"])
                    want = output_block(want, shape, unpadded, quant, prefix=entry["prefix"],
                                        expert_offset=e0 + a, quality=quality)
                diffs = layout.expected_block(want, shape).differences(block)
                rep.differences += [f"experts {a}..{b - 1}: {d}" for d in diffs]
        if quality is not None and not rep.decode_errors:
            rep.quality = quality.to_json()
            rep.differences += _quality_differences(entry["quality"], rep.quality)
    return VerifyReport(str(out), against, reports, len(manifest["tensors"]), other_errors)
