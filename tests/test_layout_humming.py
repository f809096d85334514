"""The ``humming`` layout (docs/layouts/humming.md): vLLM 0.33.0's HUMMING memory for WNA16 experts.

CPU: a line-by-line transcription of humming-kernels 0.1.19's ``weight_repack_nk`` (one thread at a time)
against the vectorised gather; humming's own Python (scale, zero-point and bias transforms, the
sign-magnitude choice) where it runs without CUDA (``MOECONVERT_HUMMING_SRC``: the wheel or a folder).
GPU (``-m gpu``): humming's CUDA transform, called as vLLM 0.33.0 calls it, byte-identical to encode.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import get_layout
from moeconvert.layouts import humming as hl
from moeconvert.schemes import WNA16Scheme

from factories import block_of

HUMMING_SRC = "MOECONVERT_HUMMING_SRC"


def sizes(g: int) -> tuple[int, int]:
    """H = 384 pads w2's N to 512; I = 192 pads w13's N to 512 and w2's K to 256 (I = 128 for g = 128)."""
    return 384, 128 if g == 128 else 192


def shape_of(E, H, I, bias=False, extra=None):
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, has_bias=bias, extra=extra or {})


# ---------------------------------------------------------------------------------------------------
# weight_repack_nk<B, 16, packed=1, int2fp, zp, transpose=0, gzp, 0, 0>, interleave_mode 3, one lane at a time


def kernel_transcription(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """The CUDA kernel's index arithmetic, scalar, for already-preprocessed fields [E, Np, Kp]."""
    E, Np, Kp = fields.shape
    f = fields.tolist()
    bp, per_word = bits, 32 // bits
    out_stride = 16 * Np * bits // 32
    out = [0] * (E * (Kp // 16) * out_stride)
    for bz in range(E):
        for bx in range(Np // 64):
            for by in range(Kp // 64):
                for lane in range(32):
                    tmp = [0] * 128  # [4][1][4][2][2][2]
                    for i in range(8):
                        row = bx * 64 + i * 8 + lane // 4
                        for j in range(8):
                            for k in range(2):
                                index = j * 8 + lane % 4 * 2 + k
                                v = f[bz][row][by * 64 + index]
                                i1, i3, i4, i5, i6 = j // 2, (i * 8) % 64 // 16, i % 2, j % 2, k
                                tmp[i1 * 32 + i3 * 8 + i4 * 4 + i5 * 2 + i6] = v
                    out_arr = [0] * (4 * bp)
                    for i in range(4):
                        for j in range(bp):
                            val = 0
                            for k in range(per_word):
                                group = per_word // 2
                                new_k = (k % group) * 2 + k // group
                                val |= (tmp[i * 32 + j * per_word + new_k] & ((1 << bits) - 1)) << (k * bp)
                            out_arr[i * bp + j] = val
                    col_offset = 16 * (64 * bx) * bits // 32
                    for i in range(4):
                        row = (by * 64 + bz * Kp) // 16 + i
                        for k in range(bits):
                            out[row * out_stride + col_offset + lane * bits + k] = out_arr[i * bits + k]
    t = torch.tensor(out, dtype=torch.int64)
    t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    return t.reshape(E, Kp // 16, out_stride)


@pytest.mark.parametrize("bits", [4, 8])
def test_gather_equals_the_kernel_transcription(bits):
    gen = torch.Generator().manual_seed(bits)
    fields = torch.randint(0, 1 << bits, (2, 128, 128), generator=gen, dtype=torch.uint8)
    assert torch.equal(hl.repack_weights(fields, bits), kernel_transcription(fields, bits))
    assert torch.equal(hl.unrepack_weights(hl.repack_weights(fields, bits), bits, 128, 128), fields)


def test_int2fp_and_sign_magnitude_by_hand():
    v = torch.tensor([0, 1, 127, 128, 129, 255], dtype=torch.uint8)
    assert hl.int2fp(v, torch.tensor(128), 8).tolist() == [255, 254, 128, 0, 1, 127]
    assert torch.equal(hl.un_int2fp(hl.int2fp(v, torch.tensor(128), 8), torch.tensor(128), 8), v)
    u = torch.arange(1, 16, dtype=torch.uint8)
    assert hl.to_sign_magnitude(u, 4).tolist() == [15, 14, 13, 12, 11, 10, 9, 0, 1, 2, 3, 4, 5, 6, 7]
    assert torch.equal(hl.from_sign_magnitude(hl.to_sign_magnitude(u, 4), 4), u)


SCHEMES = [WNA16Scheme(bits, g, sym, "bfloat16") for bits in (4, 8) for g in (32, 64, 128, -1) for sym in (True, False)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe().replace(" ", "-"))
@pytest.mark.parametrize("no_zero", [(), ("w13", "w2"), ("w2",)], ids=["zeros", "nozero", "w2-nozero"])
def test_roundtrip_with_the_decision(scheme, no_zero):
    E, (H, I) = 2, sizes(scheme.group_size)
    layout = get_layout("humming", "wna16")
    block = block_of(scheme, E, H, I, no_zero=no_zero, bias=True)
    shape = shape_of(E, H, I, bias=True)
    facts, decision = scanned(layout, block, shape, scheme)
    if scheme.symmetric:
        for sub in hl.SUBLAYERS:
            assert decision[sub] == (f"float{scheme.bits}e0m{scheme.bits - 1}" if sub in no_zero
                                     else f"uint{scheme.bits}")
            assert facts[sub][hl.NO_ZERO] == ([0, 1] if sub in no_zero else [])
    else:
        assert facts is None and layout.layer_scan(shape, scheme, 0) is None
    shape = shape_of(E, H, I, bias=True, extra={hl.EXTRA_KEY: decision} if decision else {})
    enc = layout.encode(block, shape)
    assert [(k, tuple(v.shape), v.dtype) for k, v in enc.items()] == \
        [(s.suffix, s.shape, s.dtype) for s in layout.plan(shape, scheme)]
    assert not layout.expected_block(block, shape).differences(layout.decode(enc, shape, scheme))
    meta = layout.layer_metadata(shape, scheme, facts)
    assert meta["w2"]["shape_n"] == 512 and meta["w2"]["pad_shape_n"] == 128
    assert {sub: meta[sub]["b_dtype"] for sub in hl.SUBLAYERS} == (decision or {sub: f"uint{scheme.bits}"
                                                                               for sub in hl.SUBLAYERS})


def scanned(layout, block: ExpertBlock, shape: LayerShape, scheme, step: int = 1, offset: int = 0):
    """The layout's scan run as the layer job runs it, ``step`` experts a chunk: (facts, choices), or
    (None, None) for a layer the layout does not scan."""
    scan = layout.layer_scan(shape, scheme, offset)
    if scan is None:
        return None, None
    for a in range(0, block.num_experts, step):
        sub = ExpertBlock(scheme=scheme, **{k: v[a:a + step] for k, v in block.tensors().items()})
        scan.add(sub, offset + a)
    return scan.facts(), scan.choices()


SYM4 = WNA16Scheme(4, 128, True, "bfloat16")


def test_the_choice_is_made_over_every_expert_of_the_sublayer():
    """The case a streamed chunk cannot decide alone: the first experts have no 0 code, a later one has."""
    layout = get_layout("humming", "wna16")
    E, H, I = 4, 256, 128
    block = block_of(SYM4, E, H, I, no_zero=("w13", "w2"))
    block.w13[3, 5, 7] = 0  # one 0 code, in the last expert's w13 only
    shape = shape_of(E, H, I)
    scan = layout.layer_scan(shape, SYM4, 8)
    scan.add(ExpertBlock(scheme=SYM4, **{k: v[:2] for k, v in block.tensors().items()}), 8)
    assert not scan.settled()  # two experts without a 0 code say nothing about the other two
    scan.add(ExpertBlock(scheme=SYM4, **{k: v[2:] for k, v in block.tensors().items()}), 10)
    assert scan.settled()
    assert scan.choices() == {"w13": "uint4", "w2": "float4e0m3"}
    assert scan.facts() == {"w13": {hl.NO_ZERO: [8, 9, 10]}, "w2": {hl.NO_ZERO: [8, 9, 10, 11]}}
    assert layout.choices(scan.facts(), shape, SYM4) == scan.choices()
    # a 0 code in each sublayer of the first chunk settles both at once: the job reads no further
    early = layout.layer_scan(shape, SYM4, 0)
    early.add(block_of(SYM4, 1, H, I), 0)
    assert early.settled() and early.choices() == {"w13": "uint4", "w2": "uint4"}


def test_encode_without_the_scan_is_a_bug_of_the_caller_not_a_guess():
    from moeconvert.errors import InternalError

    block = block_of(SYM4, 1, 256, 256, no_zero=("w13",))
    with pytest.raises(InternalError, match="needs the layer's scan"):
        get_layout("humming", "wna16").encode(block, shape_of(1, 256, 256))
    # a chunk with a 0 code in each sublayer is unsigned whatever the rest of the layer holds
    with_zero = block_of(SYM4, 1, 256, 256)
    assert get_layout("humming", "wna16").encode(with_zero, shape_of(1, 256, 256))


def _golden_block(code: int, zero_at: tuple | None) -> ExpertBlock:
    """One expert, H = K = 128, I = 128 (w13: N = 256, no padding; w2: N = 128 -> 256, K = 128): every code
    ``code``, one w13 code 0 at ``zero_at``."""
    w13 = torch.full((1, 256, 128), code, dtype=torch.uint8)
    if zero_at is not None:
        w13[(0, *zero_at)] = 0
    return ExpertBlock(scheme=SYM4, w13=w13, w2=torch.full((1, 128, 128), code, dtype=torch.uint8),
                       w13_scale=torch.ones(1, 256, 1, dtype=torch.bfloat16),
                       w2_scale=torch.ones(1, 128, 1, dtype=torch.bfloat16))


def test_golden_words_with_and_without_a_zero_code():
    """Hand-computed from docs/layouts/humming.md: int4 fields are packed LSB first, 8 to a word; a
    sublayer without a 0 code holds sign-magnitude fields (u = 7: d = -1 -> 0b1001, u = 9: d = +1 -> 0b0001),
    one with a 0 code the codes themselves; padded fields are 0."""
    layout = get_layout("humming", "wna16")
    shape = shape_of(1, 128, 128)
    as_u32 = lambda t: (t.to(torch.int64) & 0xFFFFFFFF).flatten().unique().tolist()  # noqa: E731
    for code, want in ((7, 0x99999999), (9, 0x11111111)):
        block = _golden_block(code, None)
        _, chosen = scanned(layout, block, shape, SYM4)
        assert chosen == {"w13": "float4e0m3", "w2": "float4e0m3"}
        enc = layout.encode(block, shape_of(1, 128, 128, extra={hl.EXTRA_KEY: chosen}))
        assert as_u32(enc["w13_weight"]) == [want]
        # w2: N = 128 real rows of 256; a word holds 8 fields of one n-run of 8 (tile rows 8 (2 i3 + i4) + t/4)
        assert sorted(as_u32(enc["w2_weight"])) == [0, want]
        assert int((enc["w2_weight"] == 0).sum()) == enc["w2_weight"].numel() // 2
    # one 0 code in w13: w13 keeps u = 7 (0x77777777) in every word but the one holding the 0; w2 still
    # decides on its own (no 0 code there: sign-magnitude)
    block = _golden_block(7, (3, 5))
    _, chosen = scanned(layout, block, shape, SYM4)
    assert chosen == {"w13": "uint4", "w2": "float4e0m3"}
    enc = layout.encode(block, shape_of(1, 128, 128, extra={hl.EXTRA_KEY: chosen}))
    words = (enc["w13_weight"].to(torch.int64) & 0xFFFFFFFF).flatten()
    assert int((words != 0x77777777).sum()) == 1
    odd = int(words[words != 0x77777777][0])
    assert [(odd >> (4 * q)) & 15 for q in range(8)].count(0) == 1 and bin(odd).count("1") == 7 * 3
    assert sorted(as_u32(enc["w2_weight"])) == [0, 0x99999999]


# ---------------------------------------------------------------------------------------------------
# humming's own Python as the oracle


def humming_root() -> Path | None:
    src = os.environ.get(HUMMING_SRC)
    if src:
        p = Path(src)
        return p if p.exists() else None
    spec = importlib.util.find_spec("humming")
    return Path(list(spec.submodule_search_locations)[0]).parent if spec else None


@pytest.fixture(scope="module")
def humming_cpu(tmp_path_factory):
    """humming 0.1.19's transform.py and schema/humming.py, importable on the CPU: its CUDA ops
    (pack/unpack) replaced by LSB-first torch code, its device probe by 'not a PPU'."""
    root = humming_root()
    if root is None:
        pytest.skip(f"set {HUMMING_SRC} to the humming-kernels 0.1.19 wheel or its folder")
    if root.is_file():
        dest = tmp_path_factory.mktemp("humming")
        zipfile.ZipFile(root).extractall(dest)
        root = dest
    pytest.importorskip("jinja2")
    saved = dict(sys.modules)
    fake_ops = types.ModuleType("humming.ops")
    from moeconvert.packing import pack_int32, unpack_int32
    fake_ops.pack_weight = lambda x, b: pack_int32(x, b)
    fake_ops.unpack_weight = lambda x, b: unpack_int32(x, b, x.shape[-1] * 32 // b).to(torch.int32)
    pkg = types.ModuleType("humming")
    pkg.__path__ = [str(root / "humming")]
    sys.modules.update({"humming": pkg, "humming.ops": fake_ops})
    dev = types.ModuleType("humming.device")
    dev.current_device = types.SimpleNamespace(is_ppu=False, sm_version=90)
    dev.DeviceInfo = lambda *a: types.SimpleNamespace(sm_version=90, sm_major=9)
    sys.modules["humming.device"] = dev
    try:
        mods = {}
        for name in ("dtypes", "schema.humming", "transform"):
            try:
                mods[name] = importlib.import_module(f"humming.{name}")
            except ImportError as e:
                pytest.skip(f"humming's {name} does not import on the CPU here: {e}")
        yield mods
    finally:
        for k in [k for k in sys.modules if k == "humming" or k.startswith("humming.")]:
            del sys.modules[k]
        sys.modules.update({k: v for k, v in saved.items() if k.startswith("humming")})


@pytest.mark.parametrize("method,bits,g", [("gptq", 4, 64), ("gptq", 8, 128), ("awq", 4, 64)])
def test_gptq_and_awq_checkpoints_convert_as_compressed_tensors_does(humming_cpu, monkeypatch, method, bits, g):
    """vLLM hands humming a GPTQ or AWQ checkpoint's own tensors with its own schema (int_wna16.py
    ``_humming_wna16_weight_schema``); humming's conversion of them gives the very schema and tensors it gives
    for the compressed-tensors checkpoint of the same codes, scales and zero points, so what the humming layout
    is proved against for compressed-tensors holds for GPTQ and AWQ sources (docs/sources.md)."""
    from moeconvert.packing import pack_int32

    from helpers import AWQ_PACK_ORDER, pack_words

    schemas = {n: importlib.import_module(f"humming.schema.{n}") for n in ("compressed_tensors", "gptq", "awq")}
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # awq.py moves its words to the GPU
    gen = torch.Generator().manual_seed(3)
    E, N, K, sym = 2, 64, 256, method == "gptq"
    G = K // g
    u = torch.randint(0, 1 << bits, (E, N, K), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(E, N, G, generator=gen) * 0.02 + 0.004).half()
    zero = torch.randint(0, 1 << bits, (E, N, G), generator=gen, dtype=torch.uint8)
    ct = {"weight_packed": pack_int32(u, bits, dim=2), "weight_scale": scale}
    if not sym:
        ct["weight_zero_point"] = pack_int32(zero, bits, dim=1)
    if method == "gptq":
        theirs = {"qweight": ct["weight_packed"].transpose(1, 2).contiguous(),
                  "scales": scale.transpose(1, 2).contiguous(),
                  "qzeros": pack_words(torch.full((E, G, N), (1 << (bits - 1)) - 1), bits)}
        schema = schemas["gptq"].GPTQWeightSchema(bits=bits, group_size=g, sym=True)
    else:
        theirs = {"qweight": pack_words(u.transpose(1, 2), bits, AWQ_PACK_ORDER),
                  "qzeros": pack_words(zero.transpose(1, 2), bits, AWQ_PACK_ORDER),
                  "scales": scale.transpose(1, 2).contiguous()}
        schema = schemas["awq"].AWQWeightSchema(bits=bits, group_size=g, zero_point=True)
    ct_schema = schemas["compressed_tensors"].CompressedTensorsWeightSchema(
        format="pack-quantized", type="int", num_bits=bits, strategy="group", group_size=g, symmetric=sym)
    want_schema, want = ct_schema._convert_humming(ct, [N], [K], torch.bfloat16, E)
    got_schema, got = schema._convert_humming(theirs, [N], [K], torch.bfloat16, E)
    # the compressed-tensors schema leaves the scale dtype unset, which humming reads as the params dtype
    # (humming/schema/humming.py: ``bs_dtype or ... param_dtype``)
    bf16 = humming_cpu["dtypes"].DataType.from_torch_dtype(torch.bfloat16)
    fill = lambda sch: dataclasses.replace(sch, bs_dtype=sch.bs_dtype or bf16)  # noqa: E731
    assert fill(got_schema) == fill(want_schema)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("g", [128, 32, -1])
def test_scales_and_bias_equal_hummings_transform(humming_cpu, g):
    t = humming_cpu["transform"]
    scheme = WNA16Scheme(4, g, True, "bfloat16")
    E, (H, I) = 2, sizes(g)
    block = block_of(scheme, E, H, I, bias=True)
    shape = shape_of(E, H, I, bias=True)
    enc = get_layout("humming", "wna16").encode(block, shape)
    for sub, d in hl.sublayers(shape, g).items():
        scale = hl._pad(getattr(block, f"{sub}_scale"), (E, d.Np, d.Gp))
        want = t.transform_humming_weight_scale(scale, to_apply_on_c=g == -1)
        assert torch.equal(enc[hl.NAMES[sub].weight_scale].view(torch.int16), want.view(torch.int16))
        bias = hl._pad(getattr(block, f"{sub}_bias"), (E, d.Np))
        assert torch.equal(enc[hl.NAMES[sub].bias].view(torch.int16), t.transform_humming_bias(bias).view(torch.int16))


@pytest.mark.parametrize("bits,g", [(4, 128), (4, 32), (8, 64), (4, -1)])
def test_zero_points_equal_hummings_transform(humming_cpu, bits, g):
    t, dtypes = humming_cpu["transform"], humming_cpu["dtypes"]
    from moeconvert.packing import pack_int32
    scheme = WNA16Scheme(bits, g, False, "bfloat16")
    E, (H, I) = 2, sizes(g)
    block = block_of(scheme, E, H, I)
    shape = shape_of(E, H, I)
    enc = get_layout("humming", "wna16").encode(block, shape)
    for sub, d in hl.sublayers(shape, g).items():
        zp = hl._pad(getattr(block, f"{sub}_zero"), (E, d.Np, d.Gp))
        packed = pack_int32(zp.transpose(1, 2), bits).transpose(1, 2).contiguous()  # compressed-tensors form
        want = t.transform_humming_zero_point(packed, dtypes.DataType.from_str(f"uint{bits}"), packed=True)
        assert torch.equal(enc[hl.NAMES[sub].zero_point], want)


@pytest.mark.parametrize("bits", [4, 8])
def test_sign_magnitude_choice_equals_hummings(humming_cpu, bits):
    from moeconvert.packing import pack_int32
    schema_mod, dtypes = humming_cpu["schema.humming"], humming_cpu["dtypes"]
    for no_zero in (True, False):
        codes = torch.randint(1 if no_zero else 0, 1 << bits, (2, 64, 128), dtype=torch.uint8)
        schema = schema_mod.HummingWeightSchema(b_dtype=dtypes.DataType.from_str(f"uint{bits}"),
                                                weight_scale_group_size=128)
        got_schema, tensors = schema.convert_symmetric_integer_weight({"weight": pack_int32(codes, bits)})
        want = hl.sign_magnitude_dtype(bits) if no_zero else hl.unsigned_dtype(bits)
        assert str(got_schema.b_dtype) == want
        sm = hl.to_sign_magnitude(codes, bits) if no_zero else codes
        assert torch.equal(tensors["weight"], pack_int32(sm, bits))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", ["zeros", "nozero", "zero-in-last-expert"])
def test_whole_layer_choice_and_words_equal_hummings(humming_cpu, bits, case):
    """humming's own convert_symmetric_integer_weight, given each sublayer's whole weight (all experts, as
    vLLM's convert_to_humming_moe_kernel_format passes it), against the scan run a chunk of one expert at a
    time; its output fields, padded and tiled by the kernel transcription, against encode's words."""
    from moeconvert.packing import pack_int32, unpack_int32
    schema_mod, dtypes = humming_cpu["schema.humming"], humming_cpu["dtypes"]
    scheme = WNA16Scheme(bits, 128, True, "bfloat16")
    E, H, I = 3, 256, 128
    block = block_of(scheme, E, H, I, seed=bits, no_zero=() if case == "zeros" else ("w13", "w2"))
    if case == "zero-in-last-expert":
        block.w2[E - 1, 17, 3] = 0
    layout = get_layout("humming", "wna16")
    shape = shape_of(E, H, I)
    facts, chosen = scanned(layout, block, shape, scheme, step=1)
    enc = layout.encode(block, shape_of(E, H, I, extra={hl.EXTRA_KEY: chosen}))
    for sub, d in hl.sublayers(shape, 128).items():
        codes = getattr(block, sub)
        schema = schema_mod.HummingWeightSchema(b_dtype=dtypes.DataType.from_str(f"uint{bits}"),
                                                weight_scale_group_size=128)
        got, tensors = schema.convert_symmetric_integer_weight({"weight": pack_int32(codes, bits)})
        assert str(got.b_dtype) == chosen[sub]
        fields = unpack_int32(tensors["weight"], bits, d.K).to(torch.uint8)
        fields = hl._pad(fields, (E, d.Np, d.Kp))
        if hl.preprocesses_int2fp(str(got.b_dtype), bits, False):  # int8 unsigned: the kernel's shift by 128
            fields = hl.int2fp(fields, torch.tensor(1 << (bits - 1)), bits)
        assert torch.equal(enc[hl.NAMES[sub].weight], kernel_transcription(fields, bits)), sub
    want = {"zeros": ([], []), "nozero": ([0, 1, 2], [0, 1, 2]), "zero-in-last-expert": ([0, 1, 2], [0, 1])}[case]
    assert (facts["w13"][hl.NO_ZERO], facts["w2"][hl.NO_ZERO]) == want


# ---------------------------------------------------------------------------------------------------
# GPU: humming's CUDA transform, as vLLM 0.33.0 calls it


GPU_CASES = [(4, 128, True), (4, 128, False), (4, 32, True), (4, 32, False), (8, 128, True), (8, 64, False),
             (4, -1, True), (8, -1, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("no_zero", [(), ("w13", "w2"), ("w2",)], ids=["zeros", "nozero", "w2-nozero"])
@pytest.mark.parametrize("bits,g,sym", GPU_CASES)
def test_encode_equals_hummings_cuda_transform(bits, g, sym, no_zero):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    humming = pytest.importorskip("humming")
    from humming.schema import BaseWeightSchema, HummingInputSchema
    from humming.transform import prepare_and_transform_humming_tensors
    from moeconvert.packing import pack_int32

    scheme = WNA16Scheme(bits, g, sym, "bfloat16")
    E, (H, I) = 2, sizes(g)
    if not sym and no_zero:
        pytest.skip("asymmetric weights keep unsigned codes whatever they hold")
    block = block_of(scheme, E, H, I, no_zero=no_zero)
    layout = get_layout("humming", "wna16")
    _, chosen = scanned(layout, block, shape_of(E, H, I), scheme)
    shape = shape_of(E, H, I, extra={hl.EXTRA_KEY: chosen} if chosen else {})
    ours = layout.encode(block, shape)
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "type": "int", "num_bits": bits,
              "strategy": "channel" if g == -1 else "group", "group_size": None if g == -1 else g,
              "symmetric": sym}
    for sub, d in hl.sublayers(shape, g).items():
        codes = getattr(block, sub)
        t = {"weight_packed": pack_int32(codes, bits).cuda(),  # compressed-tensors: K-packed, N-first
             "weight_scale": getattr(block, f"{sub}_scale").cuda(),
             "weight_shape": torch.tensor([[d.N, d.K]] * E).cuda()}
        if not sym:
            z = getattr(block, f"{sub}_zero")
            t["weight_zero_point"] = pack_int32(z.transpose(1, 2), bits).transpose(1, 2).contiguous().cuda()
        # vLLM's _process_single_sublayer: convert_humming, input-schema fallback (16-bit), then transform
        ws = BaseWeightSchema.from_config(config)
        stacks = [d.N // 2] * 2 if sub == "w13" else [d.N]
        hs, tensors = ws.convert_humming(tensors=t, shape_n_stacks=stacks, shape_k_stacks=[d.K],
                                         param_dtype=torch.bfloat16, num_experts=E)
        cfg, out = prepare_and_transform_humming_tensors(
            tensors=tensors, shape_n=d.N, shape_k=d.K, pad_n_to_multiple=256, pad_k_to_multiple=128,
            input_schema=HummingInputSchema(), weight_schema=hs, has_bias=False, num_experts=E,
            torch_dtype=torch.bfloat16, device=torch.device("cuda"))
        # the sign-magnitude choice, made over the whole sublayer (both experts)
        assert str(hs.b_dtype) == (f"float{bits}e0m{bits - 1}" if sub in no_zero else f"uint{bits}")
        assert (cfg.shape_n, cfg.shape_k, cfg.pad_shape_n, cfg.pad_shape_k) == (d.Np, d.Kp, d.Np - d.N, d.Kp - d.K)
        names = hl.NAMES[sub]
        pairs = [("weight", names.weight), ("weight_scale", names.weight_scale)]
        if not sym:
            pairs.append(("zero_point", names.zero_point))
        for theirs, mine in pairs:
            a, b = out[theirs].cpu(), ours[mine]
            assert a.shape == b.shape and a.dtype == b.dtype, (sub, theirs, a.shape, b.shape, a.dtype, b.dtype)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (sub, theirs)


# ---------------------------------------------------------------------------------------------------
# end to end: a real compressed-tensors checkpoint, some of whose experts have no 0 code


@pytest.fixture(scope="module")
def no_zero_ckpts(example_ckpt):
    """Symmetric int4 g32 checkpoints of 8 experts: experts 4..7 without a 0 code, and all of them."""
    kw = dict(family="qwen3-moe", scheme="w4a16", group_size=32, num_layers=2, num_experts=8, hidden_size=256,
              intermediate_size=128)
    return {"half": example_ckpt(**kw, experts_without_zero_code=(4, 5, 6, 7)),
            "all": example_ckpt(**kw, experts_without_zero_code=tuple(range(8)))}


def _humming(src: Path, out: Path, *extra, expect: int = 0):
    from helpers import cli

    return cli("repack", str(src), str(out), "--backend", "humming", *map(str, extra), expect=expect)


def _sublayers(out: Path, layer: int = 0) -> dict:
    import json

    m = json.loads((out / "moeconvert.json").read_text())["moe_layers"][layer]["layout_metadata"]
    return {sub: (m[sub]["b_dtype"], m[sub][hl.NO_ZERO]) for sub in hl.SUBLAYERS}


def test_each_partition_decides_over_its_own_experts_as_vllm_does(no_zero_ckpts, tmp_path):
    """vLLM decides over the rank's local experts: the full layer of the half checkpoint has 0 codes
    (unsigned), EP rank 1 of 2 holds only experts 4..7 (sign-magnitude), rank 0 holds 0 codes."""
    from helpers import cli
    from moeconvert.decode import decode_chunk
    from moeconvert.modelmap import map_model
    from moeconvert.sources import open_source

    src = no_zero_ckpts["half"]
    source = open_source(str(src))
    codes = decode_chunk(source, map_model(source).layers[0], hl_partition(), 0, 8)
    # the fixture, read back from the checkpoint: experts 4..7 have no 0 code, 0..3 have some
    assert [bool((codes.w13[e] == 0).any()) for e in range(8)] == [True] * 4 + [False] * 4
    runs = {"full": (), "ep1": ("--ep-size", 2, "--ep-rank", 1), "ep0": ("--ep-size", 2, "--ep-rank", 0)}
    want = {"full": {sub: ("uint4", [4, 5, 6, 7]) for sub in hl.SUBLAYERS},
            "ep1": {sub: ("float4e0m3", [4, 5, 6, 7]) for sub in hl.SUBLAYERS},
            "ep0": {sub: ("uint4", []) for sub in hl.SUBLAYERS}}
    for name, extra in runs.items():
        _humming(src, tmp_path / name, *extra)
        assert _sublayers(tmp_path / name) == want[name], name
        cli("verify", str(tmp_path / name), "--against", str(src), expect=0)
    all_out = tmp_path / "all"
    _humming(no_zero_ckpts["all"], all_out)
    assert _sublayers(all_out) == {sub: ("float4e0m3", list(range(8))) for sub in hl.SUBLAYERS}
    cli("verify", str(all_out), "--against", str(no_zero_ckpts["all"]), expect=0)


def hl_partition(**kw):
    from moeconvert.canonical import Partition

    return Partition(**kw)


def test_a_full_folder_names_the_ep_ranks_that_would_decide_otherwise(no_zero_ckpts, tmp_path):
    import json

    layout = get_layout("humming", "wna16")
    _humming(no_zero_ckpts["half"], tmp_path / "full")
    meta = json.loads((tmp_path / "full" / "moeconvert.json").read_text())["moe_layers"][0]["layout_metadata"]
    assert layout.experts_problem(meta, [0, 1, 2, 3]) is None
    assert layout.experts_problem(meta, [2, 3, 4, 5]) is None  # EP 4 ranks of 2 experts: 2..3 has 0 codes
    why = layout.experts_problem(meta, [4, 5, 6, 7])
    assert why.startswith("w13: none of this rank's experts 4..7 has a 0 code, so vLLM's humming path makes "
                          "them float4e0m3") and why.endswith("convert for this rank (--ep-size/--ep-rank)")
    assert "\n" not in why
    # a folder that chose sign-magnitude for every expert serves any EP shape: each subset has no 0 code
    _humming(no_zero_ckpts["all"], tmp_path / "all")
    meta = json.loads((tmp_path / "all" / "moeconvert.json").read_text())["moe_layers"][0]["layout_metadata"]
    assert all(layout.experts_problem(meta, [e]) is None for e in range(8))


@pytest.mark.parametrize("tamper,needle", [
    (lambda m: m["w13"].update(b_dtype="uint4"), "layout_metadata: expected what layout humming states"),
    (lambda m: m["w2"].update({hl.NO_ZERO: [4, 5, 6, 99]}), "expected increasing expert indices in [4, 8)"),
    (lambda m: m["w2"].update({hl.NO_ZERO: "all"}), "w2.experts_without_zero_code: expected a list"),
])
def test_a_tampered_choice_is_refused_in_one_line(no_zero_ckpts, tmp_path, tamper, needle):
    import json

    from helpers import cli

    out = tmp_path / "ep1"
    _humming(no_zero_ckpts["half"], out, "--ep-size", 2, "--ep-rank", 1)
    path = out / "moeconvert.json"
    m = json.loads(path.read_text())
    tamper(m["moe_layers"][0]["layout_metadata"])
    path.write_text(json.dumps(m))
    r = cli("verify", str(out), expect=2)
    lines = [ln for ln in r.err.strip().splitlines() if ln]
    assert len(lines) == 1 and "moeconvert.json" in lines[0] and "moe_layers[0].layout_metadata" in lines[0], r.err
    assert needle in lines[0], lines[0]


def test_verify_rescans_the_decoded_codes(no_zero_ckpts, tmp_path):
    """Facts and choice changed together pass the manifest's check, but decoding sign-magnitude words as
    unsigned gives codes with no 0 code in experts the manifest now says have one: verify says so, even
    without the source, and against the source every code differs."""
    import json

    from helpers import cli

    out = tmp_path / "ep1"
    _humming(no_zero_ckpts["half"], out, "--ep-size", 2, "--ep-rank", 1)
    path = out / "moeconvert.json"
    m = json.loads(path.read_text())
    m["moe_layers"][0]["layout_metadata"]["w13"].update(b_dtype="uint4", **{hl.NO_ZERO: [4, 5, 6]})
    path.write_text(json.dumps(m))
    r = cli("verify", str(out), "--json", expect=1)
    layer = json.loads(r.out)["layers"][0]
    assert any("layout facts: the manifest records" in d and "[4, 5, 6, 7]" in d for d in layer["differences"])


def test_verify_refuses_words_no_sign_magnitude_encoding_writes(no_zero_ckpts, tmp_path):
    """Choice and facts edited together from unsigned to sign-magnitude pass the manifest's check, and the
    words decode (a 0 code decodes as sign-magnitude -0, i.e. code 8): but they hold -0, which no
    sign-magnitude encoding writes. Plain verify and load(verify=True) refuse them, without the source."""
    import json

    from helpers import cli
    from moeconvert.runtime import load

    out = tmp_path / "full"
    _humming(no_zero_ckpts["half"], out)
    path = out / "moeconvert.json"
    m = json.loads(path.read_text())
    for layer in m["moe_layers"]:
        layer["layout_metadata"]["w13"].update(b_dtype="float4e0m3", **{hl.NO_ZERO: list(range(8))})
    path.write_text(json.dumps(m))
    r = cli("verify", str(out), "--json", expect=1)
    errors = json.loads(r.out)["layers"][0]["decode_errors"]
    assert errors and all("w13_weight:" in e and "never writes for the values they decode to" in e for e in errors), errors
    with pytest.raises(MoeConvertError, match=r"w13_weight: \d+ of \d+ elements hold bytes layout humming never "
                                              r"writes") as exc:
        load(out, device="cpu", verify=True)
    assert "\n" not in str(exc.value)
