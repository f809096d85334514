"""The ``humming`` layout for MXFP4 experts (docs/layouts/humming.md, "MXFP4"): vLLM 0.33.0's HUMMING memory
for ``Mxfp4MoEMethod`` layers on SM90 with 16-bit activations.

CPU: hand-computed words and scale positions; humming-kernels 0.1.19's own Python run end to end as vLLM
0.33.0 calls it (``Mxfp4WeightSchema.convert_humming``, then ``prepare_and_transform_humming_tensors``),
its one CUDA op (the weight repack) replaced by test_layout_humming.py's scalar transcription of the kernel;
``quantize --format mxfp4 --backend humming`` end to end. GPU (``-m gpu``): humming's CUDA transform,
called as vLLM calls it, byte-identical to encode.
"""

from __future__ import annotations

import json

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import get_layout
from moeconvert.layouts import humming as hl
from moeconvert.layouts import humming_mxfp4 as hm
from moeconvert.schemes import MXFP4Scheme

from factories import mxfp4_block
from test_layout_humming import humming_cpu, kernel_transcription  # noqa: F401 (a fixture)

MX = MXFP4Scheme()


def layout():
    return get_layout("humming", "mxfp4")


def shape_of(E, H, Ip, bias=False, **kw):
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=Ip, has_bias=bias, **kw)


def block_of(E: int, H: int, Ip: int, seed: int = 0, bias: bool = False, I: int | None = None) -> ExpertBlock:
    """Random e2m1 bytes and e8m0 scale bytes near 1; with ``I`` < Ip, w13 rows ``[gate | 0 | up | 0]`` and w2's
    K columns beyond I zero, with scale byte 0, as vLLM's zero-initialised parameters hold them."""
    kw = mxfp4_block(E, H, Ip, bias, seed=seed, scales=(110, 135)).tensors()
    if I is not None and I < Ip:
        for name in ("w13", "w13_scale") + (("w13_bias",) if bias else ()):
            kw[name][:, I:Ip] = 0
            kw[name][:, Ip + I:] = 0
        kw["w2"][:, :, I // 2:] = 0
        kw["w2_scale"][:, :, I // 32:] = 0
    return ExpertBlock(scheme=MX, **kw)


def test_registered_under_humming_for_mxfp4():
    assert type(layout()).__name__ == "HummingMXFP4Layout"
    assert type(get_layout("humming", "wna16")).__name__ == "HummingLayout"
    assert layout().pad_multiples == (1, 64)


@pytest.mark.parametrize("change,needle", [
    (dict(dtype="float16"), "model dtype = float16: vLLM 0.33.0's mxfp4 quantization runs bfloat16 models only"),
    (dict(activation="swigluoai"), "activation swigluoai (gpt-oss)"),
    (dict(intermediate_size=96), "intermediate_size Ip = 96 (per TP partition) must be a multiple of 64"),
    (dict(hidden_size=144), "hidden_size H = 144 must be a multiple of the MXFP4 block 32"),
])
def test_check_refuses_what_vllms_humming_path_never_holds(change, needle):
    shape = shape_of(2, 256, 128)
    assert layout().check(shape, MX) == []
    for k, v in change.items():
        setattr(shape, k, v)
    problems = layout().check(shape, MX)
    assert len(problems) == 1 and problems[0].startswith(needle), problems


@pytest.mark.parametrize("E,H,Ip,bias", [(2, 160, 64, True), (1, 256, 128, False), (3, 512, 192, True)])
def test_decode_encode_is_identity(E, H, Ip, bias):
    block = block_of(E, H, Ip, seed=E, bias=bias, I=Ip - 32 if Ip > 64 else None)
    shape = shape_of(E, H, Ip, bias)
    enc = layout().encode(block, shape)
    assert [(k, tuple(v.shape), v.dtype) for k, v in enc.items()] == \
        [(s.suffix, s.shape, s.dtype) for s in layout().plan(shape, MX)]
    assert not layout().expected_block(block, shape).differences(layout().decode(enc, shape, MX))


def test_golden_words_and_scale_positions():
    """By hand from docs/layouts/humming.md: one expert, H = 128, Ip = 64. w13: N = 128 of 256 padded rows,
    K = 128; every byte 0x53 (nibbles 3, 5 alternating along K: k even 3, k odd 5). A word holds 8 fields
    of one row n, k = 64 kb + 8 (2 i1 + i5) + 2 (t mod 4) + i6 with i6 = r mod 2, r = 2 (q mod 4) + q div 4:
    fields q < 4 have i6 = 0 (k even: 3), q >= 4 have i6 = 1 (5): 0x55553333. Padded rows hold 0 words.
    Scales: byte (n, g) lands at column 64 (n div 64) + 8 (n mod 8) + (n mod 64) div 8 of row g; padded
    rows (n >= 128) hold 127, e8m0's 1.0, as humming pads them."""
    E, H, Ip = 1, 128, 64
    w13 = torch.full((E, 2 * Ip, H // 2), 0x53, dtype=torch.uint8)
    w13_scale = torch.full((E, 2 * Ip, H // 32), 120, dtype=torch.uint8)
    w13_scale[0, 10, 1] = 200
    w13_scale[0, 77, 3] = 201
    block = ExpertBlock(scheme=MX, w13=w13, w13_scale=w13_scale,
                        w2=torch.zeros(E, H, Ip // 2, dtype=torch.uint8),
                        w2_scale=torch.zeros(E, H, 2, dtype=torch.uint8))
    enc = layout().encode(block, shape_of(E, H, Ip))
    words = (enc["w13_weight"].to(torch.int64) & 0xFFFFFFFF)
    assert enc["w13_weight"].shape == (1, 128 // 16, 2 * 256)
    assert words.flatten().unique().tolist() == [0, 0x55553333]
    # columns 32 b nb + b t + w: n-tiles nb = 0, 1 (columns 0..255) hold rows 0..127, nb = 2, 3 padding
    assert bool((words[..., :256] == 0x55553333).all()) and bool((words[..., 256:] == 0).all())
    s = enc["w13_weight_scale"].view(torch.uint8)
    assert s.shape == (1, 4, 256)
    assert int(s[0, 1, 8 * 2 + 1]) == 200  # n = 10: 64*0 + 8*2 + 1
    assert int(s[0, 3, 64 + 8 * 5 + 1]) == 201  # n = 77: 64*1 + 8*5 + 1
    assert bool((s[0, :, 128:] == 127).all())  # padded rows: humming's e8m0 pad value 1.0
    assert int((s[0, :, :128] == 120).sum()) == 4 * 128 - 2
    # w2: K = 64 padded to 128 by humming, scale groups 2 -> 4: the padded groups hold 127, the real ones 0
    s2 = enc["w2_weight_scale"].view(torch.uint8)
    assert s2.shape == (1, 4, 256)
    assert bool((s2[0, :2, :128] == 0).all()) and bool((s2[0, 2:] == 127).all()) and bool((s2[0, :, 128:] == 127).all())


def test_bias_is_padded_with_zeros_and_cycled_in_32s():
    E, H, Ip = 1, 128, 64
    block = block_of(E, H, Ip, bias=True)
    block.w13_bias[:] = torch.arange(2 * Ip, dtype=torch.bfloat16) + 1
    enc = layout().encode(block, shape_of(E, H, Ip, bias=True))
    b = enc["w13_bias"][0].float()
    # out[c] = in[32 (c div 32) + 2 ((c mod 32) div 8) + [0,1,8,9,16,17,24,25][c mod 8]]
    assert b[:8].tolist() == [1, 2, 9, 10, 17, 18, 25, 26] and b[8:10].tolist() == [3, 4]
    assert bool((b[128:] == 0).all())


# ---------------------------------------------------------------------------------------------------
# humming's own Python as the oracle, its weight repack replaced by the scalar kernel transcription


def _fake_repack(calls: list):
    """``ops.repack_weight`` as the CUDA kernel computes it for the arguments vLLM's MXFP4 path passes: it
    refuses any flag this layout does not reproduce (int2fp shift, zero points, fused e8m0, packed-K, native
    dequant, another interleave), so a change of path in humming fails here rather than passing."""
    from moeconvert.packing import unpack_int32

    def repack_weight(inputs, zero_point, weight_bits, activation_bits, is_weight_packed,
                      should_preprocess_for_int2fp, should_preprocess_with_zp, interleave_mode,
                      use_fused_e8m0_scale, group_size_zp, use_packed_k_layout, use_native_dequant):
        calls.append(dict(weight_bits=weight_bits, activation_bits=activation_bits, packed=is_weight_packed,
                          int2fp=should_preprocess_for_int2fp, zp=zero_point is not None or should_preprocess_with_zp,
                          interleave_mode=interleave_mode, fused_e8m0=use_fused_e8m0_scale,
                          packed_k=use_packed_k_layout, native=use_native_dequant, group_size_zp=group_size_zp))
        E, Np, W = inputs.shape
        fields = unpack_int32(inputs, weight_bits, W * 32 // weight_bits).to(torch.uint8)
        return kernel_transcription(fields, weight_bits)

    return repack_weight


def hummings_transform(mods, block: ExpertBlock, shape: LayerShape, monkeypatch):
    """Each sublayer through humming's Python as vLLM 0.33.0's ``convert_to_humming_moe_kernel_format`` runs it
    for ``{"quant_method": "mxfp4"}``: the layer's uint8 weight and scale parameters (bias bfloat16),
    ``convert_humming`` with the gate/up stacks, 16-bit input schema, ``prepare_and_transform_humming_tensors``
    padding N to 256 and K to 128. Returns ({sub: tensors}, {sub: LayerConfig}, repack calls)."""
    from humming.schema import BaseWeightSchema, HummingInputSchema

    calls: list = []
    monkeypatch.setattr(mods["transform"].ops, "repack_weight", _fake_repack(calls), raising=False)
    E = block.num_experts
    outs, configs = {}, {}
    for sub, d in hm.sublayers(shape).items():
        tensors = {"weight": getattr(block, sub).clone(), "weight_scale": getattr(block, f"{sub}_scale").clone()}
        if block.w13_bias is not None:
            tensors["bias"] = getattr(block, f"{sub}_bias").to(torch.bfloat16)
        ws = BaseWeightSchema.from_config({"quant_method": "mxfp4"})
        stacks = [d.N // 2] * 2 if sub == "w13" else [d.N]
        # device -1: convert_humming's ``torch.cuda.device`` context, a no-op without a GPU (vLLM passes none)
        hs, converted = ws.convert_humming(tensors=tensors, shape_n_stacks=stacks, shape_k_stacks=[d.K],
                                           param_dtype=torch.bfloat16, num_experts=E, device=-1)
        cfg, out = mods["transform"].prepare_and_transform_humming_tensors(
            tensors=converted, shape_n=d.N, shape_k=d.K, pad_n_to_multiple=256, pad_k_to_multiple=128,
            input_schema=HummingInputSchema(), weight_schema=hs, has_bias=block.w13_bias is not None,
            num_experts=E, torch_dtype=torch.bfloat16, device=None)
        outs[sub], configs[sub] = out, cfg
    return outs, configs, calls


CPU_CASES = [(2, 160, 64, True, None), (1, 256, 128, False, 96), (2, 384, 192, True, 160)]


@pytest.mark.parametrize("E,H,Ip,bias,I", CPU_CASES)
def test_encode_equals_hummings_python(humming_cpu, monkeypatch, E, H, Ip, bias, I):  # noqa: F811
    block = block_of(E, H, Ip, seed=H, bias=bias, I=I)
    shape = shape_of(E, H, Ip, bias)
    ours = layout().encode(block, shape)
    theirs, configs, calls = hummings_transform(humming_cpu, block, shape, monkeypatch)
    assert calls == [dict(weight_bits=4, activation_bits=16, packed=True, int2fp=False, zp=False, interleave_mode=3,
                          fused_e8m0=False, packed_k=False, native=False, group_size_zp=0)] * 2
    for sub in hm.SUBLAYERS:
        names = hm.NAMES[sub]
        assert set(theirs[sub]) == {"weight", "weight_scale"} | ({"bias"} if bias else set())
        for theirs_name, mine in (("weight", names.weight), ("weight_scale", names.weight_scale), ("bias", names.bias)):
            if theirs_name not in theirs[sub]:
                continue
            a, b = theirs[sub][theirs_name], ours[mine]
            assert (tuple(a.shape), a.dtype) == (tuple(b.shape), b.dtype), (sub, theirs_name)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (sub, theirs_name)


@pytest.mark.parametrize("E,H,Ip,bias,I", CPU_CASES[:2])
def test_layer_metadata_is_hummings_layer_config(humming_cpu, monkeypatch, E, H, Ip, bias, I):  # noqa: F811
    """The manifest's per-sublayer fields are the LayerConfig humming's transform made, and the config a loader
    rebuilds from them (``humming_sublayers``, humming's prepare_layer_config) equals it field by field."""
    block = block_of(E, H, Ip, bias=bias, I=I)
    shape = shape_of(E, H, Ip, bias)
    _, configs, _ = hummings_transform(humming_cpu, block, shape, monkeypatch)
    meta = layout().layer_metadata(shape, MX)
    for sub, cfg in configs.items():
        for key in hl.CONFIG_FIELDS + ("num_experts",):
            assert meta[sub][key] == hl.config_value(cfg, key), (sub, key)
    rebuilt = layout().humming_sublayers(meta, MX, hidden_size=H, intermediate_size=Ip, num_experts=E, has_bias=bias,
                                         dtype=torch.bfloat16)
    for sub, cfg in configs.items():
        assert rebuilt[sub].config == cfg, sub
        assert str(rebuilt[sub].weight_schema.b_dtype) == "float4e2m1"
    # a folder whose fields say otherwise is refused in one line naming them
    meta["w2"]["shape_k"] = 64
    from moeconvert.errors import MoeConvertError
    with pytest.raises(MoeConvertError, match=r"^w2: humming's LayerConfig for this layer differs from the folder's "
                                              r"\(shape_k 128 here, 64 in the folder\)$"):
        layout().humming_sublayers(meta, MX, hidden_size=H, intermediate_size=Ip, num_experts=E, has_bias=bias,
                                   dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------------
# end to end: moeconvert quantize --format mxfp4 --backend humming


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    pytest.importorskip("transformers")
    from moeconvert.example import make_example

    return make_example(tmp_path_factory.mktemp("q") / "ckpt", "qwen3-moe", "bf16", num_experts=4,
                        hidden_size=256, intermediate_size=80, num_layers=2)


def test_quantize_writes_the_layout_and_verify_requantizes_it(qwen, tmp_path):
    """I = 80 is padded to 128 (vLLM's 64-multiple for HUMMING); the file's bytes are encode of the block the
    plain layout's file holds re-padded (both are vLLM's quantization of the same weights)."""
    from helpers import cli, st_tensors

    out, plain = tmp_path / "out", tmp_path / "plain"
    cli("quantize", str(qwen), str(out), "--format", "mxfp4", "--backend", "humming", expect=0)
    cli("verify", str(out), "--against", str(qwen), expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())
    layer = manifest["moe_layers"][0]
    assert (layer["intermediate_size"], layer["intermediate_size_padded"]) == (80, 128)
    assert manifest["layout"]["name"] == "humming" and manifest["layout"]["made_for"]["humming-kernels"] == "0.1.19"
    meta = layer["layout_metadata"]
    assert (meta["w13"]["shape_n"], meta["w13"]["pad_shape_n"], meta["w2"]["shape_k"], meta["w2"]["pad_shape_k"]) == \
        (256, 0, 128, 0)
    assert meta["w13"]["b_dtype"] == "float4e2m1" and meta["w13"]["bs_dtype"] == "float8e8m0"
    # the plain layout holds the same quantization unswizzled, padded to 32-multiples (I -> 96)
    cli("quantize", str(qwen), str(plain), "--format", "mxfp4", "--backend", "plain", expect=0)
    got, ref = st_tensors(out), st_tensors(plain)
    prefix = layer["prefix"]
    from moeconvert.quantize import _pad_k, _pad_rows

    p13 = ref[f"{prefix}.w13_weight"]
    E = p13.shape[0]
    unpad13 = torch.cat([p13[:, :80], p13[:, 96:176]], 1)
    s13 = ref[f"{prefix}.w13_weight_scale"]
    unpad13s = torch.cat([s13[:, :80], s13[:, 96:176]], 1)
    block = ExpertBlock(scheme=MX, w13=_pad_rows(unpad13, 80, 128),
                        w13_scale=_pad_rows(unpad13s.view(torch.uint8), 80, 128),
                        w2=_pad_k(ref[f"{prefix}.w2_weight"][..., :40], 64),
                        w2_scale=_pad_k(ref[f"{prefix}.w2_weight_scale"].view(torch.uint8)[..., :80 // 32], 4))
    # 80 is not a whole number of 32-blocks: w2's third block (k 64..95) is partly padding in both files
    block.w2_scale[..., 2] = ref[f"{prefix}.w2_weight_scale"].view(torch.uint8)[..., 2]
    block.w2[..., 32:40] = ref[f"{prefix}.w2_weight"][..., 32:40]
    want = layout().encode(block, shape_of(E, 256, 128))
    for name, t in want.items():
        assert torch.equal(got[f"{prefix}.{name}"].view(torch.uint8), t.view(torch.uint8)), name


def test_quantize_refuses_float16_in_one_line(qwen, tmp_path):
    from helpers import cli

    out = tmp_path / "out"
    r = cli("quantize", str(qwen), str(out), "--format", "mxfp4", "--backend", "humming", "--dtype", "float16",
            expect=2)
    lines = [ln for ln in r.err.strip().splitlines() if ln]
    assert len(lines) == 1 and "vLLM 0.33.0's mxfp4 quantization runs bfloat16 models only" in lines[0], r.err
    assert not (out / "moeconvert.json").exists()


# ---------------------------------------------------------------------------------------------------
# GPU: humming's CUDA transform, as vLLM 0.33.0 calls it for Mxfp4MoEMethod's HUMMING backend


@pytest.mark.gpu
@pytest.mark.parametrize("E,H,Ip,bias,I", [(2, 160, 64, False, None), (2, 160, 64, True, None),
                                           (3, 384, 192, True, 160), (2, 2048, 768, False, None)])
def test_encode_equals_hummings_cuda_transform(E, H, Ip, bias, I):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (humming's weight repack is a CUDA kernel)")
    pytest.importorskip("humming")
    from humming.schema import BaseWeightSchema, HummingInputSchema
    from humming.transform import prepare_and_transform_humming_tensors

    block = block_of(E, H, Ip, seed=E + H, bias=bias, I=I)
    shape = shape_of(E, H, Ip, bias)
    ours = layout().encode(block, shape)
    meta = layout().layer_metadata(shape, MX)
    for sub, d in hm.sublayers(shape).items():
        tensors = {"weight": getattr(block, sub).cuda(), "weight_scale": getattr(block, f"{sub}_scale").cuda()}
        if bias:
            tensors["bias"] = getattr(block, f"{sub}_bias").to(torch.bfloat16).cuda()
        ws = BaseWeightSchema.from_config({"quant_method": "mxfp4"})
        stacks = [d.N // 2] * 2 if sub == "w13" else [d.N]
        hs, converted = ws.convert_humming(tensors=tensors, shape_n_stacks=stacks, shape_k_stacks=[d.K],
                                           param_dtype=torch.bfloat16, num_experts=E)
        cfg, out = prepare_and_transform_humming_tensors(
            tensors=converted, shape_n=d.N, shape_k=d.K, pad_n_to_multiple=256, pad_k_to_multiple=128,
            input_schema=HummingInputSchema(), weight_schema=hs, has_bias=bias, num_experts=E,
            torch_dtype=torch.bfloat16, device=torch.device("cuda"))
        if cfg.sm_version != 90:
            pytest.skip(f"the layout holds humming's SM90 bytes; this GPU is SM{cfg.sm_version}")
        for key in hl.CONFIG_FIELDS:
            assert meta[sub][key] == hl.config_value(cfg, key), (sub, key)
        names = hm.NAMES[sub]
        pairs = [("weight", names.weight), ("weight_scale", names.weight_scale)]
        pairs += [("bias", names.bias)] if bias else []
        assert set(out) == {p[0] for p in pairs}, (sub, set(out))
        for theirs, mine in pairs:
            a, b = out[theirs].cpu(), ours[mine]
            assert a.shape == b.shape and a.dtype == b.dtype, (sub, theirs, a.shape, b.shape, a.dtype, b.dtype)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (sub, theirs)


def test_gpt_oss_is_refused_in_one_line(tmp_path):
    """vLLM serves gpt-oss's MXFP4 experts with its gpt-oss method (triton_kernels on SM90), never this path."""
    pytest.importorskip("transformers")
    from helpers import cli
    from moeconvert.example import make_example

    src = make_example(tmp_path / "ckpt", "gpt-oss", "bf16", num_experts=4, hidden_size=256, intermediate_size=128,
                       num_layers=1)
    out = tmp_path / "out"
    r = cli("quantize", str(src), str(out), "--format", "mxfp4", "--backend", "humming", expect=2)
    lines = [ln for ln in r.err.strip().splitlines() if ln]
    assert len(lines) == 1 and "activation swigluoai (gpt-oss)" in lines[0] and "--backend triton" in lines[0], r.err
    assert not out.exists() or not (out / "moeconvert.json").exists()

