"""The contract every layout of the registry keeps, checked on each of them and each scheme kind it takes
(``layout_names()`` x ``layout_kinds(name)``: a layout registered tomorrow is covered without a line here).

(a) ``decode(encode(x)) == expected_block(x)``, bit for bit, and encode leaves ``x`` as it was;
(b) ``check`` lists every violated constraint: a layer that breaks two independent constraints gets the
    problems of each (exactly those each break gets alone), and a scheme kind the layout does not take
    is one problem naming the kinds its backend takes;
(c) ``encode`` refuses (MoeConvertError naming every problem) what ``check`` refuses;
(d) ``plan`` names the tensors ``encode`` writes, in that order, with their dtypes and shapes (leading dim:
    the experts of the chunk encoded);
(e) convert.py encodes every layer a chunk of experts at a time and verify.py decodes it so, whatever the
    layout: the chunks, concatenated, are byte-identical to the whole layer encoded at once, and a chunk
    of the file decodes to the expected block of those experts.

No size is written down per layout: a case is the smallest layer from :data:`SIZES` that ``check``
accepts, and the smallest with H > I and with H < I (where padding and scale permutations differ), for
each scheme of the kind (:func:`schemes`) and layer variant (:data:`VARIANTS`: biases, activation, model
dtype). A scheme and variant ``check`` refuses at every size is a case of (c) instead. Each test runs all
cases of one layout and names every case that fails. What is particular to one layout (golden vectors,
the engines' own code: vLLM, FlashInfer, triton_kernels) is in its tests/test_layout_*.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from collections import Counter
from typing import Callable, NamedTuple

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import get_layout, layout_kinds, layout_names
from moeconvert.layouts.base import CHOICES, Layout, padded_sizes
from moeconvert.schemes import FloatScheme, MXFP4Scheme, NVFP4Scheme, Scheme, WNA16Scheme

from helpers import same_bits

KINDS = ("float", "wna16", "mxfp4", "nvfp4")
SIZES = (32, 64, 96, 128, 192, 256, 384, 512)  # candidate H and I (MXFP4: the padded sizes)
EXPERTS = 3
CHUNKS = ((0, 1), (1, 3))  # as convert.py streams a layer of EXPERTS experts
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


#: how many of a kind's schemes (the first ones) meet every layer variant; the others meet the first one
VARIANT_SCHEMES = 4


def schemes(kind: str) -> list[Scheme]:
    """The schemes of a kind the cases take, the :data:`VARIANT_SCHEMES` that meet every variant first."""
    if kind == "float":
        return [FloatScheme(dt) for dt in DTYPES]
    if kind == "wna16":
        first = [WNA16Scheme(4, 32, True, "bfloat16"), WNA16Scheme(4, 128, False, "bfloat16"),
                 WNA16Scheme(8, -1, True, "bfloat16"), WNA16Scheme(4, 32, False, "float16")]  # a float16 model's
        grid = [WNA16Scheme(bits, g, sym, "bfloat16") for bits in (4, 8) for g in (32, 64, 128, -1)
                for sym in (True, False)]
        # checkpoint scales in another dtype than the model's: layouts that cast them say so in expected_block
        casts = [WNA16Scheme(4, 32, True, "float32"), WNA16Scheme(4, 128, False, "float32"),
                 WNA16Scheme(8, 64, True, "float16")]
        return first + [s for s in grid if s not in first] + casts
    if kind == "mxfp4":
        return [MXFP4Scheme()]
    if kind == "nvfp4":
        return [NVFP4Scheme()]
    raise AssertionError(f"a scheme kind this test does not know: {kind} (add its canonical blocks here)")


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a layer is besides its sizes and scheme."""

    name: str
    dtype: str  # the model's dtype
    bias: str | None  # the dtype of the checkpoint's expert biases; None: the layer has none
    activation: str


VARIANTS = (
    Variant("bf16", "bfloat16", None, "silu"),
    Variant("bf16-bias32-swigluoai", "bfloat16", "float32", "swigluoai"),
    Variant("bf16-bias16", "bfloat16", "bfloat16", "silu"),
    Variant("bf16-swigluoai", "bfloat16", None, "swigluoai"),
    Variant("fp16-bias16", "float16", "float16", "silu"),
    Variant("fp32", "float32", None, "silu"),
)


def scheme_id(s: Scheme) -> str:
    if isinstance(s, WNA16Scheme):
        g = "ch" if s.group_size == -1 else s.group_size
        cast = "" if s.scale_dtype == "bfloat16" else f"-s{s.scale_dtype}"
        return f"w{s.bits}g{g}-{'sym' if s.symmetric else 'asym'}{cast}"
    return s.describe()


def make_layer(scheme: Scheme, variant: Variant, H: int, I: int, E: int = EXPERTS) -> LayerShape:
    dtype, bias = variant.dtype, variant.bias
    if isinstance(scheme, FloatScheme):  # float experts: the checkpoint's dtype is the model's and the biases'
        dtype, bias = scheme.dtype, scheme.dtype if bias else None
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, has_bias=bias is not None,
                      activation=variant.activation, dtype=dtype, bias_dtype=bias)


def make_block(scheme: Scheme, shape: LayerShape, experts: int, seed: int | None) -> ExpertBlock:
    """A random canonical block of ``experts`` experts of the layer (sizes that do not divide are floored);
    without a seed, zeros of the same shapes (for an encode that must refuse before it reads a value)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    E, H, I = experts, shape.hidden_size, shape.intermediate_size

    def ints(high, *size):
        if gen is None:
            return torch.zeros(size, dtype=torch.uint8)
        return torch.randint(0, high, size, generator=gen, dtype=torch.uint8)

    def floats(dtype, *size):
        if gen is None:
            return torch.zeros(size, dtype=DTYPES[dtype])
        return (torch.randn(size, generator=gen) * 0.05).to(DTYPES[dtype])

    if isinstance(scheme, FloatScheme):
        kw = dict(w13=floats(scheme.dtype, E, 2 * I, H), w2=floats(scheme.dtype, E, H, I))
    elif isinstance(scheme, WNA16Scheme):
        codes = 1 << scheme.bits
        G13, G2 = scheme.groups(H), scheme.groups(I)

        def scales(*size):
            if gen is None:
                return torch.zeros(size, dtype=DTYPES[scheme.scale_dtype])
            return (torch.rand(size, generator=gen) * 0.02 + 0.004).to(DTYPES[scheme.scale_dtype])

        kw = dict(w13=ints(codes, E, 2 * I, H), w2=ints(codes, E, H, I),
                  w13_scale=scales(E, 2 * I, G13), w2_scale=scales(E, H, G2))
        if not scheme.symmetric:
            kw.update(w13_zero=ints(codes, E, 2 * I, G13), w2_zero=ints(codes, E, H, G2))
    elif isinstance(scheme, NVFP4Scheme):
        # any e2m1 pair; any finite e4m3 scale, negatives included, each expert's largest 448 (its layout's
        # tests cover layers whose scales stay smaller); per-expert fp32 multipliers, gate's equal to up's as
        # llm-compressor writes them (the humming layout holds no other; Marlin's use of the gate's alone when
        # they differ is checked against vLLM in test_layout_marlin_nvfp4.py)
        def scale(*size):
            b = ints(256, *size)
            b[(b & 0x7F) == 0x7F] = 0x7E  # no NaN
            b[..., 0, 0] = 0x7E
            return b.view(torch.float8_e4m3fn)

        glob = lambda *s: torch.zeros(s) if gen is None else torch.rand(s, generator=gen) * 1e-3 + 1e-6
        # a W4A4 checkpoint's activation multipliers (layouts that run 16-bit activations drop them)
        act = lambda *s: torch.zeros(s) if gen is None else torch.rand(s, generator=gen) * 4 + 0.1
        kw = dict(w13=ints(256, E, 2 * I, H // 2), w2=ints(256, E, H, I // 2),
                  w13_scale=scale(E, 2 * I, H // 16), w2_scale=scale(E, H, I // 16),
                  w13_global=glob(E, 1).expand(-1, 2).contiguous(),
                  w2_global=glob(E), w13_input_global=act(E, 2), w2_input_global=act(E))
    else:  # every byte: any e2m1 pair, any e8m0 scale (255 is NaN, compared by its bits)
        kw = dict(w13=ints(256, E, 2 * I, H // 2), w2=ints(256, E, H, I // 2),
                  w13_scale=ints(256, E, 2 * I, H // 32), w2_scale=ints(256, E, H, I // 32))
    if shape.has_bias:
        kw.update(w13_bias=floats(shape.bias_dtype, E, 2 * I), w2_bias=floats(shape.bias_dtype, E, H))
    return ExpertBlock(scheme=scheme, **kw)


def chunk(block: ExpertBlock, a: int, b: int) -> ExpertBlock:
    return ExpertBlock(scheme=block.scheme, **{k: t[a:b] for k, t in block.tensors().items()})


def seed_of(text: str) -> int:
    return zlib.crc32(text.encode())


# ---------------------------------------------------------------------------------------------------
# the registry, and the layers each layout accepts

LAYOUTS = [(f"{name}/{kind}", get_layout(name, kind)) for name in layout_names() for kind in layout_kinds(name)]


def accepted_sizes(layout: Layout, scheme: Scheme, variant: Variant) -> list[tuple[int, int]]:
    """The smallest (H, I) ``check`` accepts, and the smallest with H > I and with H < I."""
    ok = [(H, I) for H in SIZES for I in SIZES if not layout.check(make_layer(scheme, variant, H, I), scheme)]
    area = lambda hi: (hi[0] * hi[1], hi)
    picks = [min(ok, key=area)] if ok else []
    for wider in (True, False):
        some = [(H, I) for H, I in ok if H != I and (H > I) == wider]
        if some:
            picks.append(min(some, key=area))
    return list(dict.fromkeys(picks))


class Case(NamedTuple):
    id: str
    layout: Layout
    scheme: Scheme
    shape: LayerShape


def _cases(lid: str, layout: Layout) -> tuple[list[Case], list[Case]]:
    """(layers the layout accepts, combinations of scheme and variant it refuses at every size).

    Every scheme meets the first variant at its three sizes; the first :data:`VARIANT_SCHEMES` schemes
    also meet every other variant, at its smallest size (a variant changes biases, row orders and
    casts the same way whatever the group size)."""
    good, refused = {}, {}
    for n, scheme in enumerate(schemes(lid.split("/")[1])):
        for variant in VARIANTS if n < VARIANT_SCHEMES else VARIANTS[:1]:
            sizes = accepted_sizes(layout, scheme, variant)
            sid = f"{lid}/{scheme_id(scheme)}/{variant.name}"
            for H, I in sizes if variant is VARIANTS[0] else sizes[:1]:
                case = scanned(Case(f"{sid}/H{H}-I{I}", layout, scheme, make_layer(scheme, variant, H, I)))
                good.setdefault(same_layer(case), case)  # float layers ignore the variant's dtypes
            if not sizes:
                case = Case(f"{sid}/H256-I256", layout, scheme, make_layer(scheme, variant, 256, 256))
                refused.setdefault(same_layer(case), case)
    return list(good.values()), list(refused.values())


def scanned(case: Case) -> Case:
    """The case with the choices its layout makes from the whole layer (``Layout.layer_scan``), as a
    conversion job sets them after its scan; the case itself for a layout that scans nothing."""
    scan = case.layout.layer_scan(case.shape, case.scheme, 0)
    if scan is None:
        return case
    scan.add(make_block(case.scheme, case.shape, EXPERTS, seed_of(case.id)), 0)
    return case._replace(shape=dataclasses.replace(case.shape, extra={**case.shape.extra, CHOICES: scan.choices()}))


def same_layer(case: Case) -> tuple:
    fields = (f.name for f in dataclasses.fields(case.shape) if f.name != "extra")
    return case.scheme, *((name, getattr(case.shape, name)) for name in fields)


GOOD, REFUSED = {}, {}
for _lid, _layout in LAYOUTS:
    GOOD[_lid], REFUSED[_lid] = _cases(_lid, _layout)


# ---------------------------------------------------------------------------------------------------
# where a layout does not keep the contract today. Those cases run apart, as an xfail(strict=True) that
# fails for real once any of them keeps the contract: the entry is then out of date and goes.


#: (layout id prefix, property: "refuse" for (c), "expected" for (a) and (e), which cases, why)
KNOWN_GAPS: list[tuple] = []  # none open


def known_gap(lid: str, prop: str, case=None) -> str | None:
    for prefix, which, when, why in KNOWN_GAPS:
        if lid.startswith(prefix) and which == prop and (case is None or when(case)):
            return why
    return None


class GapStillThere(Exception):
    """Every case of a known gap still breaks the contract (the outcome its xfail expects)."""


class Group(NamedTuple):
    """The cases of one layout that one test runs; ``gap`` is why they are expected to fail, if they are."""

    lid: str
    cases: list
    gap: str | None = None


def groups(cases_by_layout: dict[str, list], prop: str) -> list:
    """One test a layout, and one more for its cases of a known gap (an xfail that must keep failing)."""
    out = []
    for lid, cases in cases_by_layout.items():
        gaps = {c.id: known_gap(lid, prop, c) for c in cases}
        keep = [c for c in cases if not gaps[c.id]]
        if keep:
            out.append(pytest.param(Group(lid, keep), id=lid))
        for why in dict.fromkeys(w for w in gaps.values() if w):
            gapped = [c for c in cases if gaps[c.id] == why]
            out.append(pytest.param(Group(lid, gapped, why), id=f"{lid}/known-gap",
                                    marks=pytest.mark.xfail(strict=True, raises=GapStillThere, reason=why)))
    return out


def run(group: Group, check: Callable) -> None:
    """``check(case)`` on every case of the group, naming every case that fails (not only the first)."""
    failed = {}
    for case in group.cases:
        try:
            check(case)
        except Exception as e:  # every case is reported, whatever it raised
            failed[case.id] = f"{type(e).__name__}: {e}"
    if group.gap is None:
        assert not failed, f"{len(failed)} of {len(group.cases)} cases fail:\n" + "\n".join(
            f"{cid}: {why}" for cid, why in failed.items())
        return
    kept = [c.id for c in group.cases if c.id not in failed]
    if kept:
        pytest.fail(f"known gap of {group.lid} closed for {kept}: drop or narrow its KNOWN_GAPS entry")
    raise GapStillThere(group.gap)


class Encoded(NamedTuple):
    block: ExpertBlock
    whole: dict[str, torch.Tensor]  # the layer encoded at once
    chunks: list[dict[str, torch.Tensor]]  # each of CHUNKS encoded alone
    changed: list[str]  # the block's tensors encode changed (none, it must not)


_ENCODED: dict[str, Encoded] = {}


def encoded(case: Case) -> Encoded:
    """A case's block and what the layout writes for it, made once for the tests that read them."""
    if case.id not in _ENCODED:
        layout, shape = case.layout, case.shape
        block = make_block(case.scheme, shape, EXPERTS, seed_of(case.id))
        before = {k: t.clone() for k, t in block.tensors().items()}
        whole = layout.encode(block, shape)
        chunks = [layout.encode(chunk(block, a, b), shape) for a, b in CHUNKS]
        changed = [k for k, t in before.items() if not same_bits(getattr(block, k), t)]
        _ENCODED[case.id] = Encoded(block, whole, chunks, changed)
    return _ENCODED[case.id]


@pytest.fixture(scope="module", autouse=True)
def _forget_encoded():
    yield
    _ENCODED.clear()


def test_every_registered_layout_has_layers_it_accepts():
    for lid, _ in LAYOUTS:
        assert GOOD[lid], f"{lid}: check accepts no layer of SIZES x VARIANTS x schemes('{lid.split('/')[1]}')"


# ---------------------------------------------------------------------------------------------------
# (a) decode(encode(x)) == expected_block(x)


def round_trips(case: Case) -> None:
    layout, scheme, shape = case.layout, case.scheme, case.shape
    e = encoded(case)
    assert not e.changed, f"encode changed its input: {e.changed}"
    diffs = layout.decode(e.whole, shape, scheme).differences(layout.expected_block(e.block, shape))
    assert diffs == [], diffs


@pytest.mark.parametrize("group", groups(GOOD, "expected"))
def test_decode_of_encode_is_the_expected_block(group):
    run(group, round_trips)


# ---------------------------------------------------------------------------------------------------
# (d) plan == what encode writes, for the whole layer and for each chunk


def plans_what_it_writes(case: Case) -> None:
    layout, scheme, shape = case.layout, case.scheme, case.shape
    specs = layout.plan(shape, scheme)
    assert specs and all(s.shape[0] == shape.num_experts for s in specs), specs
    e = encoded(case)
    for (a, b), tensors in zip(((0, EXPERTS), *CHUNKS), (e.whole, *e.chunks)):
        wrote = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        planned = [(s.suffix, (b - a, *s.shape[1:]), s.dtype) for s in specs]
        assert wrote == planned, f"experts {a}..{b - 1}: wrote {wrote}, planned {planned}"
        # the writer streams a contiguous tensor without a copy (writer.tensor_bytes)
        assert all(t.is_contiguous() for t in tensors.values()), f"experts {a}..{b - 1}: not contiguous"


@pytest.mark.parametrize("group", groups(GOOD, "plan"))
def test_plan_is_what_encode_writes(group):
    run(group, plans_what_it_writes)


# ---------------------------------------------------------------------------------------------------
# (e) chunks of experts: encoded apart == encoded at once; decoded apart == expected apart


def streams(case: Case) -> None:
    e = encoded(case)
    for name, t in e.whole.items():
        assert same_bits(torch.cat([part[name] for part in e.chunks]), t), name


def decodes_chunks(case: Case) -> None:
    layout, scheme, shape = case.layout, case.scheme, case.shape
    e = encoded(case)
    for a, b in CHUNKS:
        decoded = layout.decode({k: t[a:b] for k, t in e.whole.items()}, shape, scheme)
        diffs = decoded.differences(layout.expected_block(chunk(e.block, a, b), shape))
        assert diffs == [], f"experts {a}..{b - 1}: {diffs}"


@pytest.mark.parametrize("group", groups(GOOD, "stream"))
def test_chunks_of_experts_encode_byte_identical(group):
    run(group, streams)


@pytest.mark.parametrize("group", groups(GOOD, "expected"))
def test_a_chunk_of_the_file_decodes_to_its_expected_block(group):
    run(group, decodes_chunks)


# ---------------------------------------------------------------------------------------------------
# (f) the invariants of the bytes, which verify checks beyond decoding (docs/format.md, "What verify
#     guarantees"): ``byte_problems`` accepts every chunk encode writes, and refuses a byte changed where
#     decode cannot see it (the chunk decodes to the same block: without this check, a folder so edited,
#     its digests updated, would pass verify)


def byte_cases(cases: list[Case]) -> list[Case]:
    """The cases (f) runs (encoding every case again would double this file's time): each of the first
    :data:`VARIANT_SCHEMES` schemes in the first variant at its smallest size, and the first with biases."""
    first = {}
    for case in cases:
        first.setdefault((case.scheme, case.id.split("/")[-2]), case)
    plain = [c for (_, v), c in first.items() if v == VARIANTS[0].name][:VARIANT_SCHEMES]
    return plain + [c for c in first.values() if c.shape.has_bias][:1]


BYTE_CASES = {lid: byte_cases(cases) for lid, cases in GOOD.items()}


def accepts_what_it_writes(case: Case) -> None:
    layout, scheme, shape = case.layout, case.scheme, case.shape
    tensors = encoded(case).whole  # its chunks are rows of it, (e)
    problems = layout.byte_problems(tensors, layout.decode(tensors, shape, scheme), shape)
    assert problems == [], problems


@pytest.mark.parametrize("group", groups(BYTE_CASES, "bytes"))
def test_byte_problems_accepts_what_encode_writes(group):
    run(group, accepts_what_it_writes)


PROBES = 12  # one-bit flips tried per tensor of one expert: evenly spread, and as many at random places
CHECKED = 3  # of the flips decode cannot see, those checked per tensor
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _rows_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """Per expert of ``a``, whether its bits equal ``b``'s one expert."""
    if a is None or b is None:
        return torch.tensor(a is None and b is None)
    same = a.contiguous().view(INTS[a.element_size()]) == b.contiguous().view(INTS[b.element_size()])
    return same.reshape(a.shape[0], -1).all(1)


def hidden_flips(case: Case) -> list[dict[str, torch.Tensor]]:
    """Expert 0's tensors with one bit flipped where ``decode`` does not see it (the expert decodes to the
    same block), among the flips tried: every flip is one expert of one stacked decode."""
    layout, scheme, shape = case.layout, case.scheme, case.shape
    one = {k: t[:1] for k, t in encoded(case).whole.items()}
    gen = torch.Generator().manual_seed(seed_of(case.id))
    tried = []
    for suffix, t in one.items():
        n, width = t.numel(), 8 * t.element_size()
        spread = torch.linspace(0, n - 1, PROBES).long()
        for p in torch.cat([spread, torch.randint(0, n, (PROBES,), generator=gen)]).unique().tolist():
            tried.append((suffix, p, int(torch.randint(0, width, (), generator=gen))))
    stacked = {k: t.repeat(len(tried), *([1] * (t.dim() - 1))) for k, t in one.items()}
    for i, (suffix, p, bit) in enumerate(tried):
        words = stacked[suffix][i].view(INTS[stacked[suffix].element_size()]).view(-1)
        mask = (1 << bit) - ((1 << (8 * words.element_size())) if bit == 8 * words.element_size() - 1 and
                             words.dtype != torch.uint8 else 0)
        words[p] ^= mask
    same = torch.ones(len(tried), dtype=torch.bool)
    want, got = layout.decode(one, shape, scheme), layout.decode(stacked, shape, scheme)
    for name in want.tensors().keys() | got.tensors().keys():
        same &= _rows_equal(getattr(got, name), getattr(want, name))
    hidden: dict[str, list[int]] = {}
    for i in same.nonzero().flatten().tolist():
        hidden.setdefault(tried[i][0], []).append(i)
    return [{k: t[i:i + 1] for k, t in stacked.items()} for ids in hidden.values() for i in ids[:CHECKED]]


HIDDEN_FOUND: dict[str, int] = {}


def refuses_what_decode_cannot_see(case: Case) -> None:
    layout, scheme, shape = case.layout, case.scheme, case.shape
    flips = hidden_flips(case)
    HIDDEN_FOUND[case.id] = len(flips)
    missed = [i for i, tensors in enumerate(flips)
              if not layout.byte_problems(tensors, layout.decode(tensors, shape, scheme), shape)]
    assert not missed, f"{len(missed)} of {len(flips)} edits decode cannot see pass byte_problems"


@pytest.mark.parametrize("group", groups(BYTE_CASES, "bytes"))
def test_byte_problems_refuses_a_byte_decode_cannot_see(group):
    run(group, refuses_what_decode_cannot_see)
    if not any(HIDDEN_FOUND.get(c.id) for c in group.cases):
        pytest.skip(f"{group.lid}: decode reads every byte of these layers (nothing padded or unused)")


def padded_case(cases: list[Case]) -> Case | None:
    """An MXFP4 case whose real I is below the I it is padded to (the engine pads it; the block holds zeros
    there): the layout's first case whose padded I takes a real I 32 (or 16) below it back."""
    for case in cases:
        Ip, layout = case.shape.intermediate_size, case.layout
        for below in (32, 16):
            I = Ip - below
            if case.scheme.kind == "mxfp4" and I > 0 and padded_sizes(case.shape.hidden_size, I,
                                                                        layout.pad_multiples)[1] == Ip:
                extra = {"hidden_size_unpadded": case.shape.hidden_size, "intermediate_size_unpadded": I}
                return case._replace(id=f"{case.id}/I{I}", shape=dataclasses.replace(case.shape, extra=extra))
    return None


PADDED = {lid: [c] for lid, cases in GOOD.items() if (c := padded_case(cases)) is not None}


def refuses_nonzero_padding(case: Case) -> None:
    layout, shape = case.layout, case.shape
    Ip, I = shape.intermediate_size, shape.extra["intermediate_size_unpadded"]
    block = make_block(case.scheme, shape, 1, seed_of(case.id))
    for rows in (slice(I, Ip), slice(Ip + I, None)):  # w13's rows [gate | 0 | up | 0]
        for name in ("w13", "w13_scale", "w13_bias"):
            if getattr(block, name) is not None:
                getattr(block, name)[:, rows] = 0
    block.w2[..., I // 2:], block.w2_scale[..., -(-I // 32):] = 0, 0
    tensors = layout.encode(block, shape)
    assert layout.byte_problems(tensors, layout.decode(tensors, shape, case.scheme), shape) == []
    block.w2[0, 0, -1] = 0x22  # a code 1.0 in a padding column of w2: the engine holds 0 there
    tensors = layout.encode(block, shape)
    problems = layout.byte_problems(tensors, layout.decode(tensors, shape, case.scheme), shape)
    assert len(problems) == 1 and problems[0].startswith("w2: 1 padding elements are not 0"), problems


@pytest.mark.parametrize("group", groups(PADDED, "bytes"))
def test_byte_problems_refuses_nonzero_padding(group):
    run(group, refuses_nonzero_padding)


# ---------------------------------------------------------------------------------------------------
# (b) check lists every violated constraint; (c) encode refuses what check refuses


class Break(NamedTuple):
    """One field of an accepted layer changed so that ``check`` refuses it, and the problems it lists."""

    field: str
    changes: dict  # LayerShape fields changed
    scheme: Scheme | None  # the scheme taken instead, when the field is the scheme
    problems: list[str]


def probes(scheme: Scheme, shape: LayerShape):
    """Per field of the layer, the changes tried in turn to break it (the first that check refuses is kept)."""
    yield "hidden_size", [dict(hidden_size=shape.hidden_size + d) for d in (8, 1)]
    yield "intermediate_size", [dict(intermediate_size=shape.intermediate_size + d) for d in (8, 1)]
    yield "num_experts", [dict(num_experts=n) for n in (2048, 0)]
    yield "dtype", [dict(dtype=dt) for dt in DTYPES if dt != shape.dtype]
    yield "has_bias", [dict(has_bias=not shape.has_bias, bias_dtype=None if shape.has_bias else "bfloat16")]
    yield "activation", [dict(activation="gelu")]
    if isinstance(scheme, WNA16Scheme):
        others = schemes("wna16") + [WNA16Scheme(2, 32, True, "bfloat16"), WNA16Scheme(4, 48, True, "bfloat16")]
        yield "scheme", [other for other in others if other != scheme]
    elif isinstance(scheme, MXFP4Scheme):
        yield "scheme", [MXFP4Scheme(block_size=16)]


# A WNA16 scheme's group size and pack factor are checked against H and I: a changed scheme and a changed
# size are not independent, so they are never combined (every other two fields are).
DEPENDENT = ({"scheme", "hidden_size"}, {"scheme", "intermediate_size"})


class Base(NamedTuple):
    """An accepted layer (the smallest of a scheme, first variant), the breaks check sees, and the pairs of
    independent breaks."""

    id: str
    layout: Layout
    scheme: Scheme
    shape: LayerShape
    breaks: list[Break]
    pairs: list[tuple[Break, Break]]

    def broken(self, *breaks: Break) -> tuple[LayerShape, Scheme]:
        shape = dataclasses.replace(self.shape, **{k: v for b in breaks for k, v in b.changes.items()})
        return shape, next((b.scheme for b in breaks if b.scheme is not None), self.scheme)


def _base(case: Case) -> Base:
    base = Base(case.id, case.layout, case.scheme, case.shape, [], [])
    for field, tries in probes(case.scheme, case.shape):
        for change in tries:
            brk = Break(field, {}, change, []) if field == "scheme" else Break(field, change, None, [])
            problems = case.layout.check(*base.broken(brk))
            if problems:
                base.breaks.append(brk._replace(problems=problems))
                break
    pairs = itertools.combinations(base.breaks, 2)
    base.pairs.extend((a, b) for a, b in pairs if {a.field, b.field} not in DEPENDENT)
    return base


def _bases(lid: str) -> list[Base]:
    first = {}
    for case in GOOD[lid]:
        scheme_variant = case.id.rsplit("/", 1)[0]
        if scheme_variant.endswith(f"/{VARIANTS[0].name}"):
            first.setdefault(scheme_variant, case)  # its smallest layer
    return [_base(case) for case in first.values()]


BASES = {lid: _bases(lid) for lid, _ in LAYOUTS}


def check_groups() -> list:
    """One test a layout over its bases with two independent breaks; a base without is a skip saying why."""
    out = []
    for lid, bases in BASES.items():
        if any(b.pairs for b in bases):
            out.append(pytest.param(Group(lid, [b for b in bases if b.pairs]), id=lid))
        for b in bases:
            if not b.pairs:
                tried = ", ".join(field for field, _ in probes(b.scheme, b.shape))
                why = (f"refuses only a change of {', '.join(x.field for x in b.breaks)}" if b.breaks
                       else f"accepts every change tried ({tried})")
                out.append(pytest.param(Group(lid, [b]), id=b.id, marks=pytest.mark.skip(
                    reason=f"check of {b.id} {why}: no two independent constraints to break at once")))
        if not bases:
            out.append(pytest.param(Group(lid, []), id=lid, marks=pytest.mark.skip(
                reason=f"{lid}: no layer of the variant {VARIANTS[0].name} is accepted, so none to break")))
    return out


def lists_each_violation(base: Base) -> None:
    assert base.layout.check(base.shape, base.scheme) == []
    for a, b in base.pairs:
        both = base.layout.check(*base.broken(a, b))
        assert len(both) >= 2 and Counter(both) == Counter(a.problems + b.problems), (
            f"{a.field} + {b.field}: check says {both}, each alone {a.problems} and {b.problems}")


@pytest.mark.parametrize("group", check_groups())
def test_check_lists_each_violated_constraint(group):
    run(group, lists_each_violation)


def refuses(layout: Layout, shape: LayerShape, scheme: Scheme, what: str) -> None:
    problems = layout.check(shape, scheme)
    assert problems, f"{what}: check accepts it"
    block = make_block(scheme, shape, min(shape.num_experts, 1), None)  # a chunk of one expert
    try:
        layout.encode(block, shape)
    except MoeConvertError as e:
        missing = [p for p in problems if p not in str(e)]
        assert not missing, f"{what}: encode's error does not say {missing}"
    else:
        raise AssertionError(f"{what}: encode wrote what check refuses ({problems})")


def refuses_each_break(base: Base) -> None:
    for brk in base.breaks:
        refuses(base.layout, *base.broken(brk), brk.field)
    for a, b in base.pairs:
        refuses(base.layout, *base.broken(a, b), f"{a.field} + {b.field}")


@pytest.mark.parametrize("group", groups({lid: [b for b in bases if b.breaks] for lid, bases in BASES.items()},
                                         "refuse"))
def test_encode_refuses_each_broken_layer(group):
    run(group, refuses_each_break)


@pytest.mark.parametrize("group", groups(REFUSED, "refuse"))
def test_encode_refuses_what_check_refuses_at_every_size(group):
    run(group, lambda case: refuses(case.layout, case.shape, case.scheme, case.id))


def _foreign(lid: str, layout: Layout) -> list[Case]:
    """A layer of each scheme kind the layout does not take."""
    return [Case(f"{lid}/{kind}", layout, schemes(kind)[0], make_layer(schemes(kind)[0], VARIANTS[0], 256, 256))
            for kind in KINDS if kind not in layout.schemes]


FOREIGN = {lid: _foreign(lid, layout) for lid, layout in LAYOUTS}


def one_problem_naming_the_kinds(case: Case) -> None:
    (problem,) = case.layout.check(case.shape, case.scheme)
    assert all(kind in problem for kind in layout_kinds(case.layout.name)), problem


@pytest.mark.parametrize("group", groups(FOREIGN, "kinds"))
def test_a_scheme_kind_the_layout_does_not_take_is_one_problem(group):
    run(group, one_problem_naming_the_kinds)


@pytest.mark.parametrize("group", groups(FOREIGN, "refuse"))
def test_encode_refuses_a_scheme_kind_the_layout_does_not_take(group):
    run(group, lambda case: refuses(case.layout, case.shape, case.scheme, case.id))
