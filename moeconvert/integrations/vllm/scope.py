"""Which folders the vLLM plugin serves, and how, decided from what a conversion plans (no vLLM import).

The plugin refuses a folder with these sentences when it reads its manifest, and the converter asks the
same questions of a plan (``convert.served_config``): a folder the plugin would refuse keeps the source's
config.json, and says why.
"""

from __future__ import annotations

from moeconvert.format.families import BY_NAME
from moeconvert.integrations.vllm.methods.spec import served, spec_for

#: the load format a folder of these families must be served with, and why
LOAD_FORMATS = {
    # vLLM 0.33.0's GptOssModel.load_weights (model_executor/models/gpt_oss.py) slices and transposes any
    # tensor named w13_weight / w2_weight itself, whatever its layout, so the experts must not reach it
    "gpt-oss": ("moeconvert", "vLLM's gpt-oss loader slices and transposes every tensor named w13_weight / "
                              "w2_weight itself, whatever its layout"),
    # vLLM 0.33.0's DeepSeek-V4 load_weights (models/deepseek_v4/{cpu,nvidia}/model.py) maps per-expert names
    # (ffn.experts.E.w1 ...) only: a stacked experts tensor matches none of its expert mappings
    "deepseek-v4": ("moeconvert", "vLLM's DeepSeek-V4 loader maps per-expert tensors (ffn.experts.E.w1/w2/w3) "
                                  "only, not stacked ones"),
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


def proven_families() -> list[str]:
    """The families the plugin has been proven on (``FamilySpec.plugin_proven``)."""
    return [f.name for f in BY_NAME.values() if f.plugin_proven]


def vllm_prefix(family: str, prefix: str) -> str:
    """The prefix vLLM's model class gives the MoE layer the manifest holds at ``prefix``."""
    return BY_NAME[family].vllm_prefix(prefix)


def family_refusal(family: str, vllm_version: str | None = None) -> str | None:
    """Why the plugin does not serve a folder of ``family`` on vLLM ``vllm_version`` (None: on the vLLM the
    folder is made for, which the layout's own list decides); None when it does. The family table
    answers: the vLLM versions whose model registry has the family's classes, and whether the plugin
    was proven on it."""
    f = BY_NAME[family]
    if vllm_version is not None and vllm_version not in f.vllm_versions:
        has = (f"vLLM {', '.join(f.vllm_versions)} has it" if f.vllm_versions
               else "nor has any vLLM version the plugin serves")
        return (f"vLLM {vllm_version} has no {family} model ({' / '.join(f.vllm_classes)} is not in its model "
                f"registry; {has})")
    if not f.plugin_proven:
        why = f"{f.plugin_unprovable}; " if f.plugin_unprovable else ""
        return (f"the vLLM plugin has not been proven on {family} models ({why}it is on {', '.join(proven_families())}; "
                f"docs/families.md): serve the source checkpoint, or load the folder with moeconvert.runtime")
    return None


def refusal(layout: str, kind: str | None, family: str, activations: list[tuple[str, dict]],
            vllm_version: str | None = None) -> str | None:
    """Why the plugin does not serve a folder of this layout, scheme kind, model family and expert
    activations (``(activation, its parameters)`` per MoE layer) on vLLM ``vllm_version``; None when it
    does. The family table answers for the family (:func:`family_refusal`), the method's own spec for
    the rest (``methods/spec.py``)."""
    why = family_refusal(family, vllm_version)
    if why is not None:
        return why
    spec = spec_for(layout, kind)
    if spec is None:
        return f"the vLLM plugin serves {served()} folders; this one is {layout} {kind or 'of mixed scheme kinds'}"
    for activation, params in activations:
        ok, why = spec.supports_activation(activation, params)
        if not ok:
            return f"its {layout} {kind} experts are {spec.name}'s, and {spec.refuses(why)}"
    return None
