"""GPU: the runtime dispatches ``marlin`` outputs to vLLM's Marlin MoE kernel, and it matches the reference.

Run on the device machine (CUDA + vLLM 0.33.0's ``_moe_C`` library)::

    MOECONVERT_VLLM_MOE_LIB=/path/to/vllm/_moe_C_stable_libtorch.abi3.so python -m pytest -q -s -m gpu tests/test_runtime_gpu.py

Skipped cleanly without CUDA or without the library. Fixtures are real checkpoints (transformers +
compressed-tensors) converted by the CLI; the reference is ``layer.reference`` (decode, dequantize,
matmul in fp32) on the same device.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moeconvert.example import make_example

from helpers import cli, kernel_and_reference, rel

pytestmark = pytest.mark.gpu


def _require_marlin():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from moeconvert.runtime import vllm_marlin

    path, where = vllm_marlin.find_library()
    if path is None:
        pytest.skip(f"vLLM's MoE library not found ({where}); set MOECONVERT_VLLM_MOE_LIB")
    why = vllm_marlin.unavailable_reason(torch.device("cuda", torch.cuda.current_device()), {"vllm": "0.33.0"})
    if why:
        pytest.skip(f"vLLM's Marlin MoE cannot run here: {why}")


CASES = {
    # name: (family, example kwargs, quantize --format or None)
    "int4-sym-g128": ("qwen3-moe", dict(scheme="w4a16", group_size=128), None),
    "int4-sym-g32": ("qwen3-moe", dict(scheme="w4a16", group_size=32, intermediate_size=96), None),  # padded I
    "int4-asym-g128": ("qwen3-moe", dict(scheme="w4a16", symmetric=False), None),
    "int4-asym-channel": ("qwen3-moe", dict(scheme="w4a16", group_size=-1, symmetric=False), None),
    "int8-g128": ("qwen3-moe", dict(scheme="w8a16"), None),
    "int8-channel": ("qwen3-moe", dict(scheme="w8a16", group_size=-1), None),
    "int4-deepseek-v3": ("deepseek-v3", dict(scheme="w4a16", group_size=32), None),
    "mxfp4-silu": ("qwen3-moe", dict(scheme="bf16"), "mxfp4"),
    "mxfp4-gpt-oss": ("gpt-oss", dict(scheme="bf16", intermediate_size=80), "mxfp4"),  # swigluoai, padded H, I
}


@pytest.fixture(scope="module")
def marlin_output(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            family, kw, fmt = CASES[name]
            kw = dict(kw)
            base = tmp_path_factory.mktemp(name)
            src = make_example(base / "src", family, kw.pop("scheme"), num_experts=8, **kw)
            if fmt == "mxfp4":
                cli("quantize", src, base / "out", "--format", "mxfp4", "--backend", "marlin", expect=0)
            else:
                cli("repack", src, base / "out", "--backend", "marlin", expect=0)
            made[name] = base / "out"
        return made[name]

    return make


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("M", [1, 7, 64, 300])
def test_marlin_dispatch_matches_the_reference(marlin_output, name, M):
    _require_marlin()
    from moeconvert.runtime import load

    model = load(marlin_output(name), device="cuda")
    dt = torch.bfloat16  # the examples' model dtype: Marlin's scales are in it
    for layer in model:
        assert layer.kernel == "vllm-marlin", layer.kernel_note
        x, got, want = kernel_and_reference(layer, M, dt)
        err = rel(got, want)
        print(f"\n{name} {layer.prefix} M={M}: vllm-marlin vs reference rel err {err:.2e}")
        assert got.shape == x.shape and got.dtype == dt
        assert err < 2e-2
        if layer.entry.num_experts == layer.entry.num_experts_global:
            assert rel(layer.block(x), _block_reference(layer, x)) < 2e-2


def _block_reference(layer, x):
    w, ids = layer.route(layer.router_logits(x))
    y = layer.reference(x, w, ids).float()
    if layer.shared is not None:
        y = y + layer.shared(x)
    return y


def test_override_to_reference_and_fallback_on_cpu(marlin_output):
    _require_marlin()
    from moeconvert.runtime import KernelFallbackWarning, load

    out = marlin_output("int4-sym-g128")
    assert next(iter(load(out, device="cuda", kernel="reference"))).kernel == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        assert next(iter(load(out, device="cpu"))).kernel == "reference"


def test_pinned_reader_gives_the_same_tensors(marlin_output):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from moeconvert.runtime import load

    out = marlin_output("int4-sym-g128")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = load(out, device="cuda", reader="direct", kernel="reference")
        b = load(out, device="cuda", reader="pinned", kernel="reference")
    for la, lb in zip(a, b):
        for k in la.tensors:
            assert torch.equal(la.tensors[k].view(torch.uint8), lb.tensors[k].view(torch.uint8)), k


@pytest.mark.parametrize("backend", ["marlin", "triton-fast"])
@pytest.mark.parametrize("M", [1, 7, 300])
def test_kimi_k3_situ_on_its_kernels_matches_the_reference(kimi_k3_ckpt, tmp_path_factory, backend, M):
    """Kimi-K3's SITU (beta 1, linear_beta 4) between the GEMMs of vLLM's Marlin and of our Triton kernel,
    from its compressed-tensors MXFP4 checkpoint; Kimi-K3's caller routes, so the ids are drawn."""
    if backend == "marlin":
        _require_marlin()
    elif not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from moeconvert.runtime import load

    out = tmp_path_factory.mktemp("k3") / "out"
    cli("repack", kimi_k3_ckpt("mxfp4"), out, "--backend", backend, expect=0)
    gen = torch.Generator(device="cuda").manual_seed(M)
    for layer in load(out, device="cuda"):
        assert layer.kernel == ("vllm-marlin" if backend == "marlin" else "triton"), layer.kernel_note
        x = (torch.randn(M, layer.hidden_size, device="cuda", generator=gen) * 10).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(layer.num_experts, device="cuda", generator=gen)[:2] for _ in range(M)])
        w = torch.rand(M, 2, device="cuda", generator=gen)
        assert rel(layer(x, w, ids.to(torch.int32)), layer.reference(x, w, ids)) < 2e-2


@pytest.mark.parametrize("backend", ["marlin", "humming"])
@pytest.mark.parametrize("M", [1, 300])
def test_step3p5_swiglustep_on_its_kernels_matches_the_reference(tmp_path_factory, backend, M):
    """Step-3.5's layers (silu on layer 1, swiglustep clamped at 7 on layer 2) between the GEMMs of vLLM's Marlin
    and of humming, quantized to MXFP4 from the tiny bf16 checkpoint; inputs large enough that the clamp bites."""
    if backend == "marlin":
        _require_marlin()
    elif not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from helpers import make_step3p5_checkpoint
    from moeconvert.runtime import load

    root = tmp_path_factory.mktemp("step3p5")
    src = make_step3p5_checkpoint(root / "src", H=256, I=128)
    cli("quantize", src, root / "out", "--format", "mxfp4", "--backend", backend, expect=0)
    gen = torch.Generator(device="cuda").manual_seed(M)
    for layer in load(root / "out", device="cuda"):
        assert layer.kernel == ("vllm-marlin" if backend == "marlin" else "humming"), layer.kernel_note
        x = (torch.randn(M, layer.hidden_size, device="cuda", generator=gen) * 40).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(layer.num_experts, device="cuda", generator=gen)[:2] for _ in range(M)])
        w = torch.rand(M, 2, device="cuda", generator=gen)
        assert rel(layer(x, w, ids.to(torch.int32)), layer.reference(x, w, ids)) < 2e-2, layer.prefix
