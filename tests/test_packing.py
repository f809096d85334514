"""Bit packing equals compressed-tensors' pack_to_int32 (docs/format.md, vectors verified there
by running compressed-tensors 0.17.0) and inverts exactly."""

import torch

from moeconvert.packing import pack_int32, unpack_int32


def words(t):
    return [w & 0xFFFFFFFF for w in t.reshape(-1).tolist()]


def test_int4_row_vectors_from_spec():
    up = torch.arange(-8, 8, dtype=torch.int16) + 8  # unsigned fields of codes -8..7
    assert words(pack_int32(up.view(1, 16), 4)) == [0x76543210, 0xFEDCBA98]
    down = torch.arange(7, -9, -1, dtype=torch.int16) + 8
    assert words(pack_int32(down.view(1, 16), 4)) == [0x89ABCDEF, 0x01234567]


def test_int4_little_endian_bytes_from_spec():
    up = (torch.arange(-8, 8) + 8).view(1, 16)
    assert bytes(pack_int32(up, 4).numpy().tobytes()).hex(" ") == "10 32 54 76 98 ba dc fe"


def test_int8_row_vector_from_spec():
    codes = torch.tensor([-128, -1, 0, 127, 1, 2, 3, 4]) + 128
    assert words(pack_int32(codes.view(1, 8), 8)) == [0xFF807F00, 0x84838281]


def test_zero_points_pack_along_rows_from_spec():
    zp = (torch.arange(16) - 8 + 8).view(16, 1).expand(16, 2)  # zp[n] = n - 8, two groups
    assert words(pack_int32(zp, 4, dim=0)) == [0x76543210, 0x76543210, 0xFEDCBA98, 0xFEDCBA98]


def test_round_trip_random():
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        u = torch.randint(0, 1 << bits, (3, 5, 64), generator=g, dtype=torch.uint8)
        for dim in (1, 2) if bits == 8 else (2,):
            n = u.shape[dim]
            if n % (32 // bits):
                continue
            assert torch.equal(unpack_int32(pack_int32(u, bits, dim=dim), bits, n, dim=dim), u)


def test_unpack_trims_tail_fields():
    # K=3 int4 row [1,2,3] is stored as 0x00000ba9 (spec §1.3): the tail fields are zero
    w = torch.tensor([[0x00000BA9]], dtype=torch.int32)
    assert unpack_int32(w, 4, 3).tolist() == [[1 + 8, 2 + 8, 3 + 8]]


def test_matches_compressed_tensors_pack_to_int32():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(1)
    for bits in (4, 8):
        lo = -(1 << (bits - 1))
        q = torch.randint(lo, -lo, (48, 64), generator=g, dtype=torch.int8)
        u = (q.to(torch.int16) - lo).to(torch.uint8)
        for dim in (0, 1):
            theirs = pack_to_int32(q, bits, packed_dim=dim)
            assert torch.equal(pack_int32(u, bits, dim=dim), theirs)
            back = unpack_from_int32(theirs, bits, q.shape, packed_dim=dim)
            assert torch.equal(unpack_int32(theirs, bits, q.shape[dim], dim=dim).to(torch.int16) + lo, back.to(torch.int16))


def _reference_words(u: torch.Tensor, bits: int) -> list[int]:
    """The spec's rule, field by field: element j -> word j // pf, bits [b*(j % pf), b*(j % pf) + b)."""
    pf = 32 // bits
    out = []
    for row in u.reshape(-1, u.shape[-1]).tolist():
        for w in range(len(row) // pf):
            out.append(sum(v << (bits * i) for i, v in enumerate(row[w * pf:(w + 1) * pf])))
    return out


def test_byte_view_path_equals_the_field_rule_on_awkward_shapes():
    # size-1 dimensions and packing along a middle dim give strides that a dtype view must not trip on
    g = torch.Generator().manual_seed(2)
    for bits in (4, 8):
        for shape, dim in (((1, 1, 16), 2), ((3, 1, 8), 2), ((1, 16, 1), 1), ((2, 32, 3), 1), ((16, 1), 0)):
            u = torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.uint8)
            if shape[dim] % (32 // bits):
                continue
            packed = pack_int32(u, bits, dim=dim)
            assert words(packed.movedim(dim, -1)) == _reference_words(u.movedim(dim, -1), bits), (bits, shape, dim)
            assert torch.equal(unpack_int32(packed, bits, shape[dim], dim=dim), u), (bits, shape, dim)
