"""Which folders the vLLM plugin serves, decided from what a conversion plans (no vLLM import).

The plugin refuses a folder with these sentences when it reads its manifest; they need no vLLM, so that
the converter can ask the same question of a plan.
"""

from __future__ import annotations


def method_name(layout: str, kind: str | None) -> str | None:
    """The plugin method the layout declares for experts of this scheme kind (``Layout.vllm_method``)."""
    from moeconvert.layouts import get_layout

    found = get_layout(layout, kind)
    return found.vllm_method if kind in found.schemes else None


def refusal(layout: str, kind: str | None, family: str, activations: set[str]) -> str | None:
    """Why the plugin does not serve a folder of this layout, scheme kind, model family and expert
    activations; None when it does."""
    if method_name(layout, kind) is None:
        return ("the vLLM plugin serves Marlin WNA16, Marlin MXFP4, Triton WNA16 and humming WNA16 folders; this one "
                f"is {layout} {kind or 'of mixed schemes'}")
    if family == "gpt-oss":
        # vLLM 0.33.0's GptOssModel.load_weights slices and transposes any tensor named w13_weight / w2_weight
        # itself, whatever its layout (model_executor/models/gpt_oss.py)
        return ("gpt-oss folders are not served yet: vLLM 0.33.0's gpt-oss loader slices and permutes every "
                "tensor named w13_weight / w2_weight itself, whatever its layout")
    if activations - {"silu"}:
        return "the vLLM plugin serves SiLU-and-mul experts only"
    return None
