"""moeconvert's own reading of a compressed-tensors ``quantization_config`` (``moeconvert/schemes.py``),
held against compressed-tensors' pydantic models and name matching, its oracle:

* every config compressed-tensors accepts resolves each module name to the scheme compressed-tensors
  resolves it to (``QuantizationConfig.model_validate``, then ``match_targets`` / ``is_match`` on an
  ``nn.Linear``, as its ``apply_quantization_config`` does);
* a malformed config is refused on one line naming its key, and never where compressed-tensors accepts
  it unless the case says why we are stricter;
* parsing a checkpoint imports neither compressed-tensors nor pydantic nor transformers.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections import OrderedDict

import pytest

from moeconvert.errors import MoeConvertError
from moeconvert.schemes import CompressedTensorsConfig, WNA16Scheme

REFUSED = "refused"

#: one expert's projections (Qwen / DeepSeek naming, two layers; Mixtral naming), and single Linears
EXPERTS = {
    "qwen-l0-e0": {r: f"model.layers.0.mlp.experts.0.{r}_proj" for r in ("gate", "up", "down")},
    "qwen-l1-e3": {r: f"model.layers.1.mlp.experts.3.{r}_proj" for r in ("gate", "up", "down")},
    "mixtral-l0-e1": {r: f"model.layers.0.block_sparse_moe.experts.1.{w}" for r, w in
                      (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
}
SINGLES = ["model.layers.0.mlp.experts.0.down_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate",
           "model.layers.0.mlp.shared_expert.up_proj", "lm_head"]


def w4(group_size=128, symmetric=True, **kw) -> dict:
    return {"num_bits": 4, "type": "int", "symmetric": symmetric, "group_size": group_size, "strategy": "group",
            "dynamic": False, "actorder": None, **kw}


def config(*groups: dict, **top) -> dict:
    """A W4A16 quantization_config; ``groups`` replace its one group (named group_0, group_1, ...)."""
    groups = groups or ({"targets": ["Linear"], "weights": w4()},)
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {f"group_{i}": g for i, g in enumerate(groups)},
            "ignore": ["lm_head", "re:.*mlp.gate$"], **top}


CT_DUMP = {  # a group as compressed-tensors 0.20 writes it, every field present
    "targets": ["Linear"], "format": "pack-quantized", "input_activations": None, "output_activations": None,
    "weights": {"num_bits": 4, "type": "int", "symmetric": False, "group_size": 32, "strategy": "group",
                "block_structure": None, "dynamic": False, "actorder": "static", "scale_dtype": None,
                "zp_dtype": "torch.int8", "observer": "memoryless_minmax", "observer_kwargs": {}}}
FP8_DYNAMIC = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}

ACCEPTED = {
    "w4a16 g128 sym": config(),
    "asym g32": config({"targets": ["Linear"], "weights": w4(32, False)}),
    "channel, group_size null": config({"targets": ["Linear"], "weights": w4(None, strategy="channel")}),
    "channel inferred from -1": config({"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": -1}}),
    "group inferred from 64": config({"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 64}}),
    "channel, group_size 0": config({"targets": ["Linear"], "weights": w4(0, strategy="channel")}),
    "int8 sym channel": config({"targets": ["Linear"], "weights": w4(None, num_bits=8, strategy="channel")}),
    "int8 asym g128": config({"targets": ["Linear"], "weights": w4(128, False, num_bits=8)}),
    "int3": config({"targets": ["Linear"], "weights": w4(num_bits=3)}),
    "enums in odd case": config({"targets": ["Linear"], "weights": w4(type="INT", strategy="Group")}),
    "dynamic local attention group": config(
        {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 4, "type": "float", "group_size": 16,
                                                       "strategy": "tensor_group", "dynamic": "LOCAL"}},
        {"targets": ["re:.*experts.*"], "weights": w4()}),
    "every field, as written": config(CT_DUMP, kv_cache_scheme=None, global_compression_ratio=None, version="0.20.1",
                                      sparsity_config=None, transform_config=None),
    "actorder weight": config({"targets": ["Linear"], "weights": w4(actorder="weight")}),
    "regex target": config({"targets": ["re:.*mlp\\.experts\\..*"], "weights": w4()}),
    "exact names": config({"targets": list(EXPERTS["qwen-l0-e0"].values()), "weights": w4(64)}),
    "regex ignore of a layer": config(ignore=["lm_head", "re:model\\.layers\\.1\\..*"]),
    "ignore one down_proj by name": config(ignore=["model.layers.0.mlp.experts.0.down_proj"]),
    "ignore Linear": config(ignore=["Linear"]),
    "ignore null": config(ignore=None),
    "name beats class across groups": config({"targets": ["Linear"], "weights": w4(None, num_bits=8,
                                                                                  strategy="channel")},
                                             {"targets": ["re:.*experts.*"], "weights": w4(32)}),
    "down_proj in its own group": config({"targets": ["Linear"], "weights": w4()},
                                         {"targets": ["re:.*down_proj$"], "weights": w4(32)}),
    "identical groups split by name": config({"targets": ["re:.*gate_proj$", "re:.*w1$"], "weights": w4()},
                                             {"targets": ["re:.*(up|down)_proj$", "re:.*w[23]$"], "weights": w4()}),
    "same target twice: the later group": config({"targets": ["re:.*experts.*"], "weights": w4(32)},
                                                 {"targets": ["re:.*experts.*"], "weights": w4(64)}),
    "empty targets": config({"targets": [], "weights": w4(32)}, {"targets": ["Linear"], "weights": w4()}),
    "fp8 attention, w4a16 experts": config(
        {"targets": ["re:.*self_attn.*"], "weights": FP8_WEIGHTS, "input_activations": FP8_DYNAMIC,
         "format": "float-quantized"},
        {"targets": ["re:.*experts.*"], "weights": w4(), "format": "pack-quantized"},
        format="mixed-precision", kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}),
    "group format over a global one": config({"targets": ["Linear"], "weights": w4(), "format": "pack-quantized"},
                                             format="int-quantized"),
    # resolved by compressed-tensors, then refused as a WNA16 MoE scheme
    "group format int-quantized": config({"targets": ["Linear"], "weights": w4(), "format": "int-quantized"}),
    "global format left out": {k: v for k, v in config().items() if k != "format"},
    "float weights": config({"targets": ["Linear"], "weights": FP8_WEIGHTS}),
    "input activations": config({"targets": ["Linear"], "weights": w4(None, num_bits=8, strategy="channel"),
                                 "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": True}}),
    "strategy tensor": config({"targets": ["Linear"], "weights": {"num_bits": 4}}),
    "dynamic weights": config({"targets": ["Linear"], "weights": w4(dynamic=True)}),
    "no weights": config({"targets": ["Linear"]}),
    "1 bit": config({"targets": ["Linear"], "weights": w4(num_bits=1)}),
    "status frozen": config(quantization_status="frozen"),
}


def _oracle_outcome(raw: dict, names: dict[str, str]):
    """What compressed-tensors makes of ``names`` (one expert's projections): the WNA16 scheme, None
    (unquantized), or REFUSED when the projections differ or the resolved scheme is no WNA16 one."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match, match_targets

    cfg = QuantizationConfig.model_validate(copy.deepcopy(raw))
    if cfg.quantization_status != "compressed":
        return REFUSED
    target_to_scheme = OrderedDict((t, s) for s in cfg.config_groups.values() for t in s.targets)
    linear = torch.nn.Linear(1, 1)

    def resolve(name):  # apply_quantization_config's choice
        if is_match(name, linear, cfg.ignore or []):
            return None
        matched = match_targets(name, linear, target_to_scheme)
        return target_to_scheme[matched[0]] if matched else None

    def key(s):
        return None if s is None else (s.weights, s.input_activations, s.format or cfg.format)

    schemes = [resolve(n) for n in names.values()]
    if any(key(s) != key(schemes[0]) for s in schemes):
        return REFUSED
    s = schemes[0]
    if s is None:
        return None
    w = s.weights
    if (w is None or (s.format or cfg.format) != "pack-quantized" or w.type != "int" or not 2 <= w.num_bits <= 8
            or w.dynamic is not False or s.input_activations is not None or w.strategy not in ("group", "channel")):
        return REFUSED
    return WNA16Scheme(w.num_bits, w.group_size if w.strategy == "group" else -1, w.symmetric, "bfloat16")


def _outcome(raw: dict, names: dict[str, str]):
    try:
        return CompressedTensorsConfig(copy.deepcopy(raw), "config.json").scheme_for(names, "bfloat16")
    except MoeConvertError:
        return REFUSED


def _cases():
    named = dict(EXPERTS) | {name: {"w": name} for name in SINGLES}
    return [(c, n, names) for c in ACCEPTED for n, names in named.items()]


@pytest.mark.parametrize("case, names", [pytest.param(c, names, id=f"{c}/{n}") for c, n, names in _cases()])
def test_resolves_as_compressed_tensors_does(case, names):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is the oracle")
    raw = ACCEPTED[case]
    assert _outcome(raw, names) == _oracle_outcome(raw, names)


def test_the_oracle_cases_resolve_to_several_schemes():
    """The table above is no vacuous pass: it reaches schemes, unquantized names and refusals alike."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is the oracle")
    outcomes = {repr(_oracle_outcome(ACCEPTED[c], names)) for c, _, names in _cases()}
    assert {"None", repr(REFUSED)} < outcomes and len(outcomes) >= 8


def test_name_match_beats_an_earlier_class_match():
    """group_0 targets "Linear", group_1 the experts by name: experts take group_1 (vLLM and
    compressed-tensors both try names before class names), everything else group_0."""
    cfg = CompressedTensorsConfig(ACCEPTED["name beats class across groups"], "config.json")
    assert cfg.scheme_for(EXPERTS["qwen-l0-e0"], "bfloat16") == WNA16Scheme(4, 32, True, "bfloat16")
    assert cfg.scheme_for({"w": "model.layers.0.self_attn.q_proj"}, "bfloat16") == WNA16Scheme(8, -1, True, "bfloat16")


def test_vllm_and_compressed_tensors_orders_disagreeing_is_refused():
    """Both regexes match; vLLM takes the first in config order (group_0), compressed-tensors the first
    sorted (``re:.*experts`` of group_1 < ``re:model``): the weights were written one way, read the other."""
    raw = config({"targets": ["re:model.*experts.*"], "weights": w4(32)},
                 {"targets": ["re:.*experts.*"], "weights": w4(64)})
    with pytest.raises(MoeConvertError) as e:
        CompressedTensorsConfig(raw, "config.json").scheme_for(EXPERTS["qwen-l0-e0"], "bfloat16")
    assert "'re:model.*experts.*' (config group 'group_0')" in e.value.line()
    assert "'re:.*experts.*' (config group 'group_1')" in e.value.line()


# ---------------------------------------------------------------------------------------------------
# refusals: (edit of the W4A16 config, the key the line names, does compressed-tensors refuse it too?)


def _group0(c: dict) -> dict:
    return c["config_groups"]["group_0"]


def _weights(c: dict) -> dict:
    return _group0(c)["weights"]


G0 = "quantization_config.config_groups.group_0"
W0 = f"{G0}.weights"

REFUSALS = {
    "config_groups missing": (lambda c: c.pop("config_groups"), "quantization_config.config_groups", True),
    "config_groups a list": (lambda c: c.update(config_groups=[]), "quantization_config.config_groups", True),
    "preset shorthand": (lambda c: c.update(config_groups={"W4A16": ["Linear"]}),
                         "quantization_config.config_groups.W4A16", False),  # vLLM cannot parse it
    "group a number": (lambda c: c["config_groups"].update(group_0=3), G0, True),
    "targets missing": (lambda c: _group0(c).pop("targets"), f"{G0}.targets", True),
    "targets a string": (lambda c: _group0(c).update(targets="Linear"), f"{G0}.targets", True),
    "target a number": (lambda c: _group0(c).update(targets=["Linear", 1]), f"{G0}.targets[1]", True),
    "unknown group key": (lambda c: _group0(c).update(weight={}), f"{G0}.weight", True),
    "weights a list": (lambda c: _group0(c).update(weights=[4]), W0, True),
    "unknown weights key": (lambda c: _weights(c).update(bits=4), f"{W0}.bits", True),
    "num_bits null": (lambda c: _weights(c).update(num_bits=None), f"{W0}.num_bits", True),
    "num_bits 4.5": (lambda c: _weights(c).update(num_bits=4.5), f"{W0}.num_bits", True),
    "num_bits a string": (lambda c: _weights(c).update(num_bits="4"), f"{W0}.num_bits", False),  # pydantic coerces
    "symmetric yes": (lambda c: _weights(c).update(symmetric="yes"), f"{W0}.symmetric", False),  # pydantic coerces
    "type uint": (lambda c: _weights(c).update(type="uint"), f"{W0}.type", True),
    "strategy rows": (lambda c: _weights(c).update(strategy="rows"), f"{W0}.strategy", True),
    "group_size -2": (lambda c: _weights(c).update(group_size=-2), f"{W0}.group_size", True),
    "group_size 0": (lambda c: _weights(c).update(group_size=0), f"{W0}.group_size", True),
    "group without group_size": (lambda c: _weights(c).pop("group_size"), f"{W0}.group_size", True),
    "channel with group_size": (lambda c: _weights(c).update(strategy="channel"), f"{W0}.group_size", True),
    "block_structure without block": (lambda c: _weights(c).update(block_structure=[128, 128]),
                                      f"{W0}.block_structure", True),
    "dynamic 'true'": (lambda c: _weights(c).update(dynamic="true"), f"{W0}.dynamic", True),
    "actorder group": (lambda c: _weights(c).update(actorder="group"), f"{W0}.actorder", True),
    "actorder dynamic": (lambda c: _weights(c).update(actorder="Dynamic"), f"{W0}.actorder", True),
    "actorder true": (lambda c: _weights(c).update(actorder=True), f"{W0}.actorder", True),
    "actorder WEIGHT": (lambda c: _weights(c).update(actorder="WEIGHT"), f"{W0}.actorder", True),
    "zp_dtype not a dtype": (lambda c: _weights(c).update(zp_dtype="torch.int3x"), f"{W0}.zp_dtype", True),
    "observer_kwargs null": (lambda c: _weights(c).update(observer_kwargs=None), f"{W0}.observer_kwargs", True),
    "group format in capitals": (lambda c: _group0(c).update(format="Pack-Quantized"), f"{G0}.format", True),
    "group format mixed-precision": (lambda c: _group0(c).update(format="mixed-precision"), f"{G0}.format", True),
    "input activations by channel": (lambda c: _group0(c).update(input_activations={"strategy": "channel"}),
                                     f"{G0}.input_activations.strategy", True),
    "format null": (lambda c: c.update(format=None), "quantization_config.format", True),
    "status in capitals": (lambda c: c.update(quantization_status="COMPRESSED"),
                           "quantization_config.quantization_status", True),
    "status null": (lambda c: c.update(quantization_status=None), "quantization_config.quantization_status", True),
    "ignore a string": (lambda c: c.update(ignore="lm_head"), "quantization_config.ignore", True),
    "ignore a number": (lambda c: c.update(ignore=["lm_head", 7]), "quantization_config.ignore[1]", True),
    "ignore a broken regex": (lambda c: c.update(ignore=["re:(experts"]), "quantization_config.ignore[0]",
                              False),  # compressed-tensors fails only when it first matches
    "kv_cache_scheme num_bits": (lambda c: c.update(kv_cache_scheme={"num_bits": "x"}),
                                 "quantization_config.kv_cache_scheme.num_bits", True),
    "global_compression_ratio": (lambda c: c.update(global_compression_ratio="x"),
                                 "quantization_config.global_compression_ratio", True),
    "moe_sparsity_config method": (lambda c: c.update(moe_sparsity_config={"method": "x", "num_experts": []}),
                                   "quantization_config.moe_sparsity_config.method", True),
    # valid compressed-tensors, refused as a WNA16 MoE scheme when the experts resolve to it
    "status frozen": (lambda c: c.update(quantization_status="frozen"), "quantization_config.quantization_status",
                      False),
    "int-quantized": (lambda c: c.update(format="int-quantized"), "quantization_config.format", False),
    "float weights": (lambda c: _weights(c).update(type="float", num_bits=8), f"{W0}.type", False),
    "9 bits": (lambda c: _weights(c).update(num_bits=9), f"{W0}.num_bits", False),
    "dynamic weights": (lambda c: _weights(c).update(dynamic=True), f"{W0}.dynamic", False),
    "strategy tensor": (lambda c: _weights(c).update(strategy="tensor", group_size=None), f"{W0}.strategy", False),
    "input activations": (lambda c: _group0(c).update(input_activations={"num_bits": 8, "strategy": "token",
                                                                          "dynamic": True}),
                          f"{G0}.input_activations", False),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_on_one_line_naming_the_key(case):
    edit, key, ct_refuses = REFUSALS[case]
    raw = config()
    edit(raw)
    with pytest.raises(MoeConvertError) as e:
        CompressedTensorsConfig(copy.deepcopy(raw), "config.json").scheme_for(EXPERTS["qwen-l0-e0"], "bfloat16")
    line = e.value.line()
    assert "\n" not in line and line.startswith("config.json"), line
    assert f"{key}:" in line, line
    ct = pytest.importorskip("compressed_tensors.quantization", reason="compressed-tensors is the oracle")
    if ct_refuses:  # never more lenient than the oracle
        with pytest.raises(Exception):
            ct.QuantizationConfig.model_validate(copy.deepcopy(raw))
    else:  # stricter on purpose, or refused later as no WNA16 MoE scheme
        ct.QuantizationConfig.model_validate(copy.deepcopy(raw))


# ---------------------------------------------------------------------------------------------------
# start-up


def test_parsing_a_checkpoint_imports_no_pydantic(example_ckpt):
    src = example_ckpt("qwen3-moe", "w4a16")
    code = """
import json, sys
import moeconvert.convert, moeconvert.modelmap, moeconvert.schemes, moeconvert.sources
model = moeconvert.modelmap.map_model(moeconvert.sources.open_source(sys.argv[1]))
assert {type(layer.scheme).__name__ for layer in model.layers} == {"WNA16Scheme"}, model.layers[0].scheme
print(json.dumps([m for m in ("compressed_tensors", "transformers", "pydantic") if m in sys.modules]))
"""
    r = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []
