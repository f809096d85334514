"""What each of the plugin's MoE methods serves, as data: one :class:`MethodSpec` a method (no vLLM import).

Each method class (``methods/<module>.py``) takes its spec from :data:`SPECS` by its name; scope.py asks
the specs which folders the plugin serves (the converter asks it of a plan, without vLLM), config.py and
the methods make every refusal from them. As vLLM's experts classes answer ``_supports_activation`` /
``_supports_parallel_config`` with ``(ok, reason)``, a spec answers :meth:`MethodSpec.supports_activation`
and :meth:`MethodSpec.supports_eplb`; the refusal's text is written here, from the spec that refuses, and its
fix is another spec that serves the layer (:func:`alternatives`, checked against the layer's scheme and
sizes by that spec's layout), so a refusal can never name another method or suggest a backend that cannot
hold the folder. Adding a method is its module plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

#: swigluoai's constants as vLLM 0.33.0's kernels apply them: its gpt-oss method passes alpha 1.702, beta 1,
#: limit 7 (quantization/mxfp4.py), ``swigluoai_and_mul`` (Marlin) and triton_kernels' fused swiglu
#: (``triton_kernel_fused_experts``) take exactly these whatever the config says
SWIGLUOAI = {"alpha": 1.702, "limit": 7.0}
SWIGLUOAI_BETA = 1.0


@dataclass(frozen=True)
class MethodSpec:
    """One plugin method: what it serves and, for what it does not, why (one clause each)."""

    name: str  #: the class, as ``Layout.vllm_method`` names it
    module: str  #: ``methods/<module>.py`` holds the class
    layout: str  #: the layout (the ``--backend`` word) of the folders it serves
    kinds: tuple[str, ...]  #: the scheme kinds (``wna16``, ``mxfp4``, ``nvfp4``) of those folders
    kernel: str  #: what runs the experts, in words
    #: the expert activations it serves, as vLLM 0.33.0's kernel for it runs them
    activations: tuple[str, ...]
    #: its kernel takes swigluoai's alpha and limit as arguments (any the manifest records); else only
    #: :data:`SWIGLUOAI`'s
    any_swigluoai_constants: bool = False
    #: None: vLLM's EPLB (``--enable-eplb``) moves its experts; else why it cannot
    no_eplb: str | None = None
    #: its kernel runs on every CUDA GPU vLLM serves MoE layers on (a fix where another method's cannot run)
    portable: bool = False

    def supports_activation(self, activation: str, params: dict | None = None) -> tuple[bool, str | None]:
        """(ok, why not) for experts with this activation and its parameters (a clause :meth:`refuses` ends)."""
        if activation not in self.activations:
            return False, f"runs the {' or '.join(self.activations)} activation only, these experts' is {activation}"
        if activation == "swigluoai" and not self.any_swigluoai_constants:
            got = {k: (params or {}).get(k, v) for k, v in SWIGLUOAI.items()}
            if got != SWIGLUOAI:
                return False, (f"applies swigluoai with alpha {SWIGLUOAI['alpha']}, limit {SWIGLUOAI['limit']} "
                               f"(gpt-oss's) whatever the config says, these experts' are {got}")
        return True, None

    def refuses(self, why: str) -> str:
        """A refusal that names this method and its kernel, ``why`` its reason."""
        return f"{self.name} ({self.kernel}) {why}"

    def supports_eplb(self) -> tuple[bool, str | None]:
        return self.no_eplb is None, self.no_eplb

    def command(self, kind: str, source: str = "SRC", fmt: str | None = None) -> str:
        """The conversion that makes a folder this method serves (``fmt``: the ``--format`` the folder was
        quantized with, where it was)."""
        if kind == "mxfp4" or fmt:
            return f"moeconvert quantize {source} OUT --format {fmt or 'mxfp4'} --backend {self.layout}"
        return f"moeconvert repack {source} OUT --backend {self.layout}"


_WNA16_EPLB = ("vLLM 0.33.0 moves experts between ranks only for kernels whose own MoE method supports it, and its "
               "{what} method does not (CompressedTensorsWNA16MoEMethod.supports_eplb is TRITON only)")

#: every method, in the order a fix is looked for (vLLM's own kernels first, the most portable first)
SPECS: dict[str, MethodSpec] = {s.name: s for s in (
    # MarlinExperts runs any activation vLLM's apply_moe_activation runs (its _supports_activation), SITU and
    # SWIGLUSTEP included, on [gate; up] halves: silu, Kimi-K3's situ and Step-3.5's swiglustep
    MethodSpec("MarlinWNA16Method", "marlin", "marlin", ("wna16",), "vLLM's Marlin MoE kernel",
               ("silu", "situ", "swiglustep"),
               no_eplb=_WNA16_EPLB.format(what="Marlin WNA16"), portable=True),
    # Marlin's MXFP4 layout holds w13's rows for silu, situ, swiglustep and swigluoai (apply_moe_activation); EPLB
    # as vLLM's Mxfp4MoEMethod (quantization/mxfp4.py), Marlin backend included
    MethodSpec("MarlinMXFP4Method", "marlin", "marlin", ("mxfp4",), "vLLM's Marlin MoE kernel",
               ("silu", "swigluoai", "situ", "swiglustep"), portable=True),
    # vLLM's compressed-tensors NVFP4 method with its MARLIN backend (Hopper, 16-bit activations): [gate; up]
    # for SiLU-and-mul only (the layout's row order)
    MethodSpec("MarlinNVFP4Method", "marlin", "marlin", ("nvfp4",), "vLLM's Marlin MoE kernel", ("silu",),
               no_eplb="vLLM 0.33.0's CompressedTensorsW4A4Nvfp4MoEMethod moves experts between ranks for its "
                       "FlashInfer backends only, not Marlin (supports_eplb)", portable=True),
    # EPLB as CompressedTensorsWNA16MoEMethod with the TRITON backend; TritonWNA16Experts lists SWIGLUSTEP
    MethodSpec("TritonWNA16Method", "triton_wna16", "triton", ("wna16",), "vLLM's Triton WNA16 MoE kernel",
               ("silu", "swiglustep"),
               portable=True),
    # triton_kernels' fused epilogue (vLLM's TRITON backend) is swigluoai only, over Hopper's swizzles
    MethodSpec("TritonMXFP4Method", "triton_mxfp4", "triton", ("mxfp4",), "triton_kernels' matmul_ogs",
               ("swigluoai",), no_eplb="vLLM's GptOssMxfp4MoEMethod declares no EPLB, and its monolithic kernel "
                                       "takes no expert rebalancing"),
    # vLLM's humming experts take what apply_moe_activation takes (SITU: its humming activation expression)
    MethodSpec("HummingWNA16Method", "humming", "humming", ("wna16",), "humming-kernels' grouped GEMM",
               ("silu", "situ", "swiglustep"),
               no_eplb=_WNA16_EPLB.format(what="humming WNA16")),
    # EPLB as vLLM's Mxfp4MoEMethod
    MethodSpec("HummingMXFP4Method", "humming", "humming", ("mxfp4",), "humming-kernels' grouped GEMM",
               ("silu", "situ", "swiglustep")),
    # vLLM's compressed-tensors NVFP4 method with its HUMMING backend (SM90): [gate; up] for SiLU-and-mul only
    MethodSpec("HummingNVFP4Method", "humming", "humming", ("nvfp4",), "humming-kernels' grouped GEMM", ("silu",),
               no_eplb="vLLM 0.33.0's CompressedTensorsW4A4Nvfp4MoEMethod moves experts between ranks for its "
                       "FlashInfer backends only, not humming (supports_eplb)"),
    # moeconvert's own kernel applies both in GEMM1's epilogue, swigluoai with the manifest's alpha and limit
    MethodSpec("TritonFastMethod", "triton_fast", "triton-fast", ("wna16", "mxfp4"), "moeconvert's Triton kernel",
               ("silu", "swigluoai"), any_swigluoai_constants=True,
               no_eplb="moeconvert's triton-fast experts have not been run with vLLM's expert rebalancing",
               portable=True),
)}


def spec_for(layout: str, kind: str | None) -> MethodSpec | None:
    """The spec of the method the layout declares for experts of this scheme kind (``Layout.vllm_method``)."""
    from moeconvert.layouts import get_layout

    found = get_layout(layout, kind)
    return SPECS.get(found.vllm_method) if kind in found.schemes else None


def served() -> str:
    """The folders the plugin serves, in words (a refusal of any other says it)."""
    return ", ".join(f"{s.layout} {'/'.join(s.kinds)} ({s.name})" for s in SPECS.values())


def convert_again(layout: str | None) -> str:
    """The fix of a folder whose own files were edited: convert again, with the commands that make a
    folder of this layout (none named when config.json names no layout the plugin serves)."""
    specs = [s for s in SPECS.values() if s.layout == layout]
    commands = list(dict.fromkeys(s.command(kind) for s in specs for kind in s.kinds))
    how = f" ({', or '.join(commands)})" if commands else ""
    return f"convert the source again with this moeconvert{how} rather than edit the file"


def alternatives(kind: str, activation: str, params: dict | None, fits: Callable[[MethodSpec], bool], *,
                 exclude: MethodSpec, eplb: bool = False, portable: bool = False) -> list[MethodSpec]:
    """The other methods that serve these experts (kind, activation; ``fits``: the method's layout holds
    the layer's scheme and sizes), with EPLB (``eplb``), on any CUDA GPU (``portable``)."""
    return [s for s in SPECS.values() if s is not exclude and kind in s.kinds
            and s.supports_activation(activation, params)[0] and (not eplb or s.supports_eplb()[0])
            and (not portable or s.portable) and fits(s)]


def layout_fits(entry: dict, dtype: str) -> Callable[[MethodSpec], bool]:
    """Whether a method's layout holds this manifest layer entry (its ``check`` finds no problem), with
    MXFP4 sizes padded as that layout pads them (``plan.layer_shape``), not as the folder's layout did."""
    import dataclasses

    from moeconvert.layouts import get_layout
    from moeconvert.layouts.base import padded_sizes
    from moeconvert.layouts.output import layer_shape_from_manifest, parse_scheme

    shape, scheme = layer_shape_from_manifest(entry, dtype), parse_scheme(entry["scheme"], "scheme")

    def fits(spec: MethodSpec) -> bool:
        try:
            layout = get_layout(spec.layout, scheme.kind)
            own = shape
            if shape.extra:
                H, I = padded_sizes(entry["hidden_size"], entry["intermediate_size"], layout.pad_multiples)
                own = dataclasses.replace(shape, hidden_size=H, intermediate_size=I)
            return not layout.check(own, scheme)
        except Exception:  # noqa: BLE001 - a layout that cannot even be asked does not hold it
            return False

    return fits


def eplb_refusal(spec: MethodSpec, prefix: str, shape: str, alts: list[MethodSpec], command) -> str:
    """The refusal of a layer vLLM builds with EPLB that ``spec``'s method cannot follow; ``command(spec)``
    names the conversion to another method's layout."""
    fix = f", or convert with --backend {alts[0].layout} ({command(alts[0])})" if alts else ""
    return (f"{prefix}: this vLLM builds the layer with EPLB ({shape}); "
            f"{spec.refuses(f'cannot follow it: {spec.no_eplb}')}: serve without --enable-eplb{fix}")


def elsewhere(alts: list[MethodSpec], platform: str | None) -> str:
    """The fix where a method's kernel cannot run on this machine: another method that runs on any CUDA GPU
    (``alts``, :func:`alternatives` with ``portable``), or, off CUDA (``platform``: vLLM's platform), none."""
    if platform is not None:
        return f"serve on a CUDA GPU (vLLM runs on its {platform} platform)"
    if not alts:
        return "no other layout the plugin serves holds these experts"
    return f"serve a --backend {alts[0].layout} folder on this machine"
