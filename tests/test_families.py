"""The declared family table (moeconvert/format/families.py), checked against transformers' and vLLM's own
code, and the new expert storages end to end against transformers' own MoE blocks.

* every family's transformers classes exist, its vLLM classes are in vLLM's registry, and each declared
  config key accepts null exactly where transformers' config annotation does;
* every declared key: a null where transformers refuses one, or a value of the wrong type, is refused on
  one line naming the key (never read as the default);
* one fixture per new storage (fused ``[E, 2I, H]``, transposed ``[E, H, 2I]`` with the router weight on
  the input, a new per-expert naming): inspect, repack plain, quantize mxfp4 for marlin, verify, and the
  runtime's whole MoE block on CPU equal to transformers' block on the same input.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import (cli, make_bailing_checkpoint, make_family_checkpoint, make_int_checkpoint, make_step3p5_checkpoint,
                     rtn_dequantized, split_fused_experts, split_step3p5_experts, wrap_text_model)
from moeconvert.errors import MoeConvertError
from moeconvert.format.families import FAMILIES, REQUIRED, Key, read_keys

transformers = pytest.importorskip("transformers")

SERVED = [f for f in FAMILIES if not f.refused]


def _annotations(cls) -> dict:
    ann: dict = {}
    for c in reversed(cls.__mro__):
        ann.update(getattr(c, "__annotations__", {}))
    return ann


@pytest.mark.parametrize("fam", [f for f in FAMILIES if f.hf_classes], ids=lambda f: f.name)
def test_table_facts_match_transformers(fam):
    import importlib

    config_cls = getattr(transformers, fam.hf_classes[0])
    modeling = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
    missing = [n for n in fam.hf_classes[1:] if not hasattr(modeling, n)]
    assert not missing, f"{fam.name}: transformers {transformers.__version__}'s {modeling.__name__} has no {missing}"
    ann = _annotations(config_cls)
    wrong = [k.name for k in fam.keys if k.name in ann and ("None" in str(ann[k.name])) != k.nullable]
    assert not wrong, f"{fam.name}: nullability disagrees with {fam.hf_classes[0]} for {wrong}"
    # a key transformers writes under another name (attribute_map) is read under that name too
    renamed = {k.name: config_cls.attribute_map[k.name] for k in fam.keys if k.name in config_cls.attribute_map}
    assert all(v in fam.key(k).aliases for k, v in renamed.items()), f"{fam.name}: {renamed} not declared as aliases"


#: config values that make each layer rule say something (6 layers), and what some configs need to build
_RULE_CONFIG = {"sparse-step": dict(decoder_sparse_step=2, mlp_only_layers=[3]), "first-k-dense": dict(first_k_dense_replace=1),
                "mlp-layer-types": dict(first_k_dense_replace=2), "interleave": dict(interleave_moe_layer_step=2),
                "range": dict(moe_layer_start_index=1, moe_layer_end_index=4, moe_layer_interval=2), "all": {},
                # Step-3.5's published form; transformers turns it into mlp_layer_types, read here from the enum
                "listed": dict(moe_layers_enum="1,3,4")}
#: model_type -> the transformers model class whose layers are checked, where AutoModelForCausalLM has none
_MODEL_CLASS = {"step3p5": "Step3p7TextModel"}
_BUILDS_WITH = {"dots1": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),
                "hunyuan-v1-moe": dict(head_dim=128, num_experts=8, moe_topk=2)}


@pytest.mark.parametrize("fam", [f for f in SERVED if f.hf_classes], ids=lambda f: f.name)
def test_moe_layer_rule_is_transformers(fam):
    # the layers transformers' own decoder builds with routed experts (on the meta device: no weights)
    from moeconvert.modelmap import sparse_layers

    mt = fam.model_types[0]
    cfg = transformers.AutoConfig.for_model(mt, num_hidden_layers=6, **_RULE_CONFIG[fam.moe_layers],
                                            **_BUILDS_WITH.get(fam.name, {}))
    with torch.device("meta"):
        model = (getattr(transformers, _MODEL_CLASS[mt])(cfg) if mt in _MODEL_CLASS
                 else transformers.AutoModelForCausalLM.from_config(cfg).model)
    theirs = [i for i, layer in enumerate(model.layers)
              if any(hasattr(getattr(layer, b, None), "experts") for b in ("mlp", "block_sparse_moe", "feed_forward"))]
    ours = {**cfg.to_dict(), **_RULE_CONFIG[fam.moe_layers]}
    if "moe_layers_enum" in ours:  # ours from the enum, transformers' from its own reading of it
        ours.pop("mlp_layer_types")
    assert list(sparse_layers(fam, read_keys(ours, fam))) == theirs and theirs


_WRONG = {"int>=1": "8", "int>=0": 1.5, "int": "x", "number": "7", "number>0": -1.0, "bool": "yes", "str": 3,
          "list[int>=0]": [-1], "list[str]": [1], "list[number|null]": [None, "7"]}
_KEYS = [(f, k) for f in SERVED for k in f.keys]


@pytest.mark.parametrize("fam,key", _KEYS, ids=[f"{f.name}.{k.name}" for f, k in _KEYS])
def test_every_declared_key_is_read_with_its_type(fam, key: Key):
    good = {k.name: _good(k) for k in fam.keys}
    assert read_keys(good, fam) == good
    with pytest.raises(MoeConvertError, match=f"config.json: {key.name}") as e:
        read_keys({**good, key.name: _WRONG[key.kind]}, fam)
    assert "\n" not in str(e.value)
    if key.nullable and key.default is not REQUIRED:
        assert read_keys({**good, key.name: None}, fam)[key.name] == key.default
    else:  # transformers refuses a null here: it is never read as the default (gpt-oss swiglu_limit was 7.0)
        with pytest.raises(MoeConvertError, match=f"config.json: {key.name}: must not be null"):
            read_keys({**good, key.name: None}, fam)


def _good(k: Key):
    return {"int>=1": 2, "int>=0": 0, "int": -1, "number": 1.5, "number>0": 1.5, "bool": True, "str": "greedy",
            "list[int>=0]": [], "list[str]": ["sparse"], "list[number|null]": [None, 0, 7.0]}[k.kind]


# -- end to end: one fixture per new storage --------------------------------------------------------

CASES = {  # id -> (model_type, save the model's fused tensors as it holds them, MoE block module path)
    "qwen3.5-fused": ("qwen3_5_moe_text", True, "mlp"),
    "llama4-transposed": ("llama4_text", False, "feed_forward"),
    "minimax-m2": ("minimax_m2", False, "mlp"),  # block_sparse_moe on disk, mlp in memory
    "glm-moe-dsa": ("glm_moe_dsa", False, "mlp"),  # DeepSeek-style grouped routing under a new type
    "qwen3-next": ("qwen3_next", False, "mlp"),  # a shared expert with its sigmoid gate
    "mimo-v2": ("mimo_v2_flash", False, "mlp"),  # grouped sigmoid routing; vLLM's per-layer moe_layer_freq
    "glm4-moe-lite": ("glm4_moe_lite", False, "mlp"),  # DeepSeek-style routing, a dense first layer
    "dots1": ("dots1", False, "mlp"),  # DeepSeek-V3's routing and shared expert under dots1's keys
}


@pytest.fixture(scope="session")
def family_ckpts(tmp_path_factory):
    cache: dict = {}

    def make(case: str) -> tuple[Path, torch.nn.Module]:
        if case not in cache:
            mt, fused, _ = CASES[case]
            path = make_family_checkpoint(tmp_path_factory.mktemp(case) / "ckpt", mt, fused=fused)
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            cache[case] = (path, model)
        return cache[case]

    return make


def _through_the_cli(src: Path, tmp_path: Path, check_layers=None):
    """inspect, repack plain, quantize mxfp4 (marlin), verify both (``check_layers``, given each folder's
    manifest ``moe_layers``, asserts on them): (inspect's report, the plain folder loaded by
    ``moeconvert.runtime`` on the CPU)."""
    from moeconvert.runtime import load

    report = json.loads(cli("inspect", str(src), "--json", expect=0).out)
    plain, mx = tmp_path / "plain", tmp_path / "mx"
    cli("repack", str(src), str(plain), "--backend", "plain", expect=0)
    cli("quantize", str(src), str(mx), "--format", "mxfp4", "--backend", "marlin", expect=0)
    for out in (plain, mx):
        cli("verify", str(out), "--against", str(src), expect=0)
        if check_layers is not None:
            check_layers(json.loads((out / "moeconvert.json").read_text())["moe_layers"])
    m = load(plain, device="cpu")
    assert m.moe_layers, "no MoE layer loaded"
    return report, m


@pytest.mark.parametrize("case", list(CASES))
def test_family_through_every_path(case, family_ckpts, tmp_path):
    src, model = family_ckpts(case)
    mt, fused, block = CASES[case]
    report, m = _through_the_cli(src, tmp_path)
    assert report["family"] in {f.name for f in FAMILIES if mt in f.model_types}
    torch.manual_seed(1)
    for prefix, layer in m.moe_layers.items():
        i = layer.entry.raw["layer"]
        ours = layer.block(x := torch.randn(5, layer.hidden_size, dtype=torch.bfloat16))
        mod = getattr(model.model.layers[i], block)
        theirs = mod(x.float().unsqueeze(0))
        theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).reshape(ours.shape)
        err = (ours.float() - theirs).abs().max() / theirs.abs().max()
        assert err < 0.03, f"{prefix}: runtime block differs from transformers' by {err:.3g}"


#: families whose router moeconvert.runtime leaves to the caller (the table's ``caller routes``): id -> model_type
CALLER_ROUTES = {"ernie4.5-moe": "ernie4_5_moe", "hunyuan-v1-moe": "hunyuan_v1_moe"}


@pytest.mark.parametrize("case", list(CALLER_ROUTES))
def test_caller_routed_family_through_every_path(case, tmp_path):
    """inspect, repack, quantize mxfp4, verify; then each MoE layer's routed experts against transformers' own
    experts module on the routing transformers' own router chose for the same tokens (caught with a forward
    hook on that module), since the runtime leaves these families' routers to the caller."""
    src = make_family_checkpoint(tmp_path / "ckpt", CALLER_ROUTES[case])
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    report, m = _through_the_cli(src, tmp_path)
    assert report["family"] == case
    torch.manual_seed(1)
    for prefix, layer in m.moe_layers.items():
        block = model.model.layers[layer.entry.raw["layer"]].mlp
        seen = {}
        hook = block.experts.register_forward_hook(
            lambda mod, args, kwargs, out: seen.update(args=[*args, *kwargs.values()], out=out), with_kwargs=True)
        block(torch.randn(1, 5, layer.hidden_size))
        hook.remove()
        x, ids, weights = seen["args"][:3]  # transformers' experts(hidden_states, top_k_index, top_k_weights)
        assert ids.dtype in (torch.int32, torch.int64) and weights.is_floating_point()
        ours = layer(x.to(torch.bfloat16), weights.float(), ids)
        theirs = seen["out"].reshape(ours.shape)
        err = (ours.float() - theirs).abs().max() / theirs.abs().max()
        assert err < 0.03, f"{prefix}: runtime experts differ from transformers' by {err:.3g}"


# -- quantized Qwen3.5-MoE: as GPTQModel publishes it (Qwen/Qwen3.5-397B-A17B-GPTQ-Int4, -35B-A3B-GPTQ-Int4) --
# GPTQModel quantizes each expert as its own module (its qwen3_5_moe definition lists mlp.experts.{i}.gate_proj
# ...), so the experts are stored per expert, under the multimodal wrapper's model.language_model. prefix:
# model.language_model.layers.L.mlp.experts.E.gate_proj.{qweight,qzeros,scales,g_idx}. vLLM's Qwen3.5-MoE
# (vllm/model_executor/models/qwen3_5.py) loads that prefix through its wrapper, and its RoutedExperts loader
# takes per-expert 2-D tensors and fused 3-D ones alike.


#: id -> (model_type, the tiny config's overrides (H 128, I 64: the smallest sizes Marlin takes), experts held
#: transposed (x @ W), the MoE block's module, the multimodal wrapper and its architecture or None)
GPTQ_CASES = {
    "qwen3.5-moe": ("qwen3_5_moe_text", dict(hidden_size=128, moe_intermediate_size=64), False, "mlp",
                    ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")),
    # llm-compressor's Llama 4 form: one MLP per expert (its calibration module unfuses Llama4TextExperts)
    "llama4": ("llama4_text", dict(hidden_size=128, intermediate_size=64), True, "feed_forward", None),
}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_quantized_fused_family_per_expert_through_every_path(case, tmp_path):
    from moeconvert.runtime import load

    mt, config, transposed, block, wrapper = GPTQ_CASES[case]
    bf16 = make_family_checkpoint(tmp_path / "bf16", mt, fused=transposed, **config)
    per_expert = split_fused_experts(bf16, tmp_path / "split", transposed) if transposed else bf16
    src = make_int_checkpoint(per_expert, tmp_path / "gptq", "gptq", bits=4, group_size=32)
    if wrapper:
        src = wrap_text_model(src, tmp_path / "wrapped", *wrapper)
    report = json.loads(cli("inspect", str(src), "--json", expect=0).out)
    text = "model.language_model." if wrapper else "model."
    assert report["family"] == case
    assert [x["format"] for x in report["moe_layers"]] == ["gptq"] * len(report["moe_layers"])
    assert all(x["prefix"].startswith(text + "layers.") and x["prefix"].endswith(f".{block}.experts")
               for x in report["moe_layers"]), report["moe_layers"]
    out = tmp_path / "marlin"
    cli("repack", str(src), str(out), "--backend", "marlin", expect=0)
    cli("verify", str(out), "--against", str(src), expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())["moe_layers"]
    assert [x.get("apply_router_weight_on_input", False) for x in manifest] == [case == "llama4"] * len(manifest)
    # transformers' own MoE block holding the weights the GPTQ codes stand for
    model = transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            ex = getattr(getattr(layer, block), "experts", None)
            if ex is None:
                continue
            I = ex.gate_up_proj.shape[2 if transposed else 1] // 2
            for e in range(ex.gate_up_proj.shape[0]):
                gu = ex.gate_up_proj[e].T if transposed else ex.gate_up_proj[e]  # [2I, H] views
                dn = ex.down_proj[e].T if transposed else ex.down_proj[e]  # [H, I]
                for w in (gu[:I], gu[I:], dn):
                    w.copy_(rtn_dequantized(w, 4, 32, sym=True))
    m = load(out, device="cpu")
    assert len(m.moe_layers) == len(manifest)
    torch.manual_seed(1)
    for prefix, layer in m.moe_layers.items():
        ours = layer.block(x := torch.randn(5, layer.hidden_size, dtype=torch.bfloat16))
        theirs = getattr(model.model.layers[layer.entry.raw["layer"]], block)(x.float().unsqueeze(0))
        theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).reshape(ours.shape)
        err = (ours.float() - theirs).abs().max() / theirs.abs().max()
        assert err < 0.03, f"{prefix}: runtime block differs from transformers' by {err:.3g}"


_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True, "checkpoint_format": "gptq"}


@pytest.mark.parametrize("case", ["qwen3.5-fused", "llama4-transposed"])
@pytest.mark.parametrize("form", ["float", "qweight"])
def test_quantized_fused_experts_refused_naming_the_tensor(case, form, family_ckpts, tmp_path):
    # no quantizer we know of writes fused 3-D quantized experts (GPTQModel, AutoRound and llm-compressor
    # quantize one module per expert): a GPTQ config over fused tensors, or a fused tensor with a quantized
    # suffix, is refused on one line naming the tensor
    from safetensors.torch import load_file, save_file

    src, _ = family_ckpts(case)
    bad = _copy(src, tmp_path / "bad", quantization_config=_GPTQ)
    f = next(bad.glob("*.safetensors"))
    if form == "qweight":
        tensors = load_file(f)
        for k in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            E, N, K = tensors.pop(k).shape
            tensors[k + ".qweight"] = torch.zeros(E, K // 8, N, dtype=torch.int32)
        save_file(tensors, str(f), metadata={"format": "pt"})
        (bad / "model.safetensors.index.json").unlink(missing_ok=True)
    r = cli("repack", str(bad), str(tmp_path / "out"), "--backend", "marlin", expect=2)
    layer = {"qwen3.5-fused": 0, "llama4-transposed": 1}[case]  # the first MoE layer
    tensor = f"layers.{layer}.{CASES[case][2]}.experts." + ("down_proj.qweight" if form == "qweight" else "gate_up_proj:")
    assert tensor in r.err and "stored fused (3-D) are not read" in r.err, r.err
    assert r.err.strip().count("\n") == 0 and not (tmp_path / "out").exists(), r.err


def test_bailing_moe_through_every_path(tmp_path):
    # Ling 2.0: no transformers class; its config fields and tensor names are those vLLM 0.33.0's
    # vllm/model_executor/models/bailing_moe.py reads (helpers.make_bailing_checkpoint). The caller routes: each
    # layer's experts run on given ids and weights, against SwiGLU experts written out here from the source
    from safetensors.torch import load_file

    from moeconvert.runtime import load

    src = make_bailing_checkpoint(tmp_path / "src")
    report = json.loads(cli("inspect", str(src), "--json", expect=0).out)
    assert report["family"] == "bailing-moe"
    assert [x["prefix"] for x in report["moe_layers"]] == ["model.layers.1.mlp.experts"]
    plain, mx = tmp_path / "plain", tmp_path / "mx"
    cli("repack", str(src), str(plain), "--backend", "plain", expect=0)
    cli("quantize", str(src), str(mx), "--format", "mxfp4", "--backend", "marlin", expect=0)
    for out in (plain, mx):
        cli("verify", str(out), "--against", str(src), expect=0)
    layer = load(plain, device="cpu").moe_layers["model.layers.1.mlp.experts"]
    t = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    torch.manual_seed(1)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(5)]).to(torch.int32)
    weights = torch.rand(5, 2)
    want = torch.zeros(5, 64)
    for m in range(5):
        for j in range(2):
            e = f"model.layers.1.mlp.experts.{int(ids[m, j])}"
            h = torch.nn.functional.silu(x[m].float() @ t[f"{e}.gate_proj.weight"].T) * (x[m].float() @ t[f"{e}.up_proj.weight"].T)
            want[m] += weights[m, j] * (h @ t[f"{e}.down_proj.weight"].T)
    got = layer(x, weights, ids).float()
    assert (got - want).abs().max() / want.abs().max() < 0.03
    manifest = json.loads((plain / "moeconvert.json").read_text())["moe_layers"][0]
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias"} <= set(manifest["router"])


@pytest.mark.parametrize("case", ["llama4-transposed"])
def test_router_weight_on_input_is_declared(case, family_ckpts, tmp_path):
    src, _ = family_ckpts(case)
    cli("repack", str(src), str(tmp_path / "o"), "--backend", "plain", expect=0)
    layers = json.loads((tmp_path / "o" / "moeconvert.json").read_text())["moe_layers"]
    assert [x["apply_router_weight_on_input"] for x in layers] == [True] * len(layers)


# -- bad input: known model_type, contradictory MoE fields --------------------------------------------


def _copy(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case,edit,needle", [
    ("qwen3.5-fused", {"num_experts": 4}, "config.json num_experts = 4"),
    ("qwen3.5-fused", {"moe_intermediate_size": 8}, "config.json moe_intermediate_size = 8"),
    ("llama4-transposed", {"num_local_experts": 16}, "config.json num_local_experts = 16"),
    ("llama4-transposed", {"interleave_moe_layer_step": 1, "moe_layers": None}, "layer 0 has routed experts"),
    ("llama4-transposed", {"moe_layers": [0]}, "moe_layers"),
    ("mimo-v2", {"moe_layer_freq": [1, 1]}, "config.json: moe_layer_freq: moe_layer_freq disagrees with mlp_layer_types"),
])
def test_contradictory_config_refused_on_one_line(case, edit, needle, family_ckpts, tmp_path):
    src, _ = family_ckpts(case)
    bad = _copy(src, tmp_path / "bad", **edit)
    r = cli("repack", str(bad), str(tmp_path / "out"), "--backend", "plain", expect=2)
    assert needle in r.err and r.err.strip().count("\n") == 0, r.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("wrapper,text_type,needle", [
    ("llama4", "qwen3_moe", "text_config of the wrong type for llama4"),
    ("kimi_k25", "llama4_text", "text_config of the wrong type for kimi_k25"),
    ("qwen3_5_moe", None, "text_config"),
])
def test_wrapper_with_wrong_text_config_refused(wrapper, text_type, needle, family_ckpts, tmp_path):
    src, _ = family_ckpts("llama4-transposed")
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = text_type
    cfg = {"model_type": wrapper, "text_config": text if text_type else None}
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    r = cli("inspect", str(bad), expect=2)
    assert needle in r.err and r.err.strip().count("\n") == 0, r.err


def test_refused_family_says_why_in_one_line(family_ckpts, tmp_path, monkeypatch):
    # no family of the table is refused today; one whose facts did not fit would be, with its one line
    import dataclasses

    import moeconvert.format.config as config

    table = [dataclasses.replace(f, refused="its experts are stored in a way the table does not have")
             if f.name == "minimax-m2" else f for f in config.FAMILIES]
    monkeypatch.setattr(config, "FAMILIES", tuple(table))
    src, _ = family_ckpts("minimax-m2")
    r = cli("inspect", str(src), expect=2)
    assert "minimax-m2 is not supported: its experts are stored in a way" in r.err, r.err
    assert r.err.strip().count("\n") == 0, r.err


# -- Step-3.5: three 3-D expert tensors per layer, the SwiGLU clamped on the layers swiglu_limits names ------


@pytest.fixture(scope="module")
def step3p5(tmp_path_factory):
    return make_step3p5_checkpoint(tmp_path_factory.mktemp("step3p5") / "ckpt")


def _step3p5_experts(src: Path, layer: int) -> torch.nn.Module:
    """transformers' own Step3p7Experts of ``layer``, holding the checkpoint's experts as its conversion mapping
    loads them (conversion_mapping.py "step3p7": moe.gate_proj / moe.up_proj concatenated on dim 1)."""
    from safetensors.torch import load_file
    from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts

    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg._experts_implementation = "eager"
    t = load_file(src / "model.safetensors")
    p = f"model.layers.{layer}.moe"
    experts = Step3p7Experts(cfg, layer).float()
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.cat([t[f"{p}.gate_proj.weight"], t[f"{p}.up_proj.weight"]], 1))
        experts.down_proj.copy_(t[f"{p}.down_proj.weight"])
    return experts


def test_step3p5_through_every_path(step3p5, tmp_path):
    def check_layers(layers: list[dict]) -> None:
        assert [(x["activation"], x["activation_params"]) for x in layers] == [("silu", {}), ("swiglustep", {"limit": 7.0})]
        assert layers[1]["router"] == ["model.layers.2.moe.gate.weight", "model.layers.2.moe.router_bias"]
        assert layers[1]["shared_experts"] == [f"model.layers.2.share_expert.{p}_proj.weight" for p in ("down", "gate", "up")]

    report, m = _through_the_cli(step3p5, tmp_path, check_layers)
    assert report["family"] == "step3p5"
    assert [(x["prefix"], x["activation"]) for x in report["moe_layers"]] == [
        ("model.layers.1.moe.experts", "silu"), ("model.layers.2.moe.experts", "swiglustep")]
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(16, 64, generator=gen) * 40).to(torch.bfloat16)  # large enough that the clamp at 7 bites
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(16)])
    w = torch.rand(16, 2, generator=gen)
    for i, layer in ((1, m.moe_layers["model.layers.1.moe.experts"]), (2, m.moe_layers["model.layers.2.moe.experts"])):
        experts = _step3p5_experts(step3p5, i)
        theirs = experts(x.float(), ids, w)
        ours = layer(x, w, ids).float()
        assert (ours - theirs).abs().max() / theirs.abs().max() < 0.02, f"layer {i}"
        experts.limit = None  # the same experts unclamped: the clamp is what makes layer 2 agree
        unclamped = experts(x.float(), ids, w)
        assert ((unclamped - theirs).abs().max() / theirs.abs().max() > 0.1) == (i == 2), f"layer {i}"


def test_step3p5_gptq_per_expert_is_repacked_to_marlin(tmp_path):
    # quantized Step-3.5 experts are stored per expert (vLLM's loader reads moe.experts.E.*); GPTQ round-to-nearest
    # at H 128, I 64 (the smallest sizes Marlin takes), repacked for vLLM's Marlin, against transformers' experts
    # holding the weights the codes stand for, the clamp included on layer 2
    from moeconvert.runtime import load

    bf16 = make_step3p5_checkpoint(tmp_path / "bf16", H=128, I=64)
    src = make_int_checkpoint(split_step3p5_experts(bf16, tmp_path / "split"), tmp_path / "gptq", "gptq", bits=4,
                              group_size=32)
    out = tmp_path / "marlin"
    cli("repack", str(src), str(out), "--backend", "marlin", expect=0)
    cli("verify", str(out), "--against", str(src), expect=0)
    layers = json.loads((out / "moeconvert.json").read_text())["moe_layers"]
    assert [(x["prefix"], x["source_scheme"]["kind"], x["activation"]) for x in layers] == [
        ("model.layers.1.moe.experts", "wna16", "silu"), ("model.layers.2.moe.experts", "wna16", "swiglustep")]
    m = load(out, device="cpu")
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(16, 128, generator=gen) * 40).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(16)])
    w = torch.rand(16, 2, generator=gen)
    for i in (1, 2):
        experts = _step3p5_experts(bf16, i)
        with torch.no_grad():
            for e in range(8):
                gu, dn = experts.gate_up_proj[e], experts.down_proj[e]
                for t in (gu[:64], gu[64:], dn):
                    t.copy_(rtn_dequantized(t, 4, 32, sym=True))
        theirs = experts(x.float(), ids, w)
        ours = m.moe_layers[f"model.layers.{i}.moe.experts"](x, w, ids).float()
        assert (ours - theirs).abs().max() / theirs.abs().max() < 0.02, f"layer {i}"


def test_step3p5_quantized_3d_experts_are_refused_naming_the_tensor(step3p5, tmp_path):
    # vLLM's loader maps FP8 / NVFP4 scales beside the 3-D weights (moe.gate_proj.weight_scale ...); no reader
    # here takes that form: refused on one line naming the tensor, nothing written
    from safetensors.torch import load_file, save_file

    bad = _copy(step3p5, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.moe.gate_proj.weight_scale"] = torch.ones(8, 32)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    r = cli("repack", str(bad), str(tmp_path / "out"), "--backend", "plain", expect=2)
    assert "model.layers.1.moe.gate_proj.weight_scale" in r.err and "stored fused (3-D) are not read" in r.err, r.err
    assert r.err.strip().count("\n") == 0 and not (tmp_path / "out").exists()


def test_step3p5_layer_lists_padded_with_the_mtp_layers_are_read_as_transformers_cuts_them():
    # published configs carry num_hidden_layers + num_nextn_predict_layers entries; transformers keeps the first
    # num_hidden_layers (Step3p7TextConfig.__post_init__), and the MTP layers' experts are allowed after them
    from moeconvert.format.families import BY_NAME
    from moeconvert.modelmap import sparse_layers

    fam = BY_NAME["step3p5"]
    raw = dict(hidden_size=64, n_routed_experts=8, moe_intermediate_size=32, num_hidden_layers=3,
               num_nextn_predict_layers=1, mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    theirs = transformers.Step3p7TextConfig(**raw).mlp_layer_types
    assert list(sparse_layers(fam, read_keys(raw, fam))) == [i for i, t in enumerate(theirs) if t == "sparse"] == [1]


# -- LongCat-Flash: zero-computation experts beside the routed ones -----------------------------------------


@pytest.fixture(scope="module")
def longcat(tmp_path_factory):
    return make_family_checkpoint(tmp_path_factory.mktemp("longcat") / "ckpt", "longcat_flash")


def test_longcat_flash_through_every_path(longcat, tmp_path):
    def check_layers(layers: list[dict]) -> None:
        assert [(x["num_experts"], x["zero_experts"]) for x in layers] == [(8, {"num": 4, "type": "identity"})] * 2

    report, m = _through_the_cli(longcat, tmp_path, check_layers)
    assert report["family"] == "longcat-flash"
    assert [(x["prefix"], x["num_experts"], x["zero_experts"]) for x in report["moe_layers"]] == [
        (f"model.layers.{i}.mlp.experts", 8, 4) for i in (0, 1)]
    # transformers' whole LongcatFlashMoE (router, routed experts, identity zero experts) against the runtime's
    # layer given that router's choice; a bias on zero expert 9 makes every token pick it besides a routed one
    model = transformers.AutoModelForCausalLM.from_pretrained(longcat, dtype=torch.float32)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for i in (0, 1):
        moe = model.model.layers[i].mlp
        with torch.no_grad():
            moe.router.e_score_correction_bias[9] = 1.0
            _, w, ids = moe.router(x.float())
            theirs = moe(x.float())
        assert (ids >= 8).any(1).all() and (ids < 8).sum() > 6, ids
        ours = m.moe_layers[f"model.layers.{i}.mlp.experts"](x, w, ids).float()
        assert (ours - theirs).abs().max() / theirs.abs().max() < 0.02, f"layer {i}"


def test_longcat_flash_gptq_is_repacked_to_marlin_and_runs_its_zero_experts(tmp_path):
    # the routed experts quantized per expert (GPTQ round-to-nearest, H 128 and I 64: the smallest sizes Marlin
    # takes), repacked for vLLM's Marlin; transformers' LongcatFlashMoE holding the weights the codes stand for
    from moeconvert.runtime import load

    bf16 = make_family_checkpoint(tmp_path / "bf16", "longcat_flash", hidden_size=128, expert_ffn_hidden_size=64)
    src = make_int_checkpoint(bf16, tmp_path / "gptq", "gptq", bits=4, group_size=32)
    out = tmp_path / "marlin"
    cli("repack", str(src), str(out), "--backend", "marlin", expect=0)
    cli("verify", str(out), "--against", str(src), expect=0)
    layers = json.loads((out / "moeconvert.json").read_text())["moe_layers"]
    assert [(x["source_scheme"]["kind"], x["zero_experts"]) for x in layers] == [("wna16", {"num": 4, "type": "identity"})] * 2
    model = transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
    m = load(out, device="cpu")
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for i in (0, 1):
        moe = model.model.layers[i].mlp
        with torch.no_grad():
            for e in range(8):
                gu, dn = moe.experts.gate_up_proj[e], moe.experts.down_proj[e]
                for w in (gu[:64], gu[64:], dn):
                    w.copy_(rtn_dequantized(w, 4, 32, sym=True))
            moe.router.e_score_correction_bias[10] = 1.0
            _, w, ids = moe.router(x.float())
            theirs = moe(x.float())
        ours = m.moe_layers[f"model.layers.{i}.mlp.experts"](x, w, ids).float()
        assert (ours - theirs).abs().max() / theirs.abs().max() < 0.02, f"layer {i}"


@pytest.mark.parametrize("backend,needle", [
    ("triton", "activation 'swiglustep' has no triton_kernels MoE"),
    ("triton-fast", "activation = swiglustep: the triton-fast kernel applies silu or swigluoai or situ"),
    ("flashinfer-trtllm", "activation = swiglustep: the FlashInfer TRT-LLM MXFP4 kernel"),
    ("marlin", None),  # MarlinExperts runs it (apply_moe_activation)
])
def test_mxfp4_layouts_take_swiglustep_where_their_kernel_runs_it(backend, needle):
    from moeconvert.canonical import LayerShape
    from moeconvert.layouts import get_layout
    from moeconvert.schemes import MXFP4Scheme

    layout = get_layout(backend, "mxfp4")
    shape = dict(num_experts=8, hidden_size=512, intermediate_size=512, dtype="bfloat16")
    silu = layout._check(LayerShape(**shape), MXFP4Scheme())
    step = layout._check(LayerShape(**shape, activation="swiglustep"), MXFP4Scheme())
    assert [p for p in step if p not in silu] == ([] if needle is None else [next(p for p in step if needle in p)])


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m["moe_layers"][0]["zero_experts"].update(type="drop"), "moe_layers[0].zero_experts.type: expected identity"),
    (lambda m: m["moe_layers"][0].update(top_k=13), "moe_layers[0].top_k: expected at most num_experts_global 8 + "
                                                    "zero_experts.num, found 13"),
    (lambda m: m["moe_layers"][0].update(activation="swiglustep", activation_params={"alpha": 1.702}),
     "moe_layers[0].activation_params.alpha: unknown parameter of swiglustep (expected limit)"),
])
def test_a_manifest_with_bad_zero_experts_or_swiglustep_params_is_refused(edit, needle, longcat, tmp_path):
    out = tmp_path / "out"
    cli("repack", str(longcat), str(out), "--backend", "plain", expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())
    edit(manifest)
    (out / "moeconvert.json").write_text(json.dumps(manifest))
    err = cli("verify", str(out), expect=2).err
    assert needle in err and err.strip().count("\n") == 0, err


@pytest.mark.parametrize("family,edit,needle", [
    ("step3p5", {"swiglu_limits": [0, 0, 5.0]}, "config.json: swiglu_limits[2]: vLLM's swiglustep clamps at 7.0 only"),
    ("step3p5", {"n_routed_experts": 4}, "config.json n_routed_experts = 4"),
    ("step3p5", {"mlp_layer_types": ["dense", "dense", "sparse"]}, "layer 1 has expert tensors but the config says it is dense"),
    ("step3p5", {"mlp_layer_types": None}, "config.json: mlp_layer_types: the config does not say which layers are MoE"),
    ("step3p5", {"mlp_layer_types": None, "moe_layers_enum": "1,2,x"}, "config.json: moe_layers_enum: invalid value"),
    ("step3p5", {"mlp_layer_types": None, "moe_layers_enum": "2"}, "layer 1 has expert tensors but the config says it is dense"),
    ("longcat", {"zero_expert_type": "drop"}, "config.json: zero_expert_type"),
    ("longcat", {"n_routed_experts": 12}, "layer does not hold every routed expert"),
    ("longcat", {"moe_topk": 13}, "config.json: moe_topk: top-k is larger than the number of routed experts"),
])
def test_step3p5_and_longcat_contradictory_config_refused_on_one_line(family, edit, needle, request, tmp_path):
    bad = _copy(request.getfixturevalue(family), tmp_path / "bad", **edit)
    r = cli("repack", str(bad), str(tmp_path / "out"), "--backend", "plain", expect=2)
    assert needle in r.err and r.err.strip().count("\n") == 0, r.err
    assert not (tmp_path / "out").exists()


# -- gpt-oss: a config or source value is never silently read as another ------------------------------


@pytest.fixture(scope="session")
def gptoss(example_ckpt):
    return example_ckpt("gpt-oss", "bf16", num_layers=1, num_experts=4, hidden_size=64, intermediate_size=64)


def test_gptoss_swiglu_limit_null_is_refused(gptoss, tmp_path):
    # transformers' GptOssConfig refuses null; it used to be read as 7.0 (config.json null, manifest 7.0)
    bad = _copy(gptoss, tmp_path / "bad", swiglu_limit=None)
    r = cli("repack", str(bad), str(tmp_path / "out"), "--backend", "plain", expect=2)
    assert "config.json: swiglu_limit: must not be null" in r.err and r.err.strip().count("\n") == 0, r.err
    assert not (tmp_path / "out").exists()


def test_gptoss_nan_e8m0_scale_is_refused(gptoss, tmp_path):
    from safetensors.torch import load_file, save_file

    from helpers import to_gptoss_mxfp4

    mx = tmp_path / "mx"
    to_gptoss_mxfp4(gptoss, mx)
    f = next(mx.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(k for k in tensors if k.endswith("down_proj_scales"))
    tensors[name][2, 5, 1] = 255  # e8m0 NaN
    save_file(tensors, str(f), metadata={"format": "pt"})
    r = cli("quantize", str(mx), str(tmp_path / "out"), "--backend", "plain", expect=2)
    assert f"{name}[2, 5, 1]" in r.err and "non-finite e8m0 scale" in r.err, r.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("drop", [("gate_up_proj_bias",), ("down_proj_bias",), ("gate_up_proj_bias", "down_proj_bias")])
def test_gptoss_missing_expert_bias_is_refused(gptoss, tmp_path, drop):
    # transformers' GptOssExperts always has both biases: one missing or both is not a gpt-oss checkpoint
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(gptoss, bad)
    f = next(bad.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(f).items() if not k.endswith(drop)}
    save_file(tensors, str(f), metadata={"format": "pt"})
    r = cli("repack", str(bad), str(tmp_path / "out"), "--backend", "plain", expect=2)
    assert "gpt-oss experts have gate_up_proj_bias and down_proj_bias" in r.err, r.err
    assert f"experts.{drop[0]}" in r.err and r.err.strip().count("\n") == 0, r.err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def kimi_k3_mxfp4(tmp_path_factory):
    """Kimi-K3 at full size in the form it ships in (compressed-tensors mxfp4-pack-quantized experts), two of
    its 92 MoE layers (the plan is the same per layer), written by ``moeconvert example --header-only``."""
    out = tmp_path_factory.mktemp("k3") / "mxfp4"
    cli("example", str(out), "--header-only", "--family", "kimi-k3", "--scheme", "mxfp4", "--layers", "2", expect=0)
    return out


# the MXFP4 layouts whose kernels run SITU; Kimi-K3's H 3584 and I 3072 are multiples of all their padding,
# so each holds exactly the source's codes and scales (a real run of these full-size layers would write
# 15.72 GB a layer: the tiny Kimi-K3 tests below write real folders)
@pytest.mark.parametrize("backend", ["marlin", "humming"])
def test_kimi_k3_shipped_mxfp4_is_planned_one_chunk_of_a_layer_per_job(kimi_k3_mxfp4, backend, tmp_path):
    src = kimi_k3_mxfp4
    config = json.loads((src / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    r = cli("repack", str(src), str(tmp_path / "out"), "--backend", backend, "--dry-run", "--json", "--no-estimate",
            expect=0)
    plan = json.loads(r.out)
    codes = 896 * 3 * 3072 * 3584  # w13 and w2 of every expert
    layer_bytes = codes // 2 + codes // 32  # e2m1 codes at half a byte, an e8m0 scale byte per 32
    assert plan["moe_layers"] == 2
    layer_jobs = [j for j in plan["jobs"] if j["kind"] == "layer"]
    assert [j["read_bytes"] for j in layer_jobs] == [layer_bytes] * 2
    assert [j["write_bytes"] for j in layer_jobs] == [layer_bytes] * 2
    assert max(j["peak_bytes"] for j in plan["jobs"]) < layer_bytes // 50  # a chunk of experts, never a layer
    assert not any("planned as silu" in w for w in plan["warnings"])


@pytest.mark.parametrize("backend", ["triton", "flashinfer-trtllm"])
def test_kimi_k3_shipped_mxfp4_is_not_planned_where_the_kernel_cannot_run_situ(kimi_k3_mxfp4, backend, tmp_path):
    err = cli("repack", str(kimi_k3_mxfp4), str(tmp_path / "out"), "--backend", backend, "--dry-run", expect=2).err
    assert f"backend '{backend}' cannot take this checkpoint" in err and "situ" in err, err
    assert err.strip().count("\n") == 0 and not (tmp_path / "out").exists()


def test_inspect_keeps_the_layouts_own_answer_on_kimi_k3(kimi_k3_mxfp4):
    # inspect says what each layout itself takes: Marlin and humming run SITU, triton_kernels' experts do not
    backends = json.loads(cli("inspect", str(kimi_k3_mxfp4), "--json", expect=0).out)["backends"]
    assert backends["marlin"]["ok"] and backends["humming"]["ok"] and not backends["triton"]["ok"]
    assert all("activation 'situ'" in p[0] for p in backends["triton"]["problems"].values())


def test_header_only_mxfp4_is_kimi_k3s_alone(tmp_path):
    err = cli("example", str(tmp_path / "d"), "--header-only", "--family", "deepseek-v3", "--scheme", "mxfp4",
              expect=2).err
    assert "--scheme" in err and "bf16" in err and err.strip().count("\n") == 0, err


@pytest.mark.parametrize("case", ["qwen3.5-fused", "llama4-transposed"])
def test_gptoss_mxfp4_form_is_refused_for_other_fused_families(case, family_ckpts, tmp_path):
    # the blocks/scales form (quant_method mxfp4) is gpt-oss' own: its reader takes no other storage
    from safetensors.torch import load_file, save_file

    src, _ = family_ckpts(case)
    bad = _copy(src, tmp_path / "bad", quantization_config={"quant_method": "mxfp4"})
    f = next(bad.glob("*.safetensors"))
    tensors = load_file(f)
    for k in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        t = tensors.pop(k)
        tensors[k + "_blocks"] = torch.zeros(*t.shape[:2], t.shape[2] // 32, 16, dtype=torch.uint8)
        tensors[k + "_scales"] = torch.full((*t.shape[:2], t.shape[2] // 32), 127, dtype=torch.uint8)
    save_file(tensors, str(f), metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").unlink(missing_ok=True)
    r = cli("inspect", str(bad), expect=2)
    storage = {"qwen3.5-fused": "fused", "llama4-transposed": "fused-transposed"}[case]
    assert f"gpt-oss' MXFP4 blocks/scales form, but the family stores them {storage}" in r.err, r.err
    assert r.err.strip().count("\n") == 0, r.err


def test_docs_page_is_the_table():
    from moeconvert.format.families import table_markdown

    page = (Path(__file__).parents[1] / "docs" / "families.md").read_text()
    generated = page.split("<!-- generated: moeconvert.format.families.table_markdown -->\n")[1]
    assert generated.split("<!-- end generated -->")[0] == table_markdown()


def test_kimi_k25_wrapper_converts_its_deepseek_v3_text_model(example_ckpt, tmp_path):
    # Kimi-K2.5's checkpoint: the DeepSeek-V3 text model under language_model. (transformers' kimi_k25
    # conversion mapping), its config in text_config (model_type kimi_k2)
    from safetensors.torch import load_file, save_file

    src = example_ckpt("deepseek-v3", "bf16", num_experts=4, hidden_size=64, intermediate_size=32)
    k25 = tmp_path / "k25"
    k25.mkdir()
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    (k25 / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    f = next(src.glob("*.safetensors"))
    save_file({f"language_model.{k}": v for k, v in load_file(f).items()}, str(k25 / "model.safetensors"),
              metadata={"format": "pt"})
    report = json.loads(cli("inspect", str(k25), "--json", expect=0).out)
    assert report["family"] == "deepseek-v3"
    assert [x["prefix"] for x in report["moe_layers"]][:1] == ["language_model.model.layers.1.mlp.experts"]
    cli("repack", str(k25), str(tmp_path / "out"), "--backend", "plain", expect=0)
    cli("verify", str(tmp_path / "out"), "--against", str(k25), expect=0)


def test_kimi_k3_full_shape_is_planned_one_chunk_of_a_layer_per_job(tmp_path):
    # Kimi-K3 at full size (moeconvert/fullsize.py: 896 experts on a 3584 latent, I 3072, top-16; its keys
    # and tensor names are those of vLLM 0.33.0's KimiK3Config / KimiLinearConfig and vllm/models/kimi_k3),
    # two of its 92 MoE layers: the plan is the same per layer, and a 92-layer dry run differs only in count
    from moeconvert.fullsize import make_header_only

    src = make_header_only(tmp_path / "k3", "kimi-k3", num_layers=2)
    r = cli("repack", str(src), str(tmp_path / "out"), "--backend", "plain", "--dry-run", "--json", "--no-estimate",
            expect=0)
    plan = json.loads(r.out)
    layer_bytes = 896 * 3 * 3072 * 3584 * 2  # w13 and w2 of every expert, bf16
    assert plan["moe_layers"] == 2
    assert [x["tensors"]["w13_weight"]["shape"] for x in plan["layers"]] == [[896, 6144, 3584]] * 2
    layer_jobs = [j for j in plan["jobs"] if j["kind"] == "layer"]
    assert sum(j["write_bytes"] for j in layer_jobs) == 2 * layer_bytes
    assert max(j["peak_bytes"] for j in plan["jobs"]) < layer_bytes // 50  # a chunk of experts, never a layer


@pytest.mark.parametrize("case", ["qwen3.5-fused", "llama4-transposed"])
def test_fused_experts_are_read_one_chunk_at_a_time_and_cut_for_tp(case, family_ckpts, monkeypatch):
    # each read of a fused tensor covers the chunk's experts only (never the whole 3-D tensor), and the
    # block equals transformers' own expert weights: gate rows then up rows, down [H, I], cut per TP rank
    from moeconvert.canonical import Partition
    from moeconvert.decode import decode_chunk
    from moeconvert.modelmap import map_model
    from moeconvert.sources import Source, open_source

    src, model = family_ckpts(case)
    source = open_source(str(src))
    layer = map_model(source).layers[-1]
    reads = []
    real_read = Source.read
    monkeypatch.setattr(Source, "read", lambda self, name, rows=None: reads.append(rows) or real_read(self, name, rows))
    block = decode_chunk(source, layer, Partition(), 2, 5)
    assert reads and all(r == (2, 5) for r in reads), reads
    experts = getattr(model.model.layers[layer.layer], CASES[case][2]).experts
    gate_up, down = experts.gate_up_proj[2:5], experts.down_proj[2:5]
    if case == "llama4-transposed":  # stored x @ W: [E, H, 2I], [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    I = layer.intermediate_size
    assert torch.equal(block.w13.float(), gate_up.float()) and torch.equal(block.w2.float(), down.float())
    rank1 = decode_chunk(source, layer, Partition(tp_size=2, tp_rank=1), 2, 5)
    half = slice(I // 2, I)
    assert torch.equal(rank1.w13, torch.cat([block.w13[:, half], block.w13[:, I:][:, half]], 1))
    assert torch.equal(rank1.w2, block.w2[:, :, half])


# Kimi-K3 (SITU): the bytes do not depend on the activation, only which kernels can run them
# (docs/families.md, "Kimi-K3 and SITU"): written for the layouts whose vLLM experts run SITU, refused in
# one line naming the layout and the activation for the others
K3_WRITTEN = ("marlin", "humming", "emulation", "plain", "triton-fast")
K3_REFUSED = {"triton": "activation 'situ' has no triton_kernels MoE",
              "flashinfer-cutlass": "activation = situ: the FlashInfer CUTLASS MXFP4 kernel",
              "flashinfer-trtllm": "activation = situ: the FlashInfer TRT-LLM MXFP4 kernel"}


@pytest.mark.parametrize("backend", K3_WRITTEN)
def test_kimi_k3_mxfp4_is_repacked_and_verified_declaring_situ(backend, kimi_k3_ckpt, tmp_path):
    src, out = kimi_k3_ckpt("mxfp4"), tmp_path / "out"
    cli("repack", str(src), str(out), "--backend", backend, expect=0)
    cli("verify", str(out), "--against", str(src), expect=0)
    layers = json.loads((out / "moeconvert.json").read_text())["moe_layers"]
    assert [(m["activation"], m["activation_params"]) for m in layers] == [("situ", {"beta": 1.0, "linear_beta": 4.0})] * 2


def test_a_situ_manifest_takes_beta_and_linear_beta_only(kimi_k3_ckpt, tmp_path):
    out = tmp_path / "out"
    cli("repack", str(kimi_k3_ckpt("mxfp4")), str(out), "--backend", "plain", expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())
    manifest["moe_layers"][0]["activation_params"]["alpha"] = 1.702  # swigluoai's, not SITU's
    (out / "moeconvert.json").write_text(json.dumps(manifest))
    err = cli("verify", str(out), expect=2).err
    assert err.strip() == ("moeconvert: error: moeconvert.json: moe_layers[0].activation_params.alpha: unknown "
                           "parameter of situ (expected beta, linear_beta)"), err


@pytest.mark.parametrize("backend", list(K3_REFUSED))
def test_kimi_k3_layouts_whose_kernel_cannot_run_situ_are_refused(backend, kimi_k3_ckpt, tmp_path):
    r = cli("repack", str(kimi_k3_ckpt("mxfp4")), str(tmp_path / "out"), "--backend", backend, expect=2)
    assert f"backend '{backend}' cannot take this checkpoint" in r.err and K3_REFUSED[backend] in r.err, r.err
    assert r.err.strip().count("\n") == 0 and not (tmp_path / "out").exists()


def test_kimi_k3_bf16_is_quantized_to_marlin_mxfp4_and_verified(kimi_k3_ckpt, tmp_path):
    src, out = kimi_k3_ckpt("bf16"), tmp_path / "out"
    run = cli("quantize", str(src), str(out), "--format", "mxfp4", "--backend", "marlin", expect=0)
    cli("verify", str(out), "--against", str(src), expect=0)
    # the vLLM plugin is not proven on Kimi-K3: the folder keeps the source's config.json, one warning says why
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    line = next(w for w in run.err.splitlines() if "config.json: copied as it is" in w)
    assert "the vLLM plugin has not been proven on kimi-k3 models (vLLM's KimiK3ForConditionalGeneration holds a " \
           "MoonViT vision tower and KimiLinear decoder layers" in line, run.err
    m = json.loads((out / "moeconvert.json").read_text())
    assert m["family"] == "kimi-k3" and m["moe_layers"][0]["activation"] == "situ"
    assert m["moe_layers"][0]["hidden_size"] == 256  # the latent the experts see, not the model's 512


def test_triton_wna16_refuses_situ_naming_vllms_experts_class():
    from moeconvert.canonical import LayerShape
    from moeconvert.layouts import get_layout
    from moeconvert.schemes import WNA16Scheme

    layout = get_layout("triton", "wna16")
    ok = layout._check(LayerShape(8, 256, 128), WNA16Scheme(bits=4, group_size=32, symmetric=True, scale_dtype="bfloat16"))
    situ = layout._check(LayerShape(8, 256, 128, activation="situ"), WNA16Scheme(bits=4, group_size=32, symmetric=True, scale_dtype="bfloat16"))
    assert ok == [] and situ == ["activation = situ: vLLM's TritonWNA16Experts does not run SITU (its "
                                 "_supports_activation has no SITU in vLLM 0.33.0 / 0.34.0); the marlin and humming "
                                 "layouts run it"]
