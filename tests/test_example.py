"""The example checkpoints are what the real producers write.

* float: transformers loads them back with every tensor consumed, reproduces them on re-save, and
  the routed experts have the per-expert (or, for gpt-oss, fused) names and shapes of real
  checkpoints of each family;
* int: compressed-tensors' own decompression of every packed weight equals compressed-tensors'
  fake quantization of the same bf16 weight with qparams from its min/max (computed here,
  independently of moeconvert.example), and only routers and lm_head are left unquantized;
* the same arguments give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from helpers import cli  # noqa: E402
from moeconvert.errors import MoeConvertError  # noqa: E402
from moeconvert.example import FAMILIES, make_example  # noqa: E402

# Float checks use 2*I != H so that a transposed or gate/up-swapped tensor cannot pass by shape.
H, I, E = 128, 96, 4
FLOAT_KW = dict(hidden_size=H, intermediate_size=I, num_experts=E)

# (routed-expert prefix, gate/up/down names, router name) as saved by transformers >= 5
EXPERTS = {
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2"), "block_sparse_moe.gate"),
    **{f: ("mlp.experts", ("gate_proj", "up_proj", "down_proj"), "mlp.gate")
       for f in ("qwen3-moe", "qwen2-moe", "deepseek-v2", "deepseek-v3", "glm4-moe")},
}
DENSE_FIRST = {"deepseek-v2", "deepseek-v3", "glm4-moe"}  # first_k_dense_replace = 1
SHARED = {"qwen2-moe": ("mlp.shared_expert", 2 * I), "deepseek-v2": ("mlp.shared_experts", I),
          "deepseek-v3": ("mlp.shared_experts", I), "glm4-moe": ("mlp.shared_experts", I)}


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


# --------------------------------------------------------------------------------------------
# float checkpoints
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_float_checkpoint_is_what_transformers_reads_and_writes(family, example_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = example_ckpt(family, "bf16", **FLOAT_KW)
    sd = tensors(ckpt)
    cfg = config(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert "quantization_config" not in cfg
    layers = cfg["num_hidden_layers"]
    moe_layers = range(1 if family in DENSE_FIRST else 0, layers)
    assert len(moe_layers) >= 2

    # --- expert names and shapes, as real checkpoints of the family have them
    for layer in moe_layers:
        p = f"model.layers.{layer}."
        if family == "gpt-oss":
            x = p + "mlp.experts."
            assert sd[x + "gate_up_proj"].shape == (E, H, 2 * I)  # gate/up interleaved on the last dim
            assert sd[x + "gate_up_proj_bias"].shape == (E, 2 * I)
            assert sd[x + "down_proj"].shape == (E, I, H)
            assert sd[x + "down_proj_bias"].shape == (E, H)
            assert sd[p + "mlp.router.weight"].shape == (E, H) and sd[p + "mlp.router.bias"].shape == (E,)
            assert not [k for k in sd if ".experts.0." in k]
            continue
        prefix, (gate, up, down), router = EXPERTS[family]
        for e in range(E):
            x = f"{p}{prefix}.{e}."
            assert sd[x + gate + ".weight"].shape == (I, H)
            assert sd[x + up + ".weight"].shape == (I, H)
            assert sd[x + down + ".weight"].shape == (H, I)
        assert not [k for k in sd if k.startswith(f"{p}{prefix}.{E}.")]
        assert sd[p + router + ".weight"].shape == (E, H)
        if family in ("deepseek-v3", "glm4-moe"):
            bias = sd[p + "mlp.gate.e_score_correction_bias"]
            assert bias.shape == (E,) and bias.dtype == torch.float32
        if family in SHARED:
            s, si = SHARED[family]
            assert sd[f"{p}{s}.gate_proj.weight"].shape == (si, H)
            assert sd[f"{p}{s}.down_proj.weight"].shape == (H, si)
        if family == "qwen2-moe":
            assert sd[p + "mlp.shared_expert_gate.weight"].shape == (1, H)
    if family in DENSE_FIRST:
        assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (2 * H, H)
        assert sd["model.layers.0.mlp.down_proj.weight"].shape == (H, 2 * H)
        assert not [k for k in sd if k.startswith("model.layers.0.mlp.experts")]
    assert "lm_head.weight" in sd  # untied, as in the real models

    # --- values: finite, not degenerate, every tensor distinct from its neighbours
    for name, t in sd.items():
        assert torch.isfinite(t.float()).all(), name
        assert t.float().std() > 0.005, name  # no zero biases, no all-one norms
    if family != "gpt-oss":
        prefix, (gate, _, _), _ = EXPERTS[family]
        l = moe_layers[0]
        w0, w1 = (sd[f"model.layers.{l}.{prefix}.{e}.{gate}.weight"] for e in (0, 1))
        assert not torch.equal(w0, w1)
        assert 0.015 < w0.float().std() < 0.025

    # --- transformers loads it completely and writes the same tensors back
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info.values()), info
    if family != "gpt-oss":
        # in memory transformers >= 5 fuses the experts: gate_up_proj [E, 2I, H] = cat(gate, up)
        prefix, (gate, up, down), _ = EXPERTS[family]
        l = moe_layers[0]
        fused = model.model.layers[l].mlp.experts
        for e in range(E):
            x = f"model.layers.{l}.{prefix}.{e}."
            assert torch.equal(fused.gate_up_proj[e], torch.cat([sd[x + gate + ".weight"], sd[x + up + ".weight"]]))
            assert torch.equal(fused.down_proj[e], sd[x + down + ".weight"])
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 256) and torch.isfinite(logits).all()
    model.save_pretrained(tmp_path / "again")
    again = tensors(tmp_path / "again")
    assert again.keys() == sd.keys()
    for k in sd:
        assert again[k].dtype == sd[k].dtype and torch.equal(again[k], sd[k]), k


def test_fp16_and_sharding(example_ckpt):
    ckpt = example_ckpt("gpt-oss", "fp16", max_shard_size="100KB", **FLOAT_KW)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    sd = tensors(ckpt)
    assert index["weight_map"].keys() == sd.keys()
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float16
    assert config(ckpt)["dtype"] == "float16"


# --------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized checkpoints
# --------------------------------------------------------------------------------------------


def reference_fake_quant(w: torch.Tensor, args):
    """compressed-tensors fake quantization with qparams from per-group / per-row min/max."""
    if args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        assert args.strategy == "channel"
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, args)
    return fake_quantize(w, scale, zp, args), scale, zp


QUANT_CASES = [
    # family, scheme, group_size, symmetric
    ("qwen3-moe", "w4a16", 128, True),
    ("qwen3-moe", "w4a16", 32, True),
    ("qwen3-moe", "w4a16", -1, True),
    ("qwen3-moe", "w4a16", 128, False),
    ("qwen3-moe", "w4a16", 32, False),
    ("qwen3-moe", "w4a16", -1, False),
    ("qwen3-moe", "w8a16", 128, True),
    ("qwen3-moe", "w8a16", -1, False),
    ("deepseek-v3", "w4a16", 32, False),
    ("deepseek-v3", "w8a16", 128, True),
    ("mixtral", "w4a16", -1, True),
]


@pytest.mark.parametrize("family,scheme,group_size,symmetric", QUANT_CASES)
def test_int_checkpoint_decompresses_to_fake_quant_of_bf16(family, scheme, group_size, symmetric, example_ckpt):
    kw = dict(num_experts=E)
    float_ckpt = example_ckpt(family, "bf16", **kw)  # same seed and sizes: the unquantized weights
    ckpt = example_ckpt(family, scheme, group_size=group_size, symmetric=symmetric, **kw)
    ref, sd = tensors(float_ckpt), tensors(ckpt)
    bits = int(scheme[1])

    qc = config(ckpt)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "pack-quantized" and qc["quantization_status"] == "compressed"
    qconfig = QuantizationConfig.model_validate(qc)
    assert list(qconfig.config_groups) == ["group_0"]
    scheme_ = qconfig.config_groups["group_0"]
    args = scheme_.weights
    assert scheme_.targets == ["Linear"] and scheme_.input_activations is None
    assert (args.num_bits, args.type, args.symmetric) == (bits, "int", symmetric)
    assert (args.strategy, args.group_size) == (("channel", None) if group_size == -1 else ("group", group_size))
    compressor = BaseCompressor.get_value_from_registry(qc["format"])

    # Every Linear of the bf16 checkpoint (2-D .weight but the embedding) is either ignored by the
    # config and kept as it was, or packed. Only routers and lm_head are ignored.
    linears = sorted(k[: -len(".weight")] for k, t in ref.items()
                     if k.endswith(".weight") and t.ndim == 2 and "embed_tokens" not in k)
    ignored = [m for m in linears if any(match_name(m, i) for i in qconfig.ignore)]
    router = EXPERTS[family][2]
    assert ignored == sorted(["lm_head"] + [m for m in linears if m.endswith("." + router)])
    quantized = [m for m in linears if m not in ignored]
    assert len(quantized) > 3 * E

    expected_keys = set(ref) - {m + ".weight" for m in quantized}
    for m in quantized:
        expected_keys |= {f"{m}.weight_packed", f"{m}.weight_scale", f"{m}.weight_shape"}
        if not symmetric:
            expected_keys.add(f"{m}.weight_zero_point")
    assert set(sd) == expected_keys
    for k in set(ref) & set(sd):  # embeddings, norms, routers, biases, e_score_correction_bias
        assert sd[k].dtype == ref[k].dtype and torch.equal(sd[k], ref[k]), k

    for m in quantized:
        w = ref[m + ".weight"]
        n, k = w.shape
        local = {s: sd[f"{m}.{s}"] for s in compressor.compression_param_names(scheme_)}
        assert local["weight_packed"].dtype == torch.int32 and local["weight_packed"].shape == (n, k * bits // 32)
        assert local["weight_shape"].tolist() == [n, k]
        groups = 1 if group_size == -1 else k // group_size
        assert local["weight_scale"].shape == (n, groups) and local["weight_scale"].dtype == torch.bfloat16
        if not symmetric:  # zero points packed along the output dim (dim 0)
            zp = local["weight_zero_point"]
            assert zp.dtype == torch.int32 and zp.shape == (n * bits // 32, groups)

        expect, scale, _ = reference_fake_quant(w, args)
        assert torch.equal(local["weight_scale"], scale), m
        got = compressor.decompress(local, scheme_)["weight"]
        assert got.dtype == w.dtype and torch.equal(got, expect), m
        # and it is a real quantization: about half a step from the bf16 weight on average.
        # (Not at most half a step everywhere: compressed-tensors divides by the scale in bf16,
        # whose 8-bit mantissa can move an int8 code by one, and asymmetric zero points are
        # rounded to integers.)
        err = (got.float() - w.float()).abs() / scale.repeat_interleave(k // groups, dim=-1).float()
        assert err.max() <= 1.5 and err.mean() <= 0.3, (m, err.max(), err.mean())
        assert (got != 0).float().mean() > 0.5, m


def test_int_checkpoint_keeps_shared_expert_and_attention_quantized(example_ckpt):
    sd = tensors(example_ckpt("qwen2-moe", "w4a16", group_size=64, num_experts=E))
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight_packed" in sd
    assert "model.layers.0.self_attn.q_proj.weight_packed" in sd
    assert sd["model.layers.0.self_attn.q_proj.bias"].dtype == torch.bfloat16  # biases stay float
    assert sd["model.layers.0.mlp.shared_expert_gate.weight"].dtype == torch.bfloat16  # ignored
    assert "model.layers.0.mlp.gate.weight" in sd


# --------------------------------------------------------------------------------------------
# determinism, refusals, import without transformers
# --------------------------------------------------------------------------------------------


def digest(ckpt: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.iterdir())}


@pytest.mark.parametrize("family,scheme,kw", [
    ("qwen3-moe", "w4a16", dict(group_size=32, symmetric=False, max_shard_size="200KB")),
    ("deepseek-v3", "bf16", dict(max_shard_size="200KB")),
])
def test_same_arguments_same_bytes(family, scheme, kw, tmp_path):
    a = digest(make_example(tmp_path / "a", family, scheme, num_experts=E, **kw))
    b = digest(make_example(tmp_path / "b", family, scheme, num_experts=E, **kw))
    assert a == b
    assert "model.safetensors.index.json" in a and len(a) > 4  # sharded
    c = digest(make_example(tmp_path / "c", family, scheme, num_experts=E, seed=1, **kw))
    assert c["config.json"] == a["config.json"]
    assert {n for n in a if n.endswith(".safetensors") and a[n] != c.get(n)}  # other weights


@pytest.mark.parametrize("args,kw,match", [
    (("gpt-oss", "w4a16"), {}, "bf16/fp16 only"),
    (("qwen3-moe", "w4a16"), dict(group_size=96), "group_size must divide"),
    (("qwen3-moe", "w8a16"), dict(intermediate_size=96), "group_size must divide"),
    (("qwen3-moe", "int3"), {}, "unknown scheme"),
    (("llama", "bf16"), {}, "unknown family"),
    (("qwen3-moe", "bf16"), dict(num_experts=1), "num_experts"),
    (("deepseek-v3", "bf16"), dict(num_layers=1), "at least 2 layer"),
])
def test_refusals(args, kw, match, tmp_path):
    with pytest.raises(MoeConvertError, match=match):
        make_example(tmp_path / "out", *args, **kw)
    assert not (tmp_path / "out").exists()  # refused before writing anything


def test_refuses_non_empty_output(tmp_path):
    (tmp_path / "stale.safetensors").write_bytes(b"x")
    with pytest.raises(MoeConvertError, match="not empty"):
        make_example(tmp_path, "qwen3-moe", "bf16")


def test_without_transformers(monkeypatch, tmp_path):
    code = ("import sys; sys.modules['transformers'] = None; import moeconvert.example as m; "
            "assert 'transformers' not in {k for k, v in sys.modules.items() if v is not None}; print(m.FAMILIES)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MoeConvertError, match=r"pip install 'moeconvert\[example\]'"):
        make_example(tmp_path / "out", "qwen3-moe", "bf16")


def test_transformers_dequantizes_the_int_checkpoint_to_the_same_weights(example_ckpt):
    """A second, independent consumer: transformers' compressed-tensors integration loads the
    symmetric checkpoint (re-fusing the per-expert packed weights) to the fake-quantized bf16
    weights. (transformers 5.24 cannot load *asymmetric* MoE ones: its fused-expert dequantize
    drops the zero points; that is a transformers limitation, not the checkpoint's.)"""
    from transformers import AutoModelForCausalLM

    ckpt = example_ckpt("qwen3-moe", "w4a16", group_size=32, symmetric=True, num_experts=E)
    ref = tensors(example_ckpt("qwen3-moe", "bf16", num_experts=E))
    args = QuantizationConfig.model_validate(config(ckpt)["quantization_config"]).config_groups["group_0"].weights
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not any(info.values()), info
    logits = model(torch.tensor([[1, 2, 3]])).logits  # the first forward decompresses the Linears
    assert torch.isfinite(logits).all()
    fq = {k: reference_fake_quant(t, args)[0] for k, t in ref.items() if k.startswith("model.layers.1.")
          and k.endswith("proj.weight")}
    layer = model.model.layers[1]
    for e in range(E):
        x = f"model.layers.1.mlp.experts.{e}."
        gate_up = torch.cat([fq[x + "gate_proj.weight"], fq[x + "up_proj.weight"]])
        assert torch.equal(layer.mlp.experts.gate_up_proj[e], gate_up), e
        assert torch.equal(layer.mlp.experts.down_proj[e], fq[x + "down_proj.weight"]), e
    assert torch.equal(layer.self_attn.q_proj.weight, fq["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(layer.mlp.gate.weight, ref["model.layers.1.mlp.gate.weight"])  # router: not quantized


@pytest.mark.parametrize("args", [["--header-only", "--family", "deepseek-v3"], ["--family", "qwen3-moe"]],
                         ids=["header-only", "example"])
def test_a_write_that_fails_names_the_folder(tmp_path, args):
    """A write the OS refuses (here a file size limit, as a full disk would) is one line naming the folder
    being written, exit 2, and nothing left behind; the OS's own error names no file."""
    out = tmp_path / "out"
    child = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
             "from moeconvert.cli import main; main(sys.argv[1:])")
    run = subprocess.run([sys.executable, "-c", child, "example", str(out), *args], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "File too large" in lines[0], run.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_random_weights_write_a_checkpoint_that_reads_as_the_scheme_it_claims(tmp_path, monkeypatch):
    """``example --random-weights`` at a shrunken Qwen3-30B-A3B shape (the published one is 17 GB): the
    checkpoint reads back as compressed-tensors W4A16 g128 with every expert present, its codes are not
    all one value, and it repacks for Marlin and verifies."""
    import json

    from moeconvert import fullsize

    small = {**fullsize.RANDOM_MODELS["qwen3-30b-a3b"], "vocab_size": 64, "hidden_size": 256,
             "moe_intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
             "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2}
    monkeypatch.setitem(fullsize.RANDOM_MODELS, "qwen3-30b-a3b", small)
    src = fullsize.make_random_weights(tmp_path / "src", "qwen3-30b-a3b", layers=1)
    run = cli("inspect", src, "--json", expect=0)
    layers = json.loads(run.out)["moe_layers"]
    assert [(x["num_experts"], x["hidden_size"], x["intermediate_size"], x["scheme"]) for x in layers] == [
        (4, 256, 128, "w4a16 g128 sym")]
    assert json.loads((src / "config.json").read_text())["num_hidden_layers"] == 1
    from safetensors import safe_open

    with safe_open(str(next(src.glob("*.safetensors"))), "pt") as f:
        words = f.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight_packed")
    assert words.dtype.is_signed and words.unique().numel() > 100
    cli("repack", src, tmp_path / "marlin", "--backend", "marlin", "--verify", expect=0)


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2"])
def test_random_weights_of_deepseek_v3_and_kimi_k2_keep_mla_in_bf16(model, tmp_path, monkeypatch):
    """DeepSeek-V3 / Kimi-K2 random weights at a shrunken shape: the MoE layers' experts (and the dense MLP and
    shared experts) in W4A16, the MLA attention and routers bf16 and named in the config's ignore list, the
    routers' score biases zero in float32, no multi-token-prediction layer with --layers; it repacks for
    Marlin and verifies."""
    import json

    from safetensors import safe_open

    from moeconvert import fullsize

    small = {**fullsize.RANDOM_MODELS[model], "vocab_size": 64, "hidden_size": 256, "intermediate_size": 256,
             "moe_intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 128,
             "kv_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
             "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
             "first_k_dense_replace": 1}
    monkeypatch.setitem(fullsize.RANDOM_MODELS, model, small)
    src = fullsize.make_random_weights(tmp_path / "src", model, layers=2)
    cfg = json.loads((src / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]) == (2, 0)
    assert cfg["quantization_config"]["ignore"] == ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"]
    run = cli("inspect", src, "--json", expect=0)
    assert [(x["num_experts"], x["hidden_size"], x["intermediate_size"], x["scheme"])
            for x in json.loads(run.out)["moe_layers"]] == [(4, 256, 128, "w4a16 g128 sym")]
    with safe_open(str(next(src.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.self_attn.kv_b_proj.weight").dtype == torch.bfloat16
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        assert bias.dtype == torch.float32 and not bias.any()
    assert "model.layers.0.mlp.down_proj.weight_packed" in names  # the dense layer's MLP
    assert "model.layers.1.mlp.shared_experts.up_proj.weight_packed" in names
    assert not any(n.startswith("model.layers.2.") for n in names)
    cli("repack", src, tmp_path / "marlin", "--backend", "marlin", "--verify", expect=0)


def test_random_weights_name_the_models_they_know():
    run = cli("example", "unused-out", "--family", "mixtral", "--random-weights", expect=2)
    assert "expected qwen3-30b-a3b" in run.err and len(run.err.strip().splitlines()) == 1, run.err
