"""What each plugin method serves (integrations/vllm/methods/spec.py), and the refusals made from it.

Pure data, no vLLM: every method x every reason it refuses names that method and its kernel, never another
one, and the fix it suggests is a method that serves the layer (its layout holds the layer's scheme and
sizes). The refusals as vLLM raises them run in tests/test_vllm_plugin.py and tests/test_vllm_parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moeconvert.integrations.vllm.methods.spec import (SPECS, SWIGLUOAI, alternatives, convert_again, elsewhere,
                                                       eplb_refusal, layout_fits, spec_for)
from moeconvert.integrations.vllm.scope import refusal
from moeconvert.layouts import layout_classes

ACTIVATIONS = ("silu", "swigluoai", "gelu")
SERVED = {(cls.name, kind): cls.vllm_method for cls in layout_classes() if cls.vllm_method for kind in cls.schemes}


def _others(spec) -> list[str]:
    return [n for n in SPECS if n != spec.name and n not in spec.name]


def _names_only(text: str, spec) -> None:
    assert spec.name in text and spec.kernel in text, text
    assert not [n for n in _others(spec) if n in text], text


def test_every_layout_vllm_serves_has_the_spec_of_its_method_and_every_spec_a_layout():
    assert SERVED
    for (layout, kind), method in SERVED.items():
        spec = spec_for(layout, kind)
        assert spec is SPECS[method] and spec.layout == layout and kind in spec.kinds, (layout, kind)
    assert {s.name for s in SPECS.values()} == set(SERVED.values())
    assert {(s.layout, k) for s in SPECS.values() for k in s.kinds} == set(SERVED)


def _entry(kind: str, activation: str = "silu", bits: int = 4, group: int = 128, symmetric: bool = True,
           H: int = 256, I: int = 256) -> dict:
    """A manifest layer entry of these experts (the fields a layout's check reads)."""
    scheme = ({"kind": "mxfp4", "block_size": 32} if kind == "mxfp4" else {"kind": "nvfp4", "group_size": 16}
              if kind == "nvfp4" else {"kind": "wna16", "bits": bits, "group_size": group, "symmetric": symmetric, "scale_dtype": "bfloat16"})
    return {"num_experts": 4, "hidden_size": H, "intermediate_size": I, "hidden_size_padded": H,
            "intermediate_size_padded": I, "has_bias": False, "activation": activation, "scheme": scheme,
            "activation_params": {}}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_an_activation_a_method_does_not_run_is_refused_naming_that_method(name, activation):
    spec = SPECS[name]
    for kind in spec.kinds:
        why = refusal(spec.layout, kind, "qwen3-moe", [(activation, {})])
        if activation in spec.activations:
            assert why is None, why
            continue
        assert f"runs the {' or '.join(spec.activations)} activation only, these experts' is {activation}" in why
        _names_only(why, spec)


@pytest.mark.parametrize("name", [n for n, s in SPECS.items() if "swigluoai" in s.activations])
def test_swigluoai_constants_a_method_cannot_take_are_refused_naming_that_method(name):
    spec = SPECS[name]
    for kind in spec.kinds:
        assert refusal(spec.layout, kind, "gpt-oss", [("swigluoai", dict(SWIGLUOAI))]) is None
        why = refusal(spec.layout, kind, "gpt-oss", [("swigluoai", {"alpha": 1.5, "limit": 7.0})])
        if spec.any_swigluoai_constants:
            assert why is None, why
        else:
            assert "applies swigluoai with alpha 1.702, limit 7.0 (gpt-oss's)" in why
            _names_only(why, spec)


def test_a_layout_the_plugin_does_not_serve_is_refused_listing_every_method():
    why = refusal("plain", "wna16", "qwen3-moe", [("silu", {})])
    assert all(n in why for n in SPECS) and "this one is plain wna16" in why


# every method x the layers it serves: the EPLB refusal, the fix where its kernel cannot run here, and
# where no vLLM holds the folder's bytes
LAYERS = [("wna16", dict(bits=4)), ("wna16", dict(bits=4, symmetric=False)), ("wna16", dict(bits=8)),
          ("wna16", dict(bits=8, symmetric=False)), ("wna16", dict(bits=4, group=-1)), ("mxfp4", {}),
          ("mxfp4", dict(activation="swigluoai")), ("nvfp4", {})]
CASES = [(name, kind, kw) for name, spec in SPECS.items() for kind, kw in LAYERS if kind in spec.kinds
         and spec.supports_activation(kw.get("activation", "silu"))[0]]


def _fix_serves(fix, entry: dict, *, eplb=False, portable=False) -> None:
    """The suggested method serves the layer: its kind, activation, its layout holds the scheme and sizes."""
    kind, act = entry["scheme"]["kind"], entry["activation"]
    assert kind in fix.kinds and fix.supports_activation(act)[0], fix
    assert layout_fits(entry, "bfloat16")(fix), fix
    assert not eplb or fix.supports_eplb()[0]
    assert not portable or fix.portable


@pytest.mark.parametrize("name,kind,kw", CASES, ids=[f"{n}-{k}-{'-'.join(f'{a}{b}' for a, b in kw.items())}"
                                                     for n, k, kw in CASES])
def test_each_refusal_names_its_method_and_a_fix_that_serves_the_layer(name, kind, kw):
    spec, entry = SPECS[name], _entry(kind, **kw)
    fits = layout_fits(entry, "bfloat16")
    ok, why = spec.supports_eplb()
    if ok:
        assert why is None
    else:
        alts = alternatives(kind, entry["activation"], {}, fits, exclude=spec, eplb=True)
        line = eplb_refusal(spec, "model.layers.0.mlp.experts", "TP 2, EP 2, with EPLB", alts,
                            lambda s: s.command(kind))
        assert f"{spec.name} ({spec.kernel}) cannot follow it: {spec.no_eplb}: serve without --enable-eplb" in line
        _names_only(line.split(": serve without")[0], spec)
        for fix in alts:
            _fix_serves(fix, entry, eplb=True)
        if alts:
            assert line.endswith(f"or convert with --backend {alts[0].layout} ({alts[0].command(kind)})"), line
    alts = alternatives(kind, entry["activation"], {}, fits, exclude=spec, portable=True)
    for fix in alts:
        _fix_serves(fix, entry, portable=True)
    text = elsewhere(alts, None)
    assert text == (f"serve a --backend {alts[0].layout} folder on this machine" if alts else
                    "no other layout the plugin serves holds these experts")
    assert "--backend" not in elsewhere(alts, "cpu")  # off GPUs no method's folder is the fix


def test_the_eplb_fix_of_each_method_is_the_one_that_serves_the_layer():
    """The refusals that named the wrong method or fix: humming WNA16 and triton MXFP4 folders (they named
    Marlin WNA16 and suggested --backend triton to both)."""
    wna16, mx = _entry("wna16", bits=4), _entry("mxfp4", activation="swigluoai")

    def fix(name, entry):
        return [s.name for s in alternatives(entry["scheme"]["kind"], entry["activation"], {},
                                             layout_fits(entry, "bfloat16"), exclude=SPECS[name], eplb=True)]

    assert fix("HummingWNA16Method", wna16)[:1] == ["TritonWNA16Method"]
    assert fix("MarlinWNA16Method", wna16)[:1] == ["TritonWNA16Method"]
    assert fix("TritonMXFP4Method", mx)[:1] == ["MarlinMXFP4Method"]
    # vLLM's Triton WNA16 layout holds no int8 with zero points: no method with EPLB holds it
    assert fix("MarlinWNA16Method", _entry("wna16", bits=8, symmetric=False)) == []
    # nor does any layout but Marlin's hold NVFP4: its EPLB refusal suggests no other backend
    assert fix("MarlinNVFP4Method", _entry("nvfp4")) == []
    line = eplb_refusal(SPECS["MarlinNVFP4Method"], "model.layers.0.mlp.experts", "TP 1 rank 0, EP 2 rank 0, with "
                        "EPLB", [], lambda s: s.command("nvfp4"))
    assert line == ("model.layers.0.mlp.experts: this vLLM builds the layer with EPLB (TP 1 rank 0, EP 2 rank 0, with "
                    "EPLB); MarlinNVFP4Method (vLLM's Marlin MoE kernel) cannot follow it: vLLM 0.33.0's "
                    "CompressedTensorsW4A4Nvfp4MoEMethod moves experts between ranks for its FlashInfer backends only, "
                    "not Marlin (supports_eplb): serve without --enable-eplb")


@pytest.mark.parametrize("layout", sorted({s.layout for s in SPECS.values()}))
def test_convert_again_names_the_folders_own_backend(layout):
    text = convert_again(layout)
    # one command per verb that makes such a folder (repack serves WNA16 and NVFP4 sources alike)
    verbs = {"quantize" if k == "mxfp4" else "repack" for s in SPECS.values() if s.layout == layout for k in s.kinds}
    assert text.count(f"--backend {layout})") + text.count(f"--backend {layout},") == len(verbs), text
    assert all(f"--backend {other}" not in text.replace(f"--backend {layout}", "")
               for other in {s.layout for s in SPECS.values()}), text
    assert convert_again(None) == "convert the source again with this moeconvert rather than edit the file"


def test_each_spec_names_the_module_that_defines_its_method():
    """``methods.method_class`` imports ``methods/<spec.module>.py`` for the class (read here without vLLM)."""
    import ast

    import moeconvert.integrations.vllm.methods as methods

    folder = Path(methods.__file__).parent
    defined = {}
    for path in folder.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and path.stem not in ("base", "spec"):
                defined[node.name] = path.stem
    assert defined == {name: spec.module for name, spec in SPECS.items()}


def test_another_layout_is_asked_with_the_sizes_it_pads_mxfp4_to():
    """A humming MXFP4 folder of I 160 holds I 192 (vLLM's HUMMING round-up); Marlin's MXFP4 layout pads 160
    its own way, and holds the layer: the fix where humming cannot run is a Marlin folder."""
    entry = dict(_entry("mxfp4", I=160), intermediate_size_padded=192)
    fits = layout_fits(entry, "bfloat16")
    assert fits(SPECS["MarlinMXFP4Method"]) and fits(SPECS["HummingMXFP4Method"])
    alts = alternatives("mxfp4", "silu", {}, fits, exclude=SPECS["HummingMXFP4Method"], portable=True)
    assert elsewhere(alts, None) == "serve a --backend marlin folder on this machine"


# spec -> the vLLM experts class its kernel is (vllm/model_executor/layers/fused_moe/experts/...)
EXPERTS_CLASSES = {"MarlinWNA16Method": ("experts/marlin_moe.py", "MarlinExperts"),
                   "MarlinMXFP4Method": ("experts/marlin_moe.py", "MarlinExperts"),
                   "HummingWNA16Method": ("experts/fused_humming_moe.py", "HummingGroupedExperts"),
                   "HummingMXFP4Method": ("experts/fused_humming_moe.py", "HummingGroupedExperts"),
                   "TritonWNA16Method": ("experts/triton_moe.py", "TritonWNA16Experts")}


@pytest.mark.parametrize("activation", ["situ", "swiglustep"])
@pytest.mark.parametrize("name", list(EXPERTS_CLASSES))
def test_activation_is_declared_where_vllms_experts_class_runs_it(name, activation, vllm_version):
    """Kimi-K3's SITU and Step-3.5's swiglustep: a method declares each exactly where vLLM's own experts class
    for its kernel accepts it (``_supports_activation``, run from that version's source)."""
    from helpers import vllm_supports_activation

    rel, cls = EXPERTS_CLASSES[name]
    assert (activation in SPECS[name].activations) == vllm_supports_activation(vllm_version, rel, cls, activation)
    assert vllm_supports_activation(vllm_version, rel, cls, "silu")  # the oracle itself answers
