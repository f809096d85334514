"""What every layout is: a named, versioned pair encode/decode plus the constraints it states up front."""

from __future__ import annotations

from abc import ABC, abstractmethod
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.schemes import Scheme


@dataclass(frozen=True)
class ProjectionNames:
    """The file names of one projection's tensors (``{prefix}.{name}``): vLLM's FusedMoE parameter
    names (docs/format.md). Layouts' ``plan`` write them; the runtime's kernel adapters read them."""

    weight: str
    weight_scale: str
    weight_zero_point: str
    bias: str

    @classmethod
    def of(cls, projection: str) -> "ProjectionNames":
        return cls(f"{projection}_weight", f"{projection}_weight_scale", f"{projection}_weight_zero_point",
                   f"{projection}_bias")


W13, W2 = ProjectionNames.of("w13"), ProjectionNames.of("w2")
PROJECTIONS = {"w13": W13, "w2": W2}


@dataclass(frozen=True)
class TPCut:
    """How TP rank r of T is cut out of one full (TP 1) tensor of a layout, ``[E, ...]`` stacked.

    Along ``dim`` the tensor is ``runs`` equal runs (w13's ``[gate; up]`` halves: 2) and the rank holds the
    r-th of T equal pieces of each run, the runs' pieces side by side; ``dim`` None: every rank holds the
    whole tensor (w2's channelwise scales: its N is H, which TP does not cut). ``first_rank_only`` (with
    ``dim`` None): TP rank 0 holds the whole tensor and every other rank zeros, for a tensor added after
    TP's all-reduce, which the ranks' sum must count once (w2's bias: vLLM's gpt-oss loader zeroes it off
    rank 0, ``GptOssModel._load_weights_mxfp4``). A layout declares a cut only where the rank's bytes are
    exactly these bytes of the full tensor (``Layout.tp_cuts``).
    """

    dim: int | None
    runs: int = 1
    first_rank_only: bool = False

    def zeros_on(self, tp_rank: int) -> bool:
        """Whether rank ``tp_rank`` holds zeros rather than bytes of the full tensor."""
        return self.first_rank_only and tp_rank != 0

    def pieces(self, full_size: int, tp_size: int, tp_rank: int) -> list[tuple[int, int, int]]:
        """``(start in the full tensor, start in the rank's, length)`` along ``dim``, one per run."""
        run = full_size // self.runs
        piece = run // tp_size
        return [(k * run + tp_rank * piece, k * piece, piece) for k in range(self.runs)]

    def take(self, full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
        """The rank's tensor, cut out of the full one."""
        if self.zeros_on(tp_rank):
            return torch.zeros_like(full)
        if self.dim is None:
            return full
        parts = self.pieces(full.shape[self.dim], tp_size, tp_rank)
        return torch.cat([full.narrow(self.dim, start, n) for start, _, n in parts], self.dim)

    def rank_shape(self, full_shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(full_shape)
        shape = list(full_shape)
        shape[self.dim] //= tp_size
        return tuple(shape)


@dataclass(frozen=True)
class NotASlice:
    """Why a TP rank's tensors are not a slice of a layout's full ones (``Layout.tp_cuts``); ``convertible``:
    whether a conversion for that rank (``--tp-size --tp-rank``) can hold it instead."""

    reason: str
    convertible: bool = True

    def __str__(self) -> str:
        return self.reason


#: ``LayerShape.extra`` key of a layer's data-dependent encoding choices (``Layout.layer_scan``): what
#: ``encode`` and ``decode`` read, set by the job after its scan and by the manifest's reader from the facts
CHOICES = "layout_choices"


class LayerScan(ABC):
    """Facts about a whole layer that a layout's bytes depend on, gathered one chunk of experts at a time
    before the layer is encoded (``Layout.layer_scan``).

    The job adds chunks in expert order until ``settled`` (the choices are known; often after the first
    chunk), encodes with ``choices()``, and adds the chunks the scan had not seen as it encodes them, so
    every expert is scanned once; ``facts()`` (all experts added) is what the job records and the
    manifest keeps, and ``Layout.choices(facts)`` gives the same choices back."""

    @abstractmethod
    def add(self, block: ExpertBlock, first_expert: int) -> None:
        """The next chunk, ``first_expert`` its first global expert."""

    @abstractmethod
    def settled(self) -> bool:
        """Whether the experts added so far decide ``choices()`` whatever the rest hold."""

    @abstractmethod
    def choices(self) -> dict:
        """What ``encode`` reads from ``LayerShape.extra[CHOICES]`` (JSON)."""

    @abstractmethod
    def facts(self) -> dict:
        """Every fact gathered, once every expert was added (JSON)."""


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_sizes(hidden_size: int, intermediate_size: int, multiples: tuple[int, int]) -> tuple[int, int]:
    """(Hp, Ip) for one TP rank's I (docs/quantize.md), ``multiples`` a layout's ``pad_multiples``."""
    return round_up(hidden_size, multiples[0]), round_up(intermediate_size, multiples[1])


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a layout writes for a layer: ``{prefix}.{suffix}``, leading dim = local experts."""

    suffix: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


class Layout(ABC):
    #: the name users type (``--backend``)
    name: ClassVar[str]
    #: bumped whenever the bytes a layout writes change; the runtime refuses versions it does not know
    version: ClassVar[int]
    #: canonical scheme kinds this layout takes ("float", "wna16", "mxfp4", "nvfp4")
    schemes: ClassVar[tuple[str, ...]]
    #: the runtime kernels that read these bytes, by their registered names (runtime/dispatch.py), in
    #: order of preference: ``("reference",)`` when the PyTorch reference is the layout's own kernel, ``()``
    #: when no runtime kernel reads it yet (the runtime then runs the reference and says why). This is the
    #: only place the link layout -> kernel is declared; every layout class states it itself (``register``
    #: refuses one that would inherit it).
    runtime_kernels: ClassVar[tuple[str, ...]]
    #: the engine kernel the bytes were made for, in words (the manifest's and ``inspect``'s ``kernel``),
    #: and the library versions they were made to match: for vLLM, the list of versions whose own processing
    #: the oracle tests check the bytes against (``tests/helpers.py`` VLLM_VERSIONS; docs/format.md)
    kernel: ClassVar[str]
    made_for: ClassVar[dict[str, str | list[str]]] = {}
    #: keys of ``made_for`` a folder of this layout version may lack: they name where the bytes are served
    #: (our own layout's vLLM versions), not a library whose processing made them
    made_for_optional: ClassVar[tuple[str, ...]] = ()
    #: the plugin's MoE method (``moeconvert/integrations/vllm/methods/``) that serves these bytes in vLLM,
    #: or None: the converter then writes a config.json whose ``quantization_config`` names the plugin
    #: (``moeconvert[vllm]``, docs/vllm.md), and the plugin builds this method for the layer
    vllm_method: ClassVar[str | None] = None
    #: for layouts of quantized-at-conversion experts (``quantize``): the multiples the engine rounds
    #: (H, I per TP rank) up to before quantizing (docs/quantize.md); the canonical block the layout
    #: gets is already zero-padded to them, and ``LayerShape`` carries the padded sizes
    pad_multiples: ClassVar[tuple[int, int]] = (1, 1)

    def check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        """Every constraint this layer violates for this layout (empty: it can be written)."""
        if scheme.kind not in self.schemes:
            from moeconvert.layouts import layout_kinds

            hint = ("; `moeconvert quantize --format mxfp4` makes MXFP4 experts for it"
                    if scheme.kind in ("float", "wna16") and "mxfp4" in layout_kinds(self.name) else "")
            return [f"backend '{self.name}' takes {', '.join(layout_kinds(self.name))} experts, not "
                    f"{scheme.describe()}{hint}"]
        return self._check(shape, scheme)

    @abstractmethod
    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]: ...

    def source_problems(self, source_format: str, shape: LayerShape) -> list[str]:
        """Constraints that depend on the checkpoint format the layer was read from (``MoELayerMap.format``,
        a reader's name): where vLLM processes that format otherwise than the layout's bytes assume."""
        return []

    @staticmethod
    def require_block_sizes(block: ExpertBlock, shape: LayerShape) -> None:
        """The block is of this layer (H, I): a mismatch is a bug of the caller, not of the input."""
        if (block.hidden_size, block.intermediate_size) != (shape.hidden_size, shape.intermediate_size):
            raise InternalError(f"block is H={block.hidden_size} I={block.intermediate_size}, layer says "
                                f"H={shape.hidden_size} I={shape.intermediate_size}")

    def require(self, shape: LayerShape, scheme: Scheme) -> None:
        """``check`` as an error: ``encode`` calls it before it lays out a byte."""
        problems = self.check(shape, scheme)
        if problems:
            raise MoeConvertError(f"layout '{self.name}' cannot hold this layer: {'; '.join(problems)}")

    @abstractmethod
    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        """The tensors written for a layer, in file order, with their full shapes."""

    @abstractmethod
    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        """Canonical chunk of experts -> {suffix: tensor}, leading dim = the chunk's experts."""

    @abstractmethod
    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Inverse of encode, exactly."""

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """What ``decode`` must give back for a source block: the block itself, unless the layout
        documents a value change the engine makes too (e.g. casting scales to the model dtype)."""
        return block

    def byte_problems(self, tensors: dict[str, torch.Tensor], block: ExpertBlock, shape: LayerShape) -> list[str]:
        """Every way ``tensors`` (a chunk of a layer's experts as stored; ``block`` their ``decode``) hold bytes
        this layout's encoding never writes, in one line each; empty: they are bytes it writes. What a
        decode cannot see: ``verify`` runs it on every chunk (docs/format.md, "What verify guarantees").

        The bytes are a function of the canonical block (``encode``), and ``decode`` reads every value the
        encoding depends on, so bytes are this layout's exactly when encoding their decode gives them back,
        bit for bit: codes the encoding cannot write (humming's sign-magnitude -0), padding it fills with
        one value, scale swizzles, choices made from the data all fall out of that one comparison. A layer
        padded for the engine (``pad_multiples``) also holds zeros where the engine's zero-initialised
        parameters hold them (:func:`padding_problems`). A layout overrides this only to add invariants
        that hold across chunks."""
        problems = padding_problems(block, shape)
        try:
            again = self.encode(block, shape)
        except (MoeConvertError, InternalError, RuntimeError, ValueError) as e:
            return problems + [f"the values these bytes decode to are nothing layout {self.name} encodes: {e}"]
        return problems + unwritten_problems(self.name, tensors, again)

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        """Extra per-layer facts a loader needs (padded sizes, ...), stored in the manifest; with ``facts``
        (``layer_scan``'s, of a finished conversion) also what the data decided."""
        return {}

    # -- choices that depend on the data of a whole layer ------------------------------------------------

    def layer_scan(self, shape: LayerShape, scheme: Scheme, expert_offset: int) -> LayerScan | None:
        """A scan of the layer's experts that must run before any chunk is encoded, when the layout's
        bytes depend on a fact of the whole layer (humming's sign-magnitude choice); None (most layouts):
        each chunk is encoded from its own data. ``expert_offset``: the layer's first global expert."""
        return None

    def recorded_facts(self, metadata: object) -> object:
        """The facts a manifest's ``layout_metadata`` holds (unchecked: ``facts_problem``)."""
        return None

    def facts_problem(self, facts: object, shape: LayerShape, scheme: Scheme, expert_offset: int) -> str | None:
        """Why ``facts`` cannot be what ``layer_scan`` finds for this layer (types, expert ranges), or None."""
        return None

    def choices(self, facts: dict, shape: LayerShape, scheme: Scheme) -> dict:
        """The encoding choices well-formed ``facts`` decide (``LayerScan.choices`` of the whole layer)."""
        return {}

    def experts_problem(self, metadata: dict, experts: list[int]) -> str | None:
        """Why an engine rank holding global ``experts`` of this layer (EP) would not hold the rows of these
        bytes, when the engine makes a data-dependent choice over a rank's own experts; None: it would."""
        return None

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        """Things users should know about this layer in this layout (not errors)."""
        return []

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        """How a TP rank of ``tp_size`` is cut out of this layout's full tensors of a layer of ``shape``
        (its ``intermediate_size`` the whole I): ``{suffix: TPCut}`` for every tensor ``plan`` writes when
        each rank's tensors (what a conversion with ``--tp-size tp_size`` writes) are exactly those bytes
        of the full ones, so a full folder serves that TP size storing nothing extra; otherwise why they
        are not (a rank then needs its own conversion, where one can hold it). Experts need no declaration: every layout
        encodes each expert on its own, so an EP rank's experts are rows of the stacked tensors."""
        return NotASlice(f"layout '{self.name}' does not declare how a TP rank is cut from its full tensors")

    def _rank_shape(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> LayerShape | NotASlice:
        """The layer as one TP rank holds it, or why no rank can hold it (for ``tp_cuts``). A layer padded
        for the engine (``extra`` holds the real sizes) is split at its real I, and each rank's I padded on
        its own, as the engine pads it and as a conversion for that rank does (``plan.layer_shape``): the
        padded full I need not split at all."""
        I = shape.extra.get("intermediate_size_unpadded", shape.intermediate_size)
        if tp_size < 1 or I % tp_size:
            return NotASlice(f"intermediate_size I = {I} does not split into {tp_size} equal TP parts", False)
        rank = dataclasses.replace(shape, intermediate_size=I // tp_size, extra={})  # a rank's choices are its own
        if "intermediate_size_unpadded" in shape.extra:
            H = shape.extra.get("hidden_size_unpadded", shape.hidden_size)
            rank.extra = {"hidden_size_unpadded": H, "intermediate_size_unpadded": I // tp_size}
            rank.hidden_size, rank.intermediate_size = padded_sizes(H, I // tp_size, self.pad_multiples)
        problems = self.check(rank, scheme)
        return NotASlice(f"a TP rank of {tp_size} cannot hold this layer: {problems[0]}", False) if problems else rank


def unwritten_problems(layout: str, tensors: dict[str, torch.Tensor], written: dict[str, torch.Tensor]) -> list[str]:
    """Where ``tensors`` differ, bit for bit, from what ``layout`` writes for their values (``written``)."""
    problems = []
    for suffix, t in tensors.items():
        want = written.get(suffix)
        if want is None or tuple(want.shape) != tuple(t.shape) or want.dtype != t.dtype:
            problems.append(f"{suffix}: layout {layout} writes no such tensor for these values")
            continue
        differ = _bits(t) != _bits(want)
        if bool(differ.any()):
            first = tuple(int(i) for i in differ.nonzero()[0])
            problems.append(f"{suffix}: {int(differ.sum())} of {t.numel()} elements hold bytes layout {layout} never "
                            f"writes for the values they decode to (first at {list(first)}: {_hex(t[first])}, where "
                            f"its encoding writes {_hex(want[first])})")
    return problems


def padding_problems(block: ExpertBlock, shape: LayerShape) -> list[str]:
    """Where a block padded to the engine's sizes (``LayerShape.extra`` holds the real H and I) holds anything
    but zeros in its padding: vLLM creates the padded parameters with ``torch.zeros`` and loads (or quantizes)
    the real values into them, so every padding code, scale byte and bias there is 0 (docs/quantize.md)."""
    H, I = shape.extra.get("hidden_size_unpadded"), shape.extra.get("intermediate_size_unpadded")
    if H is None or I is None or block.scheme.kind != "mxfp4":  # only MXFP4 layers are padded for the engine
        return []
    Ip = shape.intermediate_size
    per = {"w13": 2, "w2": 2, "w13_scale": 32, "w2_scale": 32, "w13_bias": 1, "w2_bias": 1}  # elements a column
    out = []
    for name, t in block.tensors().items():
        if name not in per:
            continue
        # w13: rows [gate | pad | up | pad], columns H; w2: rows H, columns I; biases: their rows only
        rows, cols = ((slice(0, I), slice(Ip, Ip + I)), -(-H // per[name])) if name.startswith("w13") else \
            ((slice(0, H),), -(-I // per[name]))
        real = torch.zeros(t.shape[1:], dtype=torch.bool)
        for r in rows:
            real[(r,) if t.dim() == 2 else (r, slice(0, cols))] = True
        held = _bits(t)[:, ~real] != 0
        if bool(held.any()):
            out.append(f"{name}: {int(held.sum())} padding elements are not 0 (the layer pads H {H} to "
                       f"{shape.hidden_size}, I {I} to {Ip}; the engine's padding holds zeros)")
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width, so floats compare by their bits (NaN, -0.0)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _hex(x: torch.Tensor) -> str:
    return f"0x{int(_bits(x.reshape(1))[0]) & ((1 << 8 * x.element_size()) - 1):0{2 * x.element_size()}x}"


def expert_bias_cuts(shape: LayerShape, runs: int) -> dict[str, TPCut] | NotASlice:
    """The TP cuts of a layer's expert biases (``Layout.tp_cuts``), ``runs`` as the layout's w13 rows.

    w13's bias is cut as w13's rows. w2's bias is added after TP's all-reduce of GEMM2, so the ranks' sum
    must count it once: vLLM's gpt-oss loaders (``GptOssModel._load_weights_mxfp4`` and
    ``_load_weights_other``, "only load on rank 0 to avoid duplication") zero it on every TP rank but 0,
    and ``decode`` writes a rank's tensors that way (moeconvert/decode.py). gpt-oss (``swigluoai``) is the
    only family vLLM 0.33.0 loads expert biases for that way; its generic loader gives every rank the
    whole bias, so other activations are not declared."""
    if shape.activation != "swigluoai":
        return NotASlice("expert biases outside gpt-oss: vLLM's generic loader gives every TP rank w2's whole bias, "
                         "which the per-rank conversion does not reproduce")
    return {W13.bias: TPCut(1, runs=runs), W2.bias: TPCut(None, first_rank_only=True)}


#: the model dtypes vLLM's WNA16 loaders cast scales and biases to
PARAMS_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def scales_and_biases_in_model_dtype(block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
    """``block`` with its scales and biases cast to the model dtype, as the engine's loader casts them when it
    copies them into its parameters (round to nearest even): what such a layout's decode gives back."""
    dt = PARAMS_DTYPES[shape.dtype]
    cast = {name: getattr(block, name).to(dt) for name in ("w13_scale", "w2_scale", "w13_bias", "w2_bias")
            if getattr(block, name) is not None}
    return dataclasses.replace(block, **cast)
