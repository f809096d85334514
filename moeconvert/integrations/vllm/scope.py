"""Which folders the vLLM plugin serves, and how, decided from what a conversion plans (no vLLM import).

The plugin refuses a folder with these sentences when it reads its manifest, and the converter asks the
same questions of a plan (``convert.served_config``): a folder the plugin would refuse keeps the source's
config.json, and says why.
"""

from __future__ import annotations

from moeconvert.integrations.vllm.methods.spec import served, spec_for

#: the load format a folder of these families must be served with, and why
LOAD_FORMATS = {
    # vLLM 0.33.0's GptOssModel.load_weights (model_executor/models/gpt_oss.py) slices and transposes any
    # tensor named w13_weight / w2_weight itself, whatever its layout, so the experts must not reach it
    "gpt-oss": ("moeconvert", "vLLM's gpt-oss loader slices and transposes every tensor named w13_weight / "
                              "w2_weight itself, whatever its layout"),
}


def method_name(layout: str, kind: str | None) -> str | None:
    """The plugin method the layout declares for experts of this scheme kind (``Layout.vllm_method``)."""
    spec = spec_for(layout, kind)
    return spec.name if spec is not None else None


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
    activations (``(activation, its parameters)`` per MoE layer); None when it does. The method's own
    spec answers (``methods/spec.py``)."""
    spec = spec_for(layout, kind)
    if spec is None:
        return f"the vLLM plugin serves {served()} folders; this one is {layout} {kind or 'of mixed schemes'}"
    for activation, params in activations:
        ok, why = spec.supports_activation(activation, params)
        if not ok:
            return f"its {layout} {kind} experts are {spec.name}'s, and {spec.refuses(why)}"
    return None
