"""What every source-format reader is, and the parts they share (docs/architecture.md, "Readers").

A reader turns one checkpoint format's expert tensors into the canonical block (``canonical.py``) and
nothing else. It declares the tensor suffixes a projection owns in its format, builds the layer's
:class:`Scheme` from the config and the tensors, checks every expert's tensors before any byte is
read, and decodes one projection of one expert to canonical values. The TP/EP cuts, the stacking of
experts, the expert biases and the checks that every expert looks like expert 0 are the same for
every format and live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moeconvert.canonical import ExpertBlock, Partition
from moeconvert.errors import MoeConvertError
from moeconvert.schemes import Scheme, WNA16Scheme
from moeconvert.sources import Source

ROLES = ("gate", "up", "down")
#: what :meth:`Reader.layer_config` returns for a layer whose experts the format's rules leave unquantized
LEFT_FLOAT = object()
#: one expert's tensors: role (gate / up / down) -> suffix -> tensor name
Expert = dict[str, dict[str, str]]

INT_DTYPES = ("I8", "I16", "I32", "I64", "U8")
FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class LayerNames:
    """The names a format's per-module rules are matched against for one MoE layer."""

    #: the experts' prefix in the checkpoint (``model.layers.0.mlp.experts``)
    prefix: str
    #: the prefix vLLM's model class builds the layer with (differs where the family declares ``vllm_block``)
    vllm: str
    #: role -> expert 0's module (``…experts.0.gate_proj``)
    first: dict[str, str]
    #: every expert projection's module, in the checkpoint
    modules: tuple[str, ...] = ()


@dataclass
class Projection:
    """One expert's projection in canonical form, whole (before any TP cut).

    ``weight``: uint8 codes or float weights ``[N, K]``; ``scale`` / ``zero``: ``[N, G]`` or None.
    """

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None


class Reader:
    """One checkpoint format (subclasses register under the string config.json uses for it)."""

    #: the registry key: the format's name as config.json writes it (``quant_method`` or compressed-tensors'
    #: ``format``); ``float`` for unquantized experts
    name: ClassVar[str]
    #: what inspect prints for the format
    title: ClassVar[str]
    #: every tensor suffix a projection may own in this format (an expert ``bias`` is any format's)
    suffixes: ClassVar[frozenset[str]]
    #: the ``quant_method`` that selects this reader for the whole checkpoint (None: chosen otherwise)
    quant_method: ClassVar[str | None] = None
    #: a compressed-tensors format, chosen per layer by the format of the config group that holds the experts
    compressed_tensors: ClassVar[bool] = False

    @classmethod
    def parse_config(cls, qc: dict, section: str):
        """The format's own quantization_config, checked (for readers selected by ``quant_method``)."""
        return None

    def quantizes(self, config, prefix: str) -> bool:
        """Whether ``config`` quantizes the experts under ``prefix`` (False: they are left float)."""
        return True

    def layer_config(self, config, names: LayerNames):
        """The config one MoE layer's experts are read with (``config`` with the format's per-module rules
        for that layer applied), or :data:`LEFT_FLOAT` where those rules leave the layer's experts
        unquantized."""
        return config if self.quantizes(config, names.prefix) else LEFT_FLOAT

    # -- per-expert form: {prefix}.{e}.{proj}.{suffix} ------------------------------------------------

    def scheme(self, source: Source, prefix: str, first: Expert, config) -> Scheme:
        """The layer's scheme from ``config`` (what :func:`readers.source_format` parsed) and expert 0's
        tensors; refuses tensors that are not this format's."""
        raise NotImplementedError

    def required(self, scheme: Scheme) -> frozenset[str]:
        """The suffixes every projection must have under ``scheme``."""
        return self.suffixes

    def optional(self, scheme: Scheme) -> frozenset[str]:
        """The suffixes a projection may have besides those required (and ``bias``) under ``scheme``."""
        return frozenset()

    def shapes(self, source: Source, prefix: str, first: Expert, scheme: Scheme) -> tuple[int, int]:
        """Checks expert 0's shapes and dtypes against each other and the scheme; returns (H, I)."""
        raise NotImplementedError

    def projection(self, source: Source, names: dict[str, str], scheme: Scheme, config, n: int, k: int) -> Projection:
        """One projection of one expert (``names``: suffix -> tensor), ``[n, k]``, in canonical form
        (``config``: what ``scheme`` was given)."""
        raise NotImplementedError

    def check(self, source: Source, prefix: str, experts: list[Expert], scheme: Scheme) -> tuple[int, int]:
        """Every expert has the tensors of this format, with expert 0's shapes and dtypes; returns (H, I)."""
        required = self.required(scheme)
        check_alike(source, prefix, experts, required, required | self.optional(scheme) | {"bias"}, scheme)
        H, I = self.shapes(source, prefix, experts[0], scheme)
        check_bias(source, prefix, experts[0], H, I)
        return H, I

    def decode(self, source: Source, layer, part: Partition, e0: int, e1: int) -> ExpertBlock:
        """Global experts [e0, e1) of ``layer`` (a MoELayerMap), cut for ``part``'s TP rank as vLLM 0.33.0's
        loader cuts them (docs/format.md): gate and up rows contiguously per rank, down along K (its group
        scales and zero points on group columns, a channelwise ``[H, 1]`` scale whole)."""
        if layer.fused:
            return self.decode_fused(source, layer, part, e0, e1)
        s = layer.scheme
        H, I = layer.hidden_size, layer.intermediate_size
        Ip = I // part.tp_size
        r = part.tp_rank
        rows = slice(r * Ip, (r + 1) * Ip)
        grouped = isinstance(s, WNA16Scheme) and s.group_size != -1
        gcols = slice(r * Ip // s.group_size, (r + 1) * Ip // s.group_size) if grouped else slice(None)
        parts: dict[str, list[torch.Tensor]] = {}

        def add(key: str, t: torch.Tensor | None) -> None:
            if t is not None:
                parts.setdefault(key, []).append(t)

        for ex in layer.experts[e0:e1]:
            gate = self.projection(source, ex["gate"], s, layer.format_config, I, H)
            up = self.projection(source, ex["up"], s, layer.format_config, I, H)
            down = self.projection(source, ex["down"], s, layer.format_config, H, I)
            add("w13", torch.cat([gate.weight[rows], up.weight[rows]]))
            add("w2", down.weight[:, rows])
            if gate.scale is not None:
                add("w13_scale", torch.cat([gate.scale[rows], up.scale[rows]]))
                add("w2_scale", down.scale[:, gcols])
            if gate.zero is not None:
                add("w13_zero", torch.cat([gate.zero[rows], up.zero[rows]]))
                add("w2_zero", down.zero[:, gcols])
            if layer.has_bias:
                add("w13_bias", torch.cat([source.read(ex["gate"]["bias"])[rows], source.read(ex["up"]["bias"])[rows]]))
                add("w2_bias", source.read(ex["down"]["bias"]))
        return ExpertBlock(scheme=s, **{k: torch.stack(v).contiguous() for k, v in parts.items()})

    # -- fused form: {prefix}.{gate_up_proj,down_proj}{suffix}, 3-D over experts ----------------------
    # in the orientation the family declares (moeconvert/format/families.py, ``storage``): gpt-oss'
    # interleaved x @ W, Qwen3.5's [E, 2I, H], Llama 4's [E, H, 2I]

    #: suffixes of the fused form ("" = the float weight); empty: the format has no fused form
    fused_suffixes: ClassVar[frozenset[str]] = frozenset()

    def fused_scheme(self, source: Source, prefix: str, names: dict[str, dict[str, str]], sizes,
                     storage: str) -> Scheme:
        """Checks a fused layer's tensors (``names``: gate_up / down -> suffix -> tensor), stored as
        ``storage`` says, against the config's sizes (``sizes``: E, H, I and the keys that gave them,
        modelmap.ConfigSizes); returns its scheme."""
        # the quantizers we know of for the fused families (GPTQModel's qwen3_5_moe, llm-compressor's Qwen3.5
        # and Llama 4 calibration modules) write quantized experts per expert (experts.E.gate_proj.qweight ...)
        name = next(iter(names["gate_up"].values()), prefix)
        raise MoeConvertError(f"experts stored fused (3-D) are not read for {self.title} checkpoints: quantized "
                              "experts are read per expert", file=source.tensors[name].file.name
                              if name in source.tensors else str(source.ident), tensor=name,
                              expected=f"{prefix}.E.{{gate_proj,up_proj,down_proj}}.*")

    def decode_fused(self, source: Source, layer, part: Partition, e0: int, e1: int) -> ExpertBlock:
        """Global experts [e0, e1) of a fused layer, read one chunk of experts at a time (``rows=(e0, e1)``:
        the chunk's bytes only, never the whole 3-D tensor), in the layer's ``storage``."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------
# Shared checks (every format's refusals read alike)


def show(x) -> str:
    return "absent" if x is None else f"{list(x[0])} {x[1]}"


def expect_shape(source: Source, name: str, want) -> None:
    got = source.tensors[name].shape
    if tuple(got) != tuple(want):
        raise MoeConvertError("unexpected shape", file=source.tensors[name].file.name, tensor=name,
                              expected=list(want), found=list(got))


def expect_fused_shape(source: Source, name: str, want: tuple[int, ...], sizes) -> None:
    """A fused tensor's shape against the config (``sizes``: modelmap.ConfigSizes), naming the config
    key a disagreeing axis comes from."""
    got = tuple(source.tensors[name].shape)
    if got == tuple(want):
        return
    if len(got) == len(want) and got[0] != want[0]:
        detail = f"{got[0]} experts, config.json {sizes.E_key} = {sizes.E}"
    else:
        detail = f"config.json {sizes.I_key} = {sizes.I}, {sizes.H_key} = {sizes.H}"
    raise MoeConvertError(f"fused expert tensor disagrees with the config ({detail})",
                          file=source.tensors[name].file.name, tensor=name, expected=list(want), found=list(got))


def expect_dtype(source: Source, name: str, allowed: tuple[str, ...]) -> None:
    """Tensors decode reads as words, sizes, scales or biases must have a dtype it can read them as."""
    got = source.tensors[name].dtype
    if got not in allowed:
        raise MoeConvertError("unexpected dtype", file=source.tensors[name].file.name, tensor=name,
                              expected=" or ".join(allowed), found=got)


def expect_finite(source: Source, name: str, t: torch.Tensor) -> torch.Tensor:
    """Scales must be finite: a NaN or inf scale is a corrupted checkpoint, and no engine says so."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise MoeConvertError("scales must be finite", file=source.tensors[name].file.name, tensor=name,
                              expected="finite values", found=f"{int(bad.sum())} NaN/inf")
    return t


def check_alike(source: Source, prefix: str, experts: list[Expert], required: frozenset[str],
                allowed: frozenset[str], scheme: Scheme) -> None:
    """Every expert has every ``required`` tensor, none outside ``allowed``, and expert 0's shapes/dtypes."""
    t = source.tensors
    want = {(role, suf): (t[n].shape, t[n].dtype) for role, by in experts[0].items() for suf, n in by.items()}
    for e, ex in enumerate(experts):
        for role in ROLES:
            have = set(ex.get(role, {}))
            for suf in sorted(required - have):
                raise MoeConvertError("missing expert tensor", file=str(source.ident),
                                      tensor=f"{prefix}.{e}.<{role}>.{suf}", expected=", ".join(sorted(required)),
                                      found=", ".join(sorted(have)) or "nothing")
            for suf in sorted(have - allowed):
                raise MoeConvertError(f"unexpected expert tensor for a {scheme.describe()} layer",
                                      file=str(source.ident), tensor=ex[role][suf],
                                      expected=", ".join(sorted(allowed)), found=suf)
        got = {(role, suf): (t[n].shape, t[n].dtype) for role, by in ex.items() for suf, n in by.items()}
        if got != want:
            diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[0]
            name = ex.get(diff[0], {}).get(diff[1]) or f"{prefix}.{e}.<{diff[0]}>.{diff[1]}"
            raise MoeConvertError("expert tensors disagree across experts", file=str(source.ident), tensor=name,
                                  expected=show(want.get(diff)) + " (as expert 0)", found=show(got.get(diff)))


def check_bias(source: Source, prefix: str, first: Expert, H: int, I: int) -> None:
    if "bias" not in first["gate"]:
        return
    for r, n in (("gate", I), ("up", I), ("down", H)):
        if "bias" not in first[r]:
            raise MoeConvertError("expert bias on some projections only", file=str(source.ident),
                                  tensor=f"{prefix}.0.<{r}>.bias", expected="present", found="missing")
        expect_shape(source, first[r]["bias"], (n,))
        expect_dtype(source, first[r]["bias"], FLOAT_DTYPES)


def suffix_list(first: Expert) -> str:
    return ", ".join(sorted(set(first["gate"])))
