"""Unquantized experts: bf16 / fp16 / fp32 ``weight`` tensors, per expert or fused (3-D, in each fused
storage the family table declares: gpt-oss, Qwen3.5, Llama 4)."""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock, Partition
from moeconvert.errors import MoeConvertError
from moeconvert.format.families import FUSED, FUSED_INTERLEAVED, FUSED_SEPARATE
from moeconvert.readers.base import (FLOAT_DTYPES, Expert, Projection, Reader, expect_dtype, expect_fused_shape,
                                     expect_shape, suffix_list)
from moeconvert.readers.registry import register
from moeconvert.schemes import FloatScheme, Scheme, float_dtype_name
from moeconvert.sources import Source


@register
class Unquantized(Reader):
    name = "float"
    title = "unquantized"
    suffixes = frozenset({"weight"})
    fused_suffixes = frozenset({"weight", "_bias"})

    def scheme(self, source: Source, prefix: str, first: Expert, config) -> Scheme:
        suffixes = set(first["gate"])
        if "weight" not in suffixes:
            # the tensors of a format config.json does not name (or names as leaving the experts unquantized)
            why = ("config.json has no quantization_config" if config is None
                   else "quantization_config leaves the experts unquantized")
            raise MoeConvertError(f"experts are stored quantized but {why}", file=str(source.ident),
                                  tensor=f"{prefix}.0", expected="weight (a float weight per projection)",
                                  found=suffix_list(first))
        name = first["gate"]["weight"]
        dt = float_dtype_name(source.tensors[name].dtype)
        if dt is None:
            raise MoeConvertError("expert weights are not bf16/fp16/fp32 (unsupported quantized format)",
                                  file=str(source.ident), tensor=name, expected="BF16, F16 or F32",
                                  found=source.tensors[name].dtype)
        return FloatScheme(dt)

    def shapes(self, source: Source, prefix: str, first: Expert, scheme: Scheme) -> tuple[int, int]:
        g, u, d = (first[r]["weight"] for r in ("gate", "up", "down"))
        I, H = source.tensors[g].shape
        expect_shape(source, u, (I, H))
        expect_shape(source, d, (H, I))
        return H, I

    def projection(self, source: Source, names: dict[str, str], scheme: Scheme, config, n: int, k: int) -> Projection:
        return Projection(source.read(names["weight"]))

    def fused_scheme(self, source: Source, prefix: str, names, sizes, storage: str) -> Scheme:
        if storage == FUSED_SEPARATE:
            return self._separate_scheme(source, prefix, names, sizes)
        gu, dn = names.get("gate_up", {}), names.get("down", {})
        for proj, by in (("gate_up_proj", gu), ("down_proj", dn)):
            extra = sorted(set(by) - self.fused_suffixes)
            if extra:
                raise MoeConvertError("experts are stored quantized but config.json names no quantization format "
                                      "for them", file=str(source.ident), tensor=by[extra[0]],
                                      expected=f"{proj} (a float weight)", found=f"{proj}{extra[0]}")
            if "weight" not in by:
                raise MoeConvertError("missing expert tensor", file=str(source.ident),
                                      tensor=f"{prefix}.{proj}", expected="present", found="missing")
        t = source.tensors
        dt = float_dtype_name(t[gu["weight"]].dtype)
        if dt is None or t[dn["weight"]].dtype != t[gu["weight"]].dtype:
            raise MoeConvertError("fused expert weights must share one float dtype", file=str(source.ident),
                                  tensor=dn["weight"], expected=t[gu["weight"]].dtype, found=t[dn["weight"]].dtype)
        E, H, I = sizes.E, sizes.H, sizes.I
        if storage == FUSED:
            # Qwen3.5 (transformers' Qwen3_5MoeExperts): gate_up_proj [E, 2I, H] (gate rows, then up rows),
            # down_proj [E, H, I]
            gu_shape, dn_shape = (E, 2 * I, H), (E, H, I)
        else:
            # x @ W: gpt-oss' gate_up_proj [E, H, 2I] (gate/up interleaved on the last dim) and Llama 4's
            # (gate columns, then up columns); down_proj [E, I, H]
            gu_shape, dn_shape = (E, H, 2 * I), (E, I, H)
        expect_fused_shape(source, gu["weight"], gu_shape, sizes)
        expect_fused_shape(source, dn["weight"], dn_shape, sizes)
        check_fused_bias(source, prefix, gu, dn, E, H, I)
        return FloatScheme(dt)

    def _separate_scheme(self, source: Source, prefix: str, names, sizes) -> Scheme:
        """Step-3.5's three 3-D tensors (vLLM's Step3p5Model.load_weights hands ``loaded_weight[expert_id]`` of
        each to FusedMoE's loader as that expert's w1 / w3 / w2): gate and up ``[E, I, H]``, down ``[E, H, I]``."""
        block = prefix.rsplit(".", 1)[0]
        t = source.tensors
        for role, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            if "weight" not in names.get(role, {}):
                raise MoeConvertError("missing expert tensor", file=str(source.ident),
                                      tensor=f"{block}.{proj}.weight", expected="present", found="missing")
        gate, up, down = (names[r]["weight"] for r in ("gate", "up", "down"))
        dt = float_dtype_name(t[gate].dtype)
        for other in (up, down):
            if dt is None or t[other].dtype != t[gate].dtype:
                raise MoeConvertError("fused expert weights must share one float dtype", file=str(source.ident),
                                      tensor=other, expected=t[gate].dtype, found=t[other].dtype)
        E, H, I = sizes.E, sizes.H, sizes.I
        for name, want in ((gate, (E, I, H)), (up, (E, I, H)), (down, (E, H, I))):
            expect_fused_shape(source, name, want, sizes)
        return FloatScheme(dt)

    def decode_fused(self, source: Source, layer, part: Partition, e0: int, e1: int) -> ExpertBlock:
        """The three float storages, each to this rank's ``w13 [e, 2Ip, H]`` ([gate; up] rows) and ``w2
        [e, H, Ip]``:

        * ``fused-transposed-interleaved`` (gpt-oss): ``gate_up_proj [E, H, 2I]`` (x @ W, row 2j of the
          transpose gate j, 2j+1 up j), ``down_proj [E, I, H]``.
        * ``fused`` (Qwen3.5): ``gate_up_proj [E, 2I, H]``, gate rows then up rows; ``down_proj [E, H, I]``.
        * ``fused-transposed`` (Llama 4): ``gate_up_proj [E, H, 2I]``, gate columns then up columns;
          ``down_proj [E, I, H]`` (vLLM's Llama4 loader transposes both and chunks gate_up in two along 2I).
        """
        Ip = layer.intermediate_size // part.tp_size
        rows = slice(part.tp_rank * Ip, (part.tp_rank + 1) * Ip)
        if layer.storage == FUSED_SEPARATE:
            # Step-3.5: gate [e, I, H] and up [e, I, H] -> [gate; up] rows of this rank; down [e, H, I]
            gate, up, down = (source.read(layer.fused_names[r]["weight"], rows=(e0, e1)) for r in ("gate", "up", "down"))
            return ExpertBlock(scheme=layer.scheme, w13=torch.cat([gate[:, rows], up[:, rows]], 1).contiguous(),
                               w2=down[:, :, rows].contiguous())
        gu, dn = layer.fused_names["gate_up"], layer.fused_names["down"]
        w13 = source.read(gu["weight"], rows=(e0, e1))
        w2 = source.read(dn["weight"], rows=(e0, e1))
        if layer.storage != FUSED:  # stored x @ W: [e, K, N] -> [e, N, K]
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        kw = {"w13": split_gate_up(w13, layer, rows), "w2": w2[:, :, rows].contiguous()}
        kw.update(fused_bias(source, layer, part, e0, e1, rows))
        return ExpertBlock(scheme=layer.scheme, **kw)


def split_gate_up(t: torch.Tensor, layer, rows: slice) -> torch.Tensor:
    """A fused ``[e, 2I, ...]`` gate_up (rows in the layer's storage order) -> this rank's ``[gate; up]``."""
    if layer.storage == FUSED_INTERLEAVED:
        return deinterleave(t, rows)
    I = layer.intermediate_size
    return torch.cat([t[:, :I][:, rows], t[:, I:][:, rows]], 1).contiguous()


def deinterleave(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """gpt-oss' interleaved ``[e, 2I, ...]`` (row 2j gate j, 2j+1 up j) -> this rank's ``[gate; up]``."""
    return torch.cat([t[:, 0::2][:, rows], t[:, 1::2][:, rows]], 1).contiguous()


def check_fused_bias(source: Source, prefix: str, gu: dict, dn: dict, E: int, H: int, I: int) -> None:
    if ("_bias" in gu) != ("_bias" in dn):
        raise MoeConvertError("expert bias on one projection only", file=str(source.ident), tensor=prefix)
    if "_bias" in gu:
        expect_shape(source, gu["_bias"], (E, 2 * I))
        expect_shape(source, dn["_bias"], (E, H))
        expect_dtype(source, gu["_bias"], FLOAT_DTYPES)
        expect_dtype(source, dn["_bias"], FLOAT_DTYPES)


def fused_bias(source: Source, layer, part: Partition, e0: int, e1: int, rows: slice) -> dict:
    """vLLM's gpt-oss loader gives the down bias to TP rank 0 only (the others hold zeros, so the
    all-reduce adds it once)."""
    if not layer.has_bias:
        return {}
    gu, dn = layer.fused_names["gate_up"], layer.fused_names["down"]
    b2 = source.read(dn["_bias"], rows=(e0, e1))
    return {"w13_bias": split_gate_up(source.read(gu["_bias"], rows=(e0, e1)), layer, rows),
            "w2_bias": torch.zeros_like(b2) if part.tp_size > 1 and part.tp_rank != 0 else b2}
