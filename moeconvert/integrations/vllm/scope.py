"""Which folders the vLLM plugin serves, and how, decided from what a conversion plans (no vLLM import).

The plugin refuses a folder with these sentences when it reads its manifest, and the converter asks the
same questions of a plan (``convert.served_config``): a folder the plugin would refuse keeps the source's
config.json, and says why.
"""

from __future__ import annotations

#: the expert activations each plugin method serves (``Layout.vllm_method``), as vLLM 0.33.0's kernel for it
#: runs them: Marlin applies any activation vLLM has (``apply_moe_activation``), and its MXFP4 layout holds
#: w13's rows for silu and swigluoai; triton_kernels' fused epilogue (vLLM's TRITON backend) is swigluoai only
METHOD_ACTIVATIONS = {
    "MarlinWNA16Method": ("silu",),
    "TritonWNA16Method": ("silu",),
    "MarlinMXFP4Method": ("silu", "swigluoai"),
    "TritonMXFP4Method": ("swigluoai",),
    "HummingWNA16Method": ("silu",),
    "HummingMXFP4Method": ("silu",),
    # moeconvert's own kernel applies both in GEMM1's epilogue, swigluoai with the manifest's alpha and limit
    "TritonFastMethod": ("silu", "swigluoai"),
}
#: the methods whose kernel takes swigluoai's alpha and limit as arguments (any the manifest records)
SWIGLUOAI_ANY_CONSTANTS = ("TritonFastMethod",)
#: swigluoai's constants as vLLM 0.33.0's kernels apply them: its gpt-oss method passes alpha 1.702, beta 1,
#: limit 7 (quantization/mxfp4.py), ``swigluoai_and_mul`` (Marlin) and triton_kernels' fused swiglu
#: (``triton_kernel_fused_experts``) take exactly these whatever the config says
SWIGLUOAI = {"alpha": 1.702, "limit": 7.0}
SWIGLUOAI_BETA = 1.0

#: the load format a folder of these families must be served with, and why
LOAD_FORMATS = {
    # vLLM 0.33.0's GptOssModel.load_weights (model_executor/models/gpt_oss.py) slices and transposes any
    # tensor named w13_weight / w2_weight itself, whatever its layout, so the experts must not reach it
    "gpt-oss": ("moeconvert", "vLLM's gpt-oss loader slices and transposes every tensor named w13_weight / "
                              "w2_weight itself, whatever its layout"),
}


def method_name(layout: str, kind: str | None) -> str | None:
    """The plugin method the layout declares for experts of this scheme kind (``Layout.vllm_method``)."""
    from moeconvert.layouts import get_layout

    found = get_layout(layout, kind)
    return found.vllm_method if kind in found.schemes else None


def load_format(family: str) -> str | None:
    """The ``--load-format`` a folder of this model family must be served with (None: any)."""
    return LOAD_FORMATS[family][0] if family in LOAD_FORMATS else None


def load_format_refusal(family: str, prefix: str, have: str | None) -> str | None:
    """Why vLLM started with load format ``have`` cannot serve a folder of ``family``; None when it can."""
    need = load_format(family)
    if need is None or have == need:
        return None
    return (f"{prefix}: a {family} folder is served with --load-format {need} only ({LOAD_FORMATS[family][1]}; "
            f"moeconvert's loader reads the experts straight into the layer): serve with --load-format {need} "
            f"(this vLLM loads with {have!r})")


def refusal(layout: str, kind: str | None, family: str, activations: list[tuple[str, dict]]) -> str | None:
    """Why the plugin does not serve a folder of this layout, scheme kind, model family and expert
    activations (``(activation, its parameters)`` per MoE layer); None when it does."""
    method = method_name(layout, kind)
    if method is None:
        return ("the vLLM plugin serves Marlin WNA16, Marlin MXFP4, Triton WNA16, triton_kernels MXFP4, humming WNA16, "
                "humming MXFP4 and triton-fast (moeconvert's own kernel) folders; "
                f"this one is {layout} {kind or 'of mixed schemes'}")
    served = METHOD_ACTIVATIONS[method]
    for activation, params in activations:
        if activation not in served:
            return (f"the vLLM plugin serves {layout} {kind} experts with the {' or '.join(served)} activation "
                    f"only (vLLM's kernel for them), this folder's are {activation}")
        if activation == "swigluoai" and method not in SWIGLUOAI_ANY_CONSTANTS:
            got = {k: (params or {}).get(k, v) for k, v in SWIGLUOAI.items()}
            if got != SWIGLUOAI:
                return (f"swigluoai with {got}: vLLM 0.33.0's MoE kernels apply alpha {SWIGLUOAI['alpha']}, "
                        f"limit {SWIGLUOAI['limit']} (gpt-oss's) whatever the config says")
    return None
