"""verify: is a converted folder exactly what its manifest says, and exactly its source?

1. Everything but the tensor data is checked by :func:`moeconvert.layouts.output.check_output`, the same
   check ``load`` makes: every manifest field, the manifest against the partition and the layouts'
   plans, every shard header's sha256 (``__metadata__`` and padding included) and its tensors' names,
   files, shapes and dtypes, config.json's sha256. A failure there is an error (the folder cannot be
   read as what it claims to be), not a line of the report.
2. Every tensor's data is read once: its sha256 is computed from the same reads that 3. decodes.
3. Every MoE layer is decoded back to the canonical block through its layout's ``decode``, and the bytes
   are held to the invariants of the layout's encoding (``Layout.byte_problems``), the facts it recorded,
   and, for each stored TP rank, to the full tensors' values cut for that rank: what a folder alone shows
   (docs/format.md, "What verify guarantees"). With ``--against SRC`` the block is compared, bit for bit,
   with the canonical block decoded from the source (same TP/EP cut), and every pass-through tensor's bytes
   with the source's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moeconvert.canonical import BLOCK_TENSORS, ExpertBlock, LayerShape, Partition
from moeconvert.decode import decode_chunk
from moeconvert.layouts.output import check_output, rank_shape
from moeconvert.modelmap import map_model
from moeconvert.quantize import Quality, Quantization, output_block
from moeconvert.schemes import MXFP4Scheme, WNA16Scheme
from moeconvert.sources import Source, open_source

CHUNK_EXPERTS_BYTES = 256 << 20


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


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(8 << 20):
            h.update(buf)
    return h.hexdigest()


def _update(h, t: torch.Tensor) -> None:
    """Hash a CPU tensor's stored bytes (as the writer hashed them: little-endian, row-major)."""
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def verify_output(out: Path, against: str | None = None, revision: str | None = None,
                  progress=None) -> VerifyReport:
    progress = progress or (lambda n: None)
    checked = check_output(out, hash_headers=True, made_for=False)
    manifest = checked.manifest
    produced = Source(out, str(out))
    other_errors = []
    for name, want in manifest["copied_files"].items():
        path = out / name
        if not path.is_file():
            other_errors.append(f"{name}: copied from the source at conversion, now missing")
        elif _file_sha256(path) != want["sha256"]:
            other_errors.append(f"{name}: sha256 mismatch (file changed after conversion)")

    source = model = None
    part = Partition(**manifest["partition"])
    if against is not None:
        source = open_source(against, revision)
        model = map_model(source)
    by_prefix = {lm.prefix: lm for lm in model.layers} if model else {}

    for name, e in manifest["tensors"].items():
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

    quant = Quantization(**manifest["quantization"]) if manifest["quantization"] else None
    reports = []
    for cl in checked.layers:
        entry, layout, scheme, shape = cl.raw, cl.layout, cl.scheme, cl.shape
        rep = LayerReport(entry["prefix"], len(entry["tensors"]) + sum(
            len(v["tensors"]) for v in entry.get("tp_sizes", {}).values() if v["stored"]))
        reports.append(rep)
        src_layer = by_prefix.get(entry["prefix"])
        decoding = True
        if source is not None and src_layer is None:
            rep.differences.append("no such MoE layer in the source")
            decoding = False
        quality = Quality() if source is not None and "quality" in entry else None
        hashes = {suffix: hashlib.sha256() for suffix in entry["tensors"]}
        # a layout that chose from the data (humming's sign-magnitude): the decoded codes are scanned again,
        # and must give the facts the manifest records (a source is not needed for that)
        scan = layout.layer_scan(shape, scheme, entry["expert_offset"])
        n = shape.num_experts
        per_expert = sum(produced.info(e["name"]).nbytes for e in entry["tensors"].values()) // max(n, 1)
        step = max(1, min(n, CHUNK_EXPERTS_BYTES // max(4 * per_expert, 1)))
        for a in range(0, n, step):
            b = min(n, a + step)
            # one read per byte: the rows decoded are the rows hashed
            tensors = {suffix: produced.read(e["name"], rows=(a, b)) for suffix, e in entry["tensors"].items()}
            for suffix, t in tensors.items():
                _update(hashes[suffix], t)
            progress(per_expert * (b - a))
            if not decoding:
                continue
            try:
                block = layout.decode(tensors, shape, scheme)
            except (RuntimeError, ValueError, KeyError, IndexError) as exc:
                rep.decode_errors.append(f"experts {a}..{b - 1}: {exc}")
                decoding = False
                continue
            rep.decode_errors += [f"experts {a}..{b - 1}: {p}" for p in layout.byte_problems(tensors, block, shape)]
            if scan is not None:
                scan.add(block, entry["expert_offset"] + a)
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
        rep.checksum_errors = [f"{suffix}: sha256 mismatch" for suffix, h in hashes.items()
                               if h.hexdigest() != entry["tensors"][suffix]["sha256"]]
        if scan is not None and decoding:
            rep.differences += _facts_differences(layout, entry["layout_metadata"], scan.facts(), "")
        for key, stored in entry.get("tp_sizes", {}).items():
            if stored["stored"]:
                _verify_tp_size(rep, produced, entry, int(key), stored, cl, source, src_layer, quant,
                                decoding and not rep.checksum_errors, progress)
        if rep.checksum_errors:
            # not the bytes that were converted: what decoding them said is beside the point
            rep.decode_errors, rep.differences, rep.compared = [], [], False
            continue
        if quality is not None and not rep.decode_errors and decoding:
            rep.quality = quality.to_json()
            rep.differences += _quality_differences(entry["quality"], rep.quality)
    return VerifyReport(str(out), against, reports, len(manifest["tensors"]), other_errors)


def _verify_tp_size(rep: LayerReport, produced: Source, entry: dict, T: int, stored: dict, cl, source, src_layer,
                    quant, decoding: bool, progress) -> None:
    """A stored TP size (``--tp-sizes``): each rank's block ``[r]`` of its ``[T, E, ...]`` tensors hashed in
    order, decoded with the rank's sizes and, with a source, compared with the source cut for that rank."""
    layout, scheme = cl.layout, cl.scheme
    hashes = {suffix: hashlib.sha256() for suffix in stored["tensors"]}
    e0 = entry["expert_offset"]
    for r in range(T):
        shape = cl.rank_shapes[T][r] if T in cl.rank_shapes else rank_shape(cl.shape, layout, scheme, T)
        n = shape.num_experts
        scan = layout.layer_scan(shape, scheme, e0)
        blocks = {suffix: produced.read(e["name"], rows=(r, r + 1))[0] for suffix, e in stored["tensors"].items()}
        for suffix, t in blocks.items():
            _update(hashes[suffix], t)
        progress(sum(t.numel() * t.element_size() for t in blocks.values()))
        per_expert = sum(t.numel() * t.element_size() for t in blocks.values()) // max(n, 1)
        step = max(1, min(n, CHUNK_EXPERTS_BYTES // max(4 * per_expert, 1)))
        for a in range(0, n, step) if decoding else ():
            b = min(n, a + step)
            where = f"TP {T} rank {r}, experts {a}..{b - 1}"
            try:
                tensors = {suffix: t[a:b] for suffix, t in blocks.items()}
                block = layout.decode(tensors, shape, scheme)
                full = layout.decode({suffix: produced.read(e["name"], rows=(a, b))
                                      for suffix, e in entry["tensors"].items()}, cl.shape, scheme)
            except (RuntimeError, ValueError, KeyError, IndexError) as exc:
                rep.decode_errors.append(f"{where}: {exc}")
                decoding = False
                break
            rep.decode_errors += [f"{where}: {p}" for p in layout.byte_problems(tensors, block, shape)]
            # the rank's values are the full tensors' values cut for it: a folder's ranks cannot be swapped,
            # or one rank's bytes replaced, without verify seeing it (a source is not needed for that)
            cut, exact = rank_block(full, cl.shape, shape, T, r)
            rep.differences += [f"{where}: not rank {r} of {T} of the layer's full tensors: {d}"
                                for d in cut.differences(exact(block))]
            if scan is not None:
                scan.add(block, e0 + a)
            if source is None:
                continue
            want = decode_chunk(source, src_layer, Partition(T, r), e0 + a, e0 + b)
            if scheme.kind == "mxfp4":
                unpadded = (shape.extra["hidden_size_unpadded"], shape.extra["intermediate_size_unpadded"])
                want = output_block(want, shape, unpadded, quant, prefix=entry["prefix"], expert_offset=e0 + a)
            diffs = layout.expected_block(want, shape).differences(block)
            rep.differences += [f"TP {T} rank {r}, experts {a}..{b - 1}: {d}" for d in diffs]
        if scan is not None and decoding:
            rep.differences += _facts_differences(layout, stored["rank_layout_metadata"][r], scan.facts(),
                                                  f"TP {T} rank {r}, ")
    rep.checksum_errors += [f"tp{T}.{suffix}: sha256 mismatch" for suffix, h in hashes.items()
                            if h.hexdigest() != stored["tensors"][suffix]["sha256"]]


def rank_block(full: ExpertBlock, full_shape: LayerShape, rank: LayerShape, tp_size: int,
               tp_rank: int) -> tuple[ExpertBlock, Callable[[ExpertBlock], ExpertBlock]]:
    """TP rank ``tp_rank`` of ``tp_size``'s canonical block, cut out of the full layer's ``full`` as the
    decoder cuts a source (moeconvert/decode.py) and padded to the rank's sizes as the planner pads it, and
    what of a rank's block it predicts: all of it, but w2 and its scales where an MXFP4 32-block of w2's K
    straddles a rank boundary (float experts quantized per rank then group other values)."""
    s = full.scheme
    I = full_shape.extra.get("intermediate_size_unpadded", full_shape.intermediate_size)
    Ip, Ir, Irp = full_shape.intermediate_size, I // tp_size, rank.intermediate_size
    lo, hi = tp_rank * Ir, (tp_rank + 1) * Ir

    def pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, n))

    def rows(t):  # the rank's rows of each of [gate; up], each padded to the rank's Ip
        return None if t is None else torch.cat([pad(t[:, lo:hi], Irp - Ir, 1), pad(t[:, Ip + lo:Ip + hi], Irp - Ir, 1)], 1)

    def cols(t, per: int):  # the rank's K columns of w2 (``per`` elements a column), padded to its Ip
        return None if t is None else pad(t[:, :, lo // per:hi // per], (Irp - Ir) // per, 2)

    kw = dict(w13=rows(full.w13), w13_scale=rows(full.w13_scale), w13_zero=rows(full.w13_zero),
              w13_bias=rows(full.w13_bias))
    skip: tuple[str, ...] = ()
    if s.kind not in ("float", "wna16", "mxfp4"):
        # NVFP4: each rank rescales over its own experts' scales (a layer-wide factor), so a rank's values
        # need not be the full ones cut: left to --against
        skip = BLOCK_TENSORS
    elif isinstance(s, MXFP4Scheme):
        if Ir % s.block_size:
            skip = ("w2", "w2_scale")
        else:
            kw.update(w2=cols(full.w2, 2), w2_scale=cols(full.w2_scale, s.block_size))
    elif isinstance(s, WNA16Scheme):
        g = s.group_size
        kw.update(w2=cols(full.w2, 1), w2_scale=full.w2_scale if g == -1 else cols(full.w2_scale, g),
                  w2_zero=full.w2_zero if g == -1 else cols(full.w2_zero, g))
    else:
        kw.update(w2=cols(full.w2, 1))
    if full.w2_bias is not None:
        # w2's bias is added after TP's all-reduce: gpt-oss's loader keeps it on rank 0 only (decode.py)
        kw["w2_bias"] = torch.zeros_like(full.w2_bias) if full_shape.activation == "swigluoai" and tp_rank else \
            full.w2_bias
    kw = {"w2": None, **{name: None if name in skip else t for name, t in kw.items()}}
    predicted = lambda block: dataclasses.replace(block, **{name: None for name in skip})
    return predicted(ExpertBlock(scheme=s, **kw)), predicted


def _facts_differences(layout, metadata: dict, found: dict, where: str) -> list[str]:
    """What the manifest records of a scan of the data (``Layout.recorded_facts``) against a scan of the
    decoded codes: they differ when the bytes were decoded with another choice than they were written with."""
    recorded = layout.recorded_facts(metadata)
    if recorded == found:
        return []
    return [f"{where}layout facts: the manifest records {recorded}, the decoded codes give {found}"]
