"""The threaded reader (runtime/fastload.py) gives the bytes the direct reader gives, whatever the threads,
buffer size or the source's pace; refuses files that shrink or vanish mid-load; holds a bounded ring, not
the model; and `bench load --io` / `bench make-folder` produce what they say (CPU, no timing asserted)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from moeconvert.errors import MoeConvertError
from moeconvert.runtime import KernelFallbackWarning, load
from moeconvert.runtime import fastload
from moeconvert.bench.load import make_folder
from moeconvert.runtime.fastload import ThreadedReader, _Segment, plan_chunks
from moeconvert.runtime.loader import make_reader
from moeconvert.format import TensorInfo, read_header

from helpers import cli

TINY = dict(hidden=256, intermediate=128, experts=8)


@pytest.fixture(scope="module")
def plain_out(tmp_path_factory) -> Path:
    """Two MoE layers of 8 experts, plain layout, one shard per layer (and one for the rest)."""
    out = tmp_path_factory.mktemp("fastload") / "plain"
    r = make_folder(out, 0.00315, **TINY, max_shard_size=2 * 10**6)
    assert r["layers"] == 2 and r["shards"] >= 2
    return out


@pytest.fixture(scope="module")
def marlin_out(tmp_path_factory, example_ckpt) -> Path:
    src = example_ckpt("qwen3-moe", "w4a16", group_size=32, num_experts=4)
    out = tmp_path_factory.mktemp("fastload-marlin") / "marlin"
    cli("repack", src, out, "--backend", "marlin", "--max-shard-size", "200KB", expect=0)
    return out


def _load(out, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        return load(out, device="cpu", progress=False, **kw)


def _bytes(model) -> dict[str, bytes]:
    got = {}
    for layer in model:
        for k, t in list(layer.tensors.items()) + list(layer.shared_tensors.items()):
            got[f"{layer.prefix}.{k}"] = t.contiguous().view(torch.uint8).numpy().tobytes()
        if layer.router is not None:
            for k, t in vars(layer.router).items():
                if isinstance(t, torch.Tensor):
                    got[f"{layer.prefix}.router.{k}"] = t.contiguous().view(torch.uint8).numpy().tobytes()
    return got


def _same_as_direct(out, **kw):
    ref, got = _bytes(_load(out, reader="direct")), _bytes(_load(out, reader="threaded", **kw))
    assert got.keys() == ref.keys() and got, sorted(ref)
    for k in ref:
        assert got[k] == ref[k], k


# -- the bytes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("threads,buffer_mb", [(None, None), (1, 0.01), (4, 0.01), (4, 0.05), (3, 1)])
def test_identical_to_direct_plain(plain_out, threads, buffer_mb):
    # 0.01 MB: unaligned chunks smaller than one expert's rows; 0.05 MB: 4 KiB-aligned ones
    _same_as_direct(plain_out, threads=threads, buffer_mb=buffer_mb)


@pytest.mark.parametrize("threads,buffer_mb", [(1, 0.003), (4, 0.02)])
def test_identical_to_direct_marlin(marlin_out, threads, buffer_mb):
    _same_as_direct(marlin_out, threads=threads, buffer_mb=buffer_mb)


def test_one_layer_and_model_tensor(plain_out):
    m = _load(plain_out, reader="threaded", layers=[1], threads=2, buffer_mb=0.01)
    assert [layer.entry.index for layer in m] == [1]
    d = _load(plain_out, reader="direct", layers=[1])
    assert _bytes(m) == _bytes(d)
    assert torch.equal(m.tensor("lm_head.weight").view(torch.uint8), d.tensor("lm_head.weight").view(torch.uint8))


def _infos(path: Path, spans: list[tuple[int, int]]) -> list[TensorInfo]:
    return [TensorInfo(f"t{i}", path, "U8", (b - a,), a, b) for i, (a, b) in enumerate(spans)]


@pytest.mark.parametrize("chunk", [1000, 4096, 10_000, 1 << 20])
def test_plan_reads_every_byte_once_and_within_the_buffer(chunk):
    p = Path("/x.safetensors")
    # adjacent tensors, a small gap (read through), a large gap (skipped), an empty tensor, another file
    spans = [(100, 5000), (5000, 9000), (9100, 30_000), (30_000, 30_000), (5_000_000, 5_012_345)]
    infos = _infos(p, spans) + _infos(Path("/y.safetensors"), [(8, 20_000)])
    segs = [_Segment(i, torch.zeros(i.nbytes, dtype=torch.uint8)) for i in infos]
    chunks = plan_chunks(segs, chunk)
    seen = {i.name + str(i.file): [] for i in infos}
    for ch in chunks:
        assert 0 < ch.nbytes <= chunk
        for seg, t, c, n in ch.pieces:
            assert 0 <= c and c + n <= ch.nbytes
            assert ch.start + c == seg.info.start + t  # the piece's file offset is the tensor's
            seen[seg.info.name + str(seg.info.file)].append((t, n))
    for i in infos:
        pieces = sorted(seen[i.name + str(i.file)])
        assert sum(n for _, n in pieces) == i.nbytes
        at = 0
        for t, n in pieces:
            assert t == at
            at += n
    # the large gap is not read: no chunk spans it
    assert not any(ch.start < 1_000_000 < ch.start + ch.nbytes for ch in chunks)


def test_exact_plan_reads_only_the_bytes_asked_for():
    """A rank's byte ranges of tensors shared with other ranks: exact chunks cover those bytes and no
    other (no read-through gap, no aligned start), however the buffer cuts them."""
    p = Path("/x.safetensors")
    spans = [(100, 5000), (5000, 9000), (9100, 30_000), (30_001, 31_000)]
    segs = [_Segment(i, torch.zeros(i.nbytes, dtype=torch.uint8)) for i in _infos(p, spans)]
    for chunk in (1000, 4096, 1 << 20):
        read = set()
        for ch in plan_chunks(segs, chunk, exact=True):
            covered = set(range(ch.start, ch.start + ch.nbytes))
            assert not covered & read
            read |= covered
        assert read == {b for a, e in spans for b in range(a, e)}, chunk
    # the default plan reads the small gaps through
    assert any(ch.start < 9050 < ch.start + ch.nbytes for ch in plan_chunks(segs, 1 << 20))


@pytest.mark.parametrize("threads", [1, 3])
def test_pieces_land_in_their_destinations_reading_only_their_bytes(tmp_path, monkeypatch, threads):
    """``read_into_pieces``: byte ranges of a file into slices of one destination tensor, as the vLLM
    loader gives them (a rank's experts and TP cut); the reads total exactly the pieces' bytes."""
    data = bytes(range(256)) * 400
    f = tmp_path / "shard.bin"
    f.write_bytes(data)
    ranges = [(0, 10, 1000), (1000, 2000, 500), (5000, 0, 10), (60_000, 1010, 990), (102_000, 3000, 400)]
    dst = torch.zeros(3400, dtype=torch.uint8)
    pieces = [(TensorInfo(f"r{i}", f, "U8", (n,), a, a + n), dst[at:at + n]) for i, (a, at, n) in enumerate(ranges)]
    real, asked = fastload._pread, []

    def counting(fd, view, offset):
        n = real(fd, view, offset)
        asked.append(n)
        return n

    monkeypatch.setattr(fastload, "_pread", counting)
    with ThreadedReader(torch.device("cpu"), threads=threads, buffer_mb=0.0005, exact=True) as reader:
        reader.read_into_pieces(pieces)
    want = bytearray(3400)
    for a, at, n in ranges:
        want[at:at + n] = data[a:a + n]
    assert dst.numpy().tobytes() == bytes(want)
    assert sum(asked) == sum(n for _, _, n in ranges)
    with pytest.raises(ValueError, match="contiguous bytes"):
        ThreadedReader(torch.device("cpu")).read_into_pieces([(pieces[0][0], dst[:5])])


# -- a slow, stuttering source --------------------------------------------------------------------

def test_throttled_short_reads_still_identical(plain_out, monkeypatch):
    real, calls = fastload._pread, []

    def slow(fd, view, offset):
        calls.append(offset)
        time.sleep(0.0005)  # a network-like source: slow, and never more than 300 KB at a time
        return real(fd, view[:min(len(view), 1 + (offset * 7919) % (300 << 10))], offset)

    monkeypatch.setattr(fastload, "_pread", slow)
    _same_as_direct(plain_out, threads=4, buffer_mb=0.5)
    assert len(calls) > 20  # short reads were continued, not taken for the end of the file


# -- files that change under the loader -------------------------------------------------------------

def _copy(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(src, out)
    return out


def _expert_shard(out: Path) -> Path:
    m = json.loads((out / "moeconvert.json").read_text())
    return out / m["moe_layers"][0]["tensors"]["w13_weight"]["file"]


def test_truncated_mid_load(plain_out, tmp_path, monkeypatch):
    out = _copy(plain_out, tmp_path)
    shard = _expert_shard(out)
    real = fastload._pread

    def truncating(fd, view, offset):
        if shard.stat().st_size > 100_000:
            os.truncate(shard, 100_000)  # another process shrinks the file after the manifest check
        return real(fd, view, offset)

    monkeypatch.setattr(fastload, "_pread", truncating)
    with pytest.raises(MoeConvertError) as e:
        _load(out, reader="threaded", threads=2, buffer_mb=0.01)
    msg = e.value.line()
    assert "truncated during the load" in msg and shard.name in msg and "found 100000 bytes" in msg
    assert "model.layers.0.mlp.experts." in msg and "\n" not in msg


def test_vanished_mid_load(plain_out, tmp_path, monkeypatch):
    out = _copy(plain_out, tmp_path)
    m = json.loads((out / "moeconvert.json").read_text())
    second = out / m["moe_layers"][1]["tensors"]["w13_weight"]["file"]
    assert second != _expert_shard(out)
    real = fastload._pread

    def deleting(fd, view, offset):
        if second.exists():
            second.unlink()  # the second shard goes while the first is being read
        return real(fd, view, offset)

    monkeypatch.setattr(fastload, "_pread", deleting)
    with pytest.raises(MoeConvertError) as e:
        _load(out, reader="threaded", threads=1, buffer_mb=0.05)
    msg = e.value.line()
    assert "cannot open the shard during the load" in msg and second.name in msg
    assert "model.layers.1." in msg


def test_read_error_names_file_and_tensor(plain_out, monkeypatch):
    def failing(fd, view, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fastload, "_pread", failing)
    with pytest.raises(MoeConvertError, match=r"model\.layers\.0.*cannot read the shard at byte \d+: Input/output error$"):
        _load(plain_out, reader="threaded", threads=3, buffer_mb=0.01)


# -- options ---------------------------------------------------------------------------------------------

def test_defaults_and_environment(monkeypatch):
    monkeypatch.delenv("MOECONVERT_LOAD_THREADS", raising=False)
    monkeypatch.delenv("MOECONVERT_LOAD_BUFFER_MB", raising=False)
    r = ThreadedReader(torch.device("cpu"))
    assert r.threads == min(8, os.cpu_count() or 1) and r.buffer_bytes == 64 << 20
    monkeypatch.setenv("MOECONVERT_LOAD_THREADS", "3")
    monkeypatch.setenv("MOECONVERT_LOAD_BUFFER_MB", "16")
    r = ThreadedReader(torch.device("cpu"))
    assert (r.threads, r.buffer_bytes) == (3, 16 << 20)
    assert ThreadedReader(torch.device("cpu"), threads=5, buffer_mb=2).threads == 5
    monkeypatch.setenv("MOECONVERT_LOAD_THREADS", "many")
    with pytest.raises(MoeConvertError, match="MOECONVERT_LOAD_THREADS"):
        ThreadedReader(torch.device("cpu"))
    with pytest.raises(MoeConvertError, match="threads must be at least 1"):
        ThreadedReader(torch.device("cpu"), threads=0)


def test_auto_is_threaded_on_cuda_and_direct_on_cpu(monkeypatch):
    monkeypatch.delenv("MOECONVERT_READER", raising=False)
    assert make_reader("auto", torch.device("cpu")).name == "direct"
    assert make_reader("auto", torch.device("cuda", 0)).name == "threaded"  # constructing touches no GPU
    assert make_reader("threaded", torch.device("cpu")).name == "threaded"
    monkeypatch.setenv("MOECONVERT_READER", "pinned")
    with pytest.raises(MoeConvertError):  # pinned needs CUDA; it is still selectable
        make_reader("auto", torch.device("cpu"))


def test_progress_bar_only_when_asked_or_large_on_a_terminal(plain_out, capsys):
    assert fastload._Progress(10 << 30, None, "x")._bar is None  # stderr is no terminal under pytest
    assert fastload._Progress(10 << 30, False, "x")._bar is None
    bar = fastload._Progress(10, True, "x")
    assert bar._bar is not None
    bar.close()
    capsys.readouterr()
    _load(plain_out, reader="threaded")
    assert capsys.readouterr().err == ""


# -- host memory --------------------------------------------------------------------------------------

_RSS_PROBE = textwrap.dedent("""
    import json, sys, warnings
    from pathlib import Path
    import torch
    from moeconvert.runtime import load
    from moeconvert.runtime.manifest import read_checked

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    out, reader = sys.argv[1], sys.argv[2]
    read_checked(Path(out))
    torch.empty(1 << 20).fill_(1)  # allocator and libraries warmed before the baseline
    before = hwm()
    warnings.simplefilter("ignore")
    m = load(out, device="cpu", reader=reader, threads=2, buffer_mb=16, progress=False)
    loaded = sum(t.numel() * t.element_size() for l in m for t in l.tensors.values())
    print(json.dumps({"growth": hwm() - before, "loaded": loaded}))
""")


@pytest.fixture(scope="module")
def big_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fastload-rss") / "plain"
    make_folder(out, 0.2)  # one layer of Qwen3-30B-shaped experts, ~200 MB
    return out


def test_peak_host_memory_is_the_result_plus_the_ring(big_out):
    def probe(reader):
        r = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(big_out), reader], capture_output=True,
                           text=True, check=True)
        return json.loads(r.stdout)

    got = probe("threaded")
    ring = 2 * 2 * (16 << 20)
    # on CPU the result itself is host memory; beyond it only the ring (and no mapped file pages)
    assert got["loaded"] > 150e6
    assert got["growth"] < got["loaded"] + ring + (32 << 20), got
    # the mapped reader holds the file's pages as well while it copies
    assert probe("direct")["growth"] > got["growth"] + 0.5 * got["loaded"]


# -- the bench ---------------------------------------------------------------------------------------

def test_make_folder_is_a_valid_output(tmp_path):
    r = json.loads(cli("bench", "make-folder", tmp_path / "f", "--gb", 0.002, "--experts", 8, "--json", expect=0).out)
    assert r["layers"] == 1 and r["experts"] == 8 and r["bytes"] > 2e6
    cli("verify", tmp_path / "f", expect=0)
    m = json.loads((tmp_path / "f" / "moeconvert.json").read_text())
    assert m["layout"]["name"] == "plain" and m["family"] == "qwen3-moe"
    layer = m["moe_layers"][0]
    assert layer["tensors"]["w13_weight"]["shape"] == [8, 2 * 768, 2048] and layer["hidden_size"] == 2048


def test_bench_load_io(plain_out):
    r = json.loads(cli("bench", "load", plain_out, "--device", "cpu", "--runs", 1, "--io", "--cold-runs", 0,
                       "--threads", 2, "--buffer-mb", 1, "--json", expect=0).out)["io"]
    assert set(r["warm_bytes_per_s"]) == {"ours", "ours_direct", "safetensors_load_file",
                                          "safetensors_mmap_to_device", "sequential_read"}
    assert all(v > 0 for v in r["warm_bytes_per_s"].values())
    assert r["cold_bytes_per_s"] == {} and r["h2d_bytes_per_s"] is None
    assert r["ratios"]["ours_warm_vs_safetensors_load_file"] > 0 and r["load_bytes"] <= r["file_bytes"]
    text = cli("bench", "load", plain_out, "--device", "cpu", "--runs", 1, "--io", "--cold-runs", 0, expect=0).out
    assert "moeconvert load (threaded, " in text and "sequential read" in text
    assert "cold: not measured (no cold runs asked for)" in text


def test_eviction_falls_back_and_says_so(plain_out, tmp_path, monkeypatch):
    from moeconvert.bench import load as bench

    files = sorted(plain_out.glob("*.safetensors"))
    bench.sequential_read(files)
    assert bench.resident_fraction(files) > 0.9
    monkeypatch.setattr(bench, "DROP_CACHES", str(tmp_path / "no" / "drop_caches"))
    got = bench.evict(files)
    assert "drop_caches failed" in got["note"]
    assert got["how"] == "posix_fadvise(DONTNEED)" and got["cold"] and got["resident_after"] <= 0.01


# -- CUDA (skipped here) -----------------------------------------------------------------------------

@pytest.mark.gpu
def test_identical_to_direct_on_cuda(plain_out):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = load(plain_out, device="cuda", reader="direct", kernel="reference")
        for threads, mb in ((None, None), (4, 0.01), (1, 0.05)):
            b = load(plain_out, device="cuda", reader="threaded", threads=threads, buffer_mb=mb, progress=False)
            for la, lb in zip(a, b):
                for k in la.tensors:
                    assert torch.equal(la.tensors[k].view(torch.uint8), lb.tensors[k].view(torch.uint8)), k


# -- a flipped bit on every read path ---------------------------------------------------------------

_FLIP_PATHS = [("cpu", "threaded", None), ("cpu", "threaded", 0.01),
               pytest.param("cuda", "pinned", None, marks=pytest.mark.gpu),
               pytest.param("cuda", "pinned", 0.01, marks=pytest.mark.gpu),
               pytest.param("cuda", "threaded", None, marks=pytest.mark.gpu),
               pytest.param("cuda", "threaded", 0.01, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device,reader,buffer_mb", _FLIP_PATHS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_bit_is_refused_on_every_read_path(plain_out, tmp_path, device, reader, buffer_mb, where):
    """load(verify=True) hashes the bytes on the way to the device; a bit flipped anywhere in an expert
    tensor (its first, a middle or its last byte; a buffer much smaller than the tensor puts the flip in a
    later chunk than the first) never reaches the caller, on the CPU and through the pinned staging
    buffers that only CUDA uses."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = tmp_path / "out"
    shutil.copytree(plain_out, out)
    kw = dict(device=device, reader=reader, buffer_mb=buffer_mb, verify=True, progress=False, kernel="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        assert len(load(out, **kw).moe_layers) == 2  # the untouched copy loads: the check can pass
    manifest = json.loads((out / "moeconvert.json").read_text())
    entry = manifest["moe_layers"][-1]["tensors"]["w13_weight"]
    info = read_header(out / entry["file"])[entry["name"]]
    at = {"first": info.start, "middle": (info.start + info.end) // 2, "last": info.end - 1}[where]
    with open(out / entry["file"], "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(MoeConvertError) as exc:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KernelFallbackWarning)
            load(out, **kw)
    line = str(exc.value)
    assert "checksum mismatch" in line and entry["name"] in line and entry["file"] in line, line
