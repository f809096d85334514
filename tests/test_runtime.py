"""moeconvert.runtime on CPU: every layout loads, and every MoE layer computes what the model defines.

* The oracle of oracles is transformers' own MoE block of the same tiny model (router, experts,
  shared experts), loaded from the source checkpoint in float32: ``layer.block(x)`` must match it for
  every family, and routing must pick the same experts.
* Every other layout of the same checkpoint (repacked WNA16, quantized MXFP4) decodes to the same
  canonical block, so its layer must give the plain layout's output (exactly: same fp32 weights, same
  order of operations), and the dispatch must say what runs and why.
* TP and EP cuts: the ranks' partial outputs add up to the uncut output.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moeconvert.example import make_example
from moeconvert.runtime import KernelFallbackWarning, load
from moeconvert.runtime import dispatch

from helpers import cli

FAMILIES = ("qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v2", "deepseek-v3", "glm4-moe", "gpt-oss")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(family, scheme, backend, fmt=None, **example_kwargs) -> converted folder (built once)."""
    base = tmp_path_factory.mktemp("runtime")
    sources, outputs = {}, {}

    def make(family="qwen3-moe", scheme="bf16", backend="plain", fmt=None, cut=(), **kw):
        skey = (family, scheme, tuple(sorted(kw.items())))
        if skey not in sources:
            sources[skey] = make_example(base / f"src{len(sources)}", family, scheme, **kw)
        okey = (skey, backend, fmt, cut)
        if okey not in outputs:
            out = base / f"out{len(outputs)}"
            verb = ["quantize", sources[skey], out, "--format", fmt] if fmt else ["repack", sources[skey], out]
            cli(*verb, "--backend", backend, *cut, expect=0)
            outputs[okey] = out
        return outputs[okey]

    make.source = lambda family="qwen3-moe", scheme="bf16", **kw: sources[(family, scheme, tuple(sorted(kw.items())))]
    return make


def quiet_load(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        return load(*args, **kw)


def hf_block(src, index):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    return model.model.layers[index].mlp


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------------------------------------------
# against transformers' own MoE block


# Large activations make the routing decisive and the activations nonlinear (gpt-oss: past its clamp).
X_SCALE = {"gpt-oss": 40.0}


@pytest.mark.parametrize("family", FAMILIES)
def test_block_equals_transformers_moe_block(made, family):
    out = made(family, "bf16", "plain")
    model = load(out, device="cpu")
    layer = next(iter(model))
    assert layer.kernel == "reference" and layer.kernel_note is None  # plain is the reference's own layout
    block = hf_block(made.source(family, "bf16"), layer.entry.index)
    x = torch.randn(3, 7, layer.hidden_size, generator=torch.Generator().manual_seed(1)) * X_SCALE.get(family, 8.0)
    if layer.router.e_score_correction_bias is not None:
        # the example's N(0, 0.02) bias rarely changes a choice: give both the same decisive one
        bias = torch.randn(layer.num_experts, generator=torch.Generator().manual_seed(7)) * 0.3
        layer.router.e_score_correction_bias = bias
        block.gate.e_score_correction_bias.copy_(bias)
    with torch.no_grad():
        theirs = block(x)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs  # gpt-oss also returns its router scores
        router = getattr(block, "gate", None) or block.router
        _, their_w, their_ids = router(x.reshape(-1, layer.hidden_size))
    ours = layer.block(x)
    assert ours.shape == theirs.shape
    assert rel(ours, theirs) < 1e-5, family
    w, ids = layer.route(layer.router_logits(x))
    order = lambda i, v: torch.gather(v, 1, torch.sort(i, 1).indices)  # unsorted top-k: compare as sets
    assert torch.equal(torch.sort(ids, 1).values, torch.sort(their_ids.to(torch.int32), 1).values)
    torch.testing.assert_close(order(ids, w), order(their_ids, their_w.float()), rtol=1e-5, atol=1e-7)
    if family == "gpt-oss":  # the clamp was exercised, so the test tells clamped swiglu from plain swiglu
        h = x.reshape(-1, layer.hidden_size) @ layer.dequantized().w13[0].T
        assert float(h.abs().max()) > 7.0


def test_routing_parameters_come_from_config_and_matter(made):
    """DeepSeek-V3: the correction bias, groups and scaling factor are read and used."""
    layer = next(iter(load(made("deepseek-v3", "bf16", "plain"), device="cpu")))
    cfg = layer.router.config
    assert (cfg.method, cfg.n_group, cfg.topk_group, cfg.renormalize) == ("grouped", 2, 1, True)
    assert layer.router.e_score_correction_bias is not None
    logits = torch.randn(64, layer.num_experts, generator=torch.Generator().manual_seed(0))
    w, ids = layer.route(logits)
    assert torch.allclose(w.sum(1), torch.full((64,), cfg.routed_scaling_factor))
    groups = ids // (layer.num_experts // cfg.n_group)
    assert torch.equal(groups[:, 0], groups[:, 1])  # one group kept per token
    w3, ids3 = layer.route(logits, top_k=3, renormalize=False)
    assert ids3.shape == (64, 3) and not torch.allclose(w3.sum(1), w.sum(1))


def test_mixtral_renormalizes_and_qwen3_follows_norm_topk_prob(made):
    mix = next(iter(load(made("mixtral", "bf16", "plain"), device="cpu")))
    assert mix.router.config.renormalize is True
    logits = torch.randn(5, mix.num_experts)
    w, _ = mix.route(logits)
    assert torch.allclose(w.sum(1), torch.ones(5))
    w, _ = mix.route(logits, renormalize=False)
    assert (w.sum(1) < 1).all()


def test_gpt_oss_mxfp4_layer_equals_transformers_experts_on_the_dequantized_weights(made):
    """The MXFP4 path (padding, gate/up order, biases, clamped swiglu) against transformers' GptOssExperts
    holding the same (dequantized) weights."""
    out = made("gpt-oss", "bf16", "plain", fmt="mxfp4", intermediate_size=80)  # I=80 is padded to 96
    layer = next(iter(load(out, device="cpu")))
    assert layer.entry.intermediate_size_padded == 96
    block = hf_block(made.source("gpt-oss", "bf16", intermediate_size=80), layer.entry.index)
    d = layer.dequantized()
    I, Ip, H = 80, 96, layer.hidden_size
    gate, up = d.w13[:, :I, :H], d.w13[:, Ip:Ip + I, :H]
    with torch.no_grad():
        ex = block.experts
        ex.gate_up_proj.copy_(torch.stack([gate, up], 2).reshape(-1, 2 * I, H).transpose(1, 2))
        ex.gate_up_proj_bias.copy_(torch.stack([d.w13_bias[:, :I], d.w13_bias[:, Ip:Ip + I]], 2).reshape(-1, 2 * I))
        ex.down_proj.copy_(d.w2[:, :H, :I].transpose(1, 2))
        ex.down_proj_bias.copy_(d.w2_bias[:, :H])
        x = torch.randn(21, H, generator=torch.Generator().manual_seed(2)) * 40
        theirs, _ = block(x[None])
    assert rel(layer.block(x), theirs[0]) < 1e-5


# ---------------------------------------------------------------------------------------------------
# every layout gives the plain layout's output


WNA16 = [  # (example kwargs, backends)
    (dict(scheme="w4a16", group_size=32, intermediate_size=256), ("marlin", "triton", "emulation", "flashinfer-trtllm")),
    (dict(scheme="w4a16", symmetric=False), ("marlin", "triton", "emulation")),
    (dict(scheme="w8a16"), ("marlin", "triton")),
    (dict(scheme="w4a16", group_size=-1), ("marlin",)),
]
MXFP4_BACKENDS = ("emulation", "marlin", "flashinfer-cutlass", "flashinfer-trtllm", "triton")


def _compare_layouts(made, family, kw, backends, fmt=None, tol=0.0):
    base = load(made(family, backend="plain", fmt=fmt, **kw), device="cpu")
    x = torch.randn(33, base[next(iter(base.moe_layers))].hidden_size, generator=torch.Generator().manual_seed(3))
    x = (x * 4).to(torch.bfloat16)
    for backend in backends:
        dispatch._SAID.clear()
        with pytest.warns(KernelFallbackWarning, match=f"'{backend}' layout"):
            model = load(made(family, backend=backend, fmt=fmt, **kw), device="cpu")
        assert model.manifest["layout"]["name"] == backend
        for ref_layer, layer in zip(base, model):
            assert layer.kernel == "reference" and layer.kernel_note  # the layout's own kernel cannot run on CPU
            w, ids = ref_layer.route(ref_layer.router_logits(x))
            want, got = ref_layer(x, w, ids), layer(x, w, ids)
            assert got.dtype == torch.bfloat16 and got.shape == x.shape
            if tol == 0.0:
                assert torch.equal(got, want), (backend, layer.prefix)
            else:
                assert rel(got, want) < tol, (backend, layer.prefix)


@pytest.mark.parametrize("kw,backends", WNA16, ids=["w4-g32-sym", "w4-g128-asym", "w8-g128", "w4-channel"])
def test_wna16_layouts_compute_what_plain_computes(made, kw, backends):
    exact = tuple(b for b in backends if b != "emulation")
    _compare_layouts(made, "qwen3-moe", kw, exact)
    if "emulation" in backends:  # stores bf16(dequantized): one rounding of every weight
        _compare_layouts(made, "qwen3-moe", kw, ("emulation",), tol=1e-2)


@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss"])
def test_mxfp4_layouts_compute_what_plain_computes(made, family):
    _compare_layouts(made, family, dict(scheme="bf16"), MXFP4_BACKENDS, fmt="mxfp4", tol=1e-6)


def test_wna16_block_equals_transformers_on_the_compressed_tensors_checkpoint(made):
    """The dequantization rule and quantized shared experts against a second consumer: transformers'
    compressed-tensors integration loads the DeepSeek-V3 w4a16 checkpoint (experts and shared experts
    packed; router and correction bias float) and decompresses it on its first forward."""
    from transformers import AutoModelForCausalLM

    out = made("deepseek-v3", "w4a16", "marlin", group_size=32)
    layer = next(iter(quiet_load(out, device="cpu")))
    assert any(n.endswith("weight_packed") for n in layer.entry.shared)
    hf = AutoModelForCausalLM.from_pretrained(made.source("deepseek-v3", "w4a16", group_size=32))
    with torch.no_grad():
        hf(torch.tensor([[1, 2, 3]]))  # decompresses the Linears (to bf16)
        block = hf.model.layers[layer.entry.index].mlp.float()
        x = torch.randn(2, 9, layer.hidden_size, generator=torch.Generator().manual_seed(4)) * 8
        theirs = block(x)
    # transformers holds each dequantized weight rounded to bf16; the reference keeps fp32 (~3e-3)
    assert rel(layer.block(x), theirs) < 1e-2


# ---------------------------------------------------------------------------------------------------
# partitions


@pytest.mark.parametrize("cut", [("--tp-size", 2), ("--ep-size", 2)], ids=["tp2", "ep2"])
def test_ranks_add_up_to_the_uncut_layer(made, cut):
    kw = dict(scheme="w4a16", group_size=32)
    whole = next(iter(quiet_load(made("qwen3-moe", backend="marlin", **kw), device="cpu")))
    x = (torch.randn(17, whole.hidden_size, generator=torch.Generator().manual_seed(5)) * 4).to(torch.bfloat16)
    w, ids = whole.route(whole.router_logits(x))
    total = torch.zeros(x.shape)
    key = cut[0].lstrip("-").replace("-", "_").replace("size", "rank")
    for rank in range(2):
        out = made("qwen3-moe", backend="marlin", cut=(*cut, f"--{key.replace('_', '-')}", rank), **kw)
        part = quiet_load(out, device="cpu", **{key: rank})
        layer = part[whole.prefix]
        total += layer.reference(x.float(), w, ids)
        if cut[0] == "--tp-size":
            assert layer.entry.intermediate_size == whole.entry.intermediate_size // 2
            with pytest.raises(Exception, match="TP 1, EP 1"):
                layer.block(x)
        else:
            assert layer.entry.num_experts == whole.num_experts // 2
    assert rel(total, whole.reference(x.float(), w, ids)) < 1e-5


# ---------------------------------------------------------------------------------------------------
# the model object


def test_load_selects_layers_and_reads_other_tensors(made):
    out = made("qwen3-moe", "bf16", "plain")
    model = load(out, device="cpu", layers=[1])
    assert list(model.moe_layers) == ["model.layers.1.mlp.experts"]
    assert model[1] is model["model.layers.1.mlp.experts"]
    emb = model.tensor("model.embed_tokens.weight")
    assert emb.dtype == torch.bfloat16 and emb.shape[1] == model[1].hidden_size
    d = model.describe()
    assert d["layers"][0]["kernel"] == "reference" and d["layers"][0]["routing"]["method"] == "softmax"
    assert "kernel='reference'" in repr(model[1])
    # loaded bytes are the file's bytes
    from safetensors import safe_open

    with safe_open(out / "model-00001-of-00001.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.1.mlp.experts.w13_weight"), model[1].tensors["w13_weight"])


def test_kernel_override(made, monkeypatch):
    out = made("qwen3-moe", "w4a16", "marlin", group_size=32)
    layer = next(iter(load(out, device="cpu", kernel="reference")))
    assert layer.kernel == "reference" and layer.kernel_note is None
    monkeypatch.setenv("MOECONVERT_KERNEL", "reference")
    assert next(iter(load(out, device="cpu"))).kernel == "reference"


# ---------------------------------------------------------------------------------------------------
# Kimi-K3's SITU


@pytest.mark.parametrize("linear_beta", [None, 4.0])
def test_situ_is_vllms_situ_and_mul(linear_beta, vllm_version):
    """The runtime's SITU against vLLM's own ``SituAndMul.forward_native`` (run from that version's source on
    the CPU), over values where both tanh clips bite (|gate| >> beta, |up| >> linear_beta)."""
    from moeconvert.runtime.reference import activation_fn

    from helpers import vllm_situ_and_mul

    theirs = vllm_situ_and_mul(vllm_version)
    x = torch.randn(64, 2 * 48, generator=torch.Generator().manual_seed(5)) * 6
    params = {"beta": 0.75} | ({} if linear_beta is None else {"linear_beta": linear_beta})
    ours = activation_fn("situ", params)(x[:, :48], x[:, 48:])
    assert torch.equal(ours, theirs(x, 0.75, linear_beta))


def test_swiglustep_is_vllms_swiglustep_and_mul(vllm_version):
    """Step-3.5's clamped SwiGLU against vLLM's own ``SwigluStepAndMul.forward_native`` (the function its
    fused-MoE ``swiglustep_and_mul_triton`` computes), over values where both clamps bite."""
    from moeconvert.runtime.reference import activation_fn

    from helpers import vllm_swiglustep_and_mul

    theirs = vllm_swiglustep_and_mul(vllm_version)
    x = torch.randn(64, 2 * 48, generator=torch.Generator().manual_seed(6)) * 20
    ours = activation_fn("swiglustep", {"limit": 7.0})(x[:, :48], x[:, 48:])
    assert torch.equal(ours, theirs(x, 7.0))
    assert not torch.equal(ours, activation_fn("silu", {})(x[:, :48], x[:, 48:]))  # the clamp changed something


def test_kimi_k3_block_on_marlin_equals_vllms_situ_on_compressed_tensors_weights(kimi_k3_ckpt, tmp_path):
    """The tiny compressed-tensors MXFP4 Kimi-K3, repacked to marlin and loaded: each MoE layer gives
    sum_k w_k * down(SituAndMul(gate_up(x))) computed from compressed-tensors' own decompression of the
    source's experts and vLLM 0.33.0's ``SituAndMul`` (beta 1, linear_beta 4 from the config)."""
    from compressed_tensors.compressors import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    from helpers import VLLM_VERSION, vllm_situ_and_mul

    situ = vllm_situ_and_mul(VLLM_VERSION)
    src, out = kimi_k3_ckpt("mxfp4"), tmp_path / "out"
    cli("repack", str(src), str(out), "--backend", "marlin", expect=0)
    tensors = load_file(src / "model.safetensors")
    scheme = preset_name_to_scheme("MXFP4", ["Linear"])

    def weight(module):
        state = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
        return MXFP4PackedCompressor.decompress(state, scheme)["weight"].float()

    dispatch._SAID.clear()
    with pytest.warns(KernelFallbackWarning):  # Marlin's own kernel needs a GPU: the reference reads the layout
        model = load(out, device="cpu")
    gen = torch.Generator().manual_seed(7)
    for layer in model:
        E, H = layer.num_experts, layer.hidden_size
        x = (torch.randn(9, H, generator=gen) * 10).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(9)])
        w = torch.rand(9, 2, generator=gen)
        got = layer(x, w, ids)
        want = torch.zeros(9, H)
        for e in range(E):
            q = f"{layer.prefix}.{e}"
            w13 = torch.cat([weight(f"{q}.w1"), weight(f"{q}.w3")])
            y = situ(x.float() @ w13.T, 1.0, 4.0) @ weight(f"{q}.w2").T
            want += (w * (ids == e)).sum(1, keepdim=True) * y
        assert got.dtype == torch.bfloat16
        assert rel(got, want) < 1e-2, layer.prefix  # one bf16 rounding of the output
