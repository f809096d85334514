"""What a kernel config table accepts (kernels/configs.py; docs/kernels.md, "What a table accepts").

Every rule of the contract, over every key: a table breaking it is refused in one line naming the file and
the key, by the lookup every ``triton-fast`` layer on a GPU makes, before any config reaches Triton; every
documented value is taken. Writing a tuned entry replaces what cannot be read, and says so.
"""

from __future__ import annotations

import json

import pytest

from moeconvert.errors import MoeConvertError
from moeconvert.kernels import configs

from interpreted import REPO

GPU = "Test GPU"
KEY = "int4/g128 E=4 k=2 H=256 I=128"
GOOD = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=4)


def _table(**entries):
    return {"device": GPU, "triton": "3.6.0", "entries": entries or {KEY: {"16": [dict(GOOD), dict(GOOD)]}}}


@pytest.fixture
def named(tmp_path, monkeypatch):
    """Writes a table (an object, or the file's raw text / bytes) to the file the variable names."""
    path = tmp_path / "table.json"
    monkeypatch.setenv(configs.ENV_TABLE, str(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    configs.clear_cache()

    def write(data):
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data if isinstance(data, str) else json.dumps(data))
        configs.clear_cache()
        return path

    yield write
    configs.clear_cache()


def _refused(path, where: str) -> str:
    """The lookup's refusal: MoeConvertError, one line, naming the file and ``where``."""
    with pytest.raises(MoeConvertError) as e:
        configs.lookup(KEY, 16, GPU)
    line = str(e.value)
    assert "\n" not in line and str(path) in line and where in line, line
    return line


def _config_with(key, value):
    t = _table()
    for c in t["entries"][KEY]["16"]:
        if value is _MISSING:
            del c[key]
        else:
            c[key] = value
    return t


_MISSING = object()
_WHERE = f"entries[{KEY!r}]['16'] GEMM1"

#: the keys docs/kernels.md documents ("What a table accepts")
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages", "OPERAND_SCALE", "GROUP_DOTS")

# every key: values of the wrong type (JSON strings, floats, booleans) and out of range
_BAD_VALUES = [(k, v) for k in KEYS for v in ("16", 16.0, True, None)]
_BAD_VALUES += [(k, v) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") for v in (0, 8, 48, 96, 512, -16)]
_BAD_VALUES += [("num_warps", v) for v in (0, 3, 6, 64, -4)]
_BAD_VALUES += [(k, v) for k in ("GROUP_M", "SPLIT_K", "num_stages") for v in (0, -1)]
_BAD_VALUES += [(k, v) for k in ("OPERAND_SCALE", "GROUP_DOTS") for v in (2, -1)]
_BAD_VALUES += [(k, _MISSING) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")]
_BAD_VALUES += [(k, 1) for k in ("SWAP_AB", "block_n", "BLOCK_SIZE_N")]  # keys the kernel does not read


@pytest.mark.parametrize("key,value", _BAD_VALUES, ids=lambda v: repr(v) if v is not _MISSING else "missing")
def test_every_key_refuses_what_the_kernel_cannot_run(named, key, value):
    path = named(_config_with(key, value))
    line = _refused(path, _WHERE)
    assert key in line


# every documented value of every key is taken (one GEMM1 at a time, the rest as GOOD)
_GOOD_VALUES = [(k, v) for k in ("BLOCK_M", "BLOCK_N") for v in (16, 32, 64, 128, 256)]
_GOOD_VALUES += [("BLOCK_K", v) for v in (64, 128, 256)] + [("num_warps", v) for v in (1, 2, 4, 8, 16, 32)]
_GOOD_VALUES += [(k, v) for k in ("GROUP_M", "SPLIT_K", "num_stages") for v in (1, 8)]
_GOOD_VALUES += [(k, v) for k in ("OPERAND_SCALE", "GROUP_DOTS") for v in (0, 1)]
_GOOD_VALUES += [(k, _MISSING) for k in ("GROUP_M", "SPLIT_K", "num_warps", "num_stages")]


@pytest.mark.parametrize("key,value", _GOOD_VALUES, ids=lambda v: repr(v) if v is not _MISSING else "missing")
def test_every_documented_value_is_taken(named, key, value):
    t = _config_with(key, value)
    named(t)
    assert configs.lookup(KEY, 16, GPU) == tuple(t["entries"][KEY]["16"])


@pytest.mark.parametrize("fmt,group,block_k,ok", [
    ("int4", "g128", 32, False), ("mxfp4", "mx32", 32, False), ("int8", "g128", 16, False),
    ("int8", "gch", 32, True), ("mxfp4", "mx32", 64, True)])
def test_block_k_is_whole_weight_atoms_of_the_entrys_format(named, fmt, group, block_k, ok):
    key = f"{fmt}/{group} E=4 k=2 H=256 I=128"
    pair = [dict(GOOD, BLOCK_K=block_k), dict(GOOD)]
    path = named(_table(**{key: {"16": pair}}))
    if ok:
        assert configs.lookup(key, 16, GPU) == tuple(pair)
        return
    with pytest.raises(MoeConvertError, match=f"{fmt} weights are read in") as e:
        configs.lookup(key, 16, GPU)
    assert str(path) in str(e.value) and "GEMM1.BLOCK_K" in str(e.value)


def test_group_dots_needs_block_k_at_most_128(named):
    t = _config_with("GROUP_DOTS", 1)
    t["entries"][KEY]["16"][0]["BLOCK_K"] = 256
    path = named(t)
    assert "<= 128 with GROUP_DOTS = 1" in _refused(path, f"{_WHERE}.BLOCK_K")


@pytest.mark.parametrize("pair,needle", [
    ([dict(GOOD)], "a list of two objects"),
    ([dict(GOOD)] * 3, "a list of two objects"),
    ({"GEMM1": dict(GOOD)}, "a list of two objects"),
    ([dict(GOOD), dict(GOOD, BLOCK_M=32)], "16 and 32"),
    ([dict(GOOD), [16, 64]], "a tile config is a JSON object"),
])
def test_a_pair_is_two_configs_with_one_block_m(named, pair, needle):
    path = named(_table(**{KEY: {"16": pair}}))
    assert needle in _refused(path, f"entries[{KEY!r}]['16']")


@pytest.mark.parametrize("tokens", ["0", "-1", "1.5", "abc", "", " 16", "016", "1e3"])
def test_token_counts_are_positive_integers_in_digits(named, tokens):
    path = named(_table(**{KEY: {tokens: [dict(GOOD), dict(GOOD)]}}))
    assert "token count" in _refused(path, f"entries[{KEY!r}][{tokens!r}]")


@pytest.mark.parametrize("key", [
    "int4 E=4 k=2 H=256 I=128", "int4/g128 E=4 k=2 H=256", "int4/mx32 E=4 k=2 H=256 I=128",
    "mxfp4/g32 E=4 k=2 H=256 I=128", "fp8/g128 E=4 k=2 H=256 I=128", "int4/g128 E=0 k=2 H=256 I=128",
    "int4/g128 E=4 k=2 H=256 I=128 ", "layer 3"])
def test_entry_keys_name_one_layer_shape(named, key):
    path = named(_table(**{key: {"16": [dict(GOOD), dict(GOOD)]}}))
    assert "names one layer shape" in _refused(path, f"entries[{key!r}]")


@pytest.mark.parametrize("entry", [{}, [], "16", None])
def test_an_entry_maps_token_counts_to_pairs(named, entry):
    path = named(_table(**{KEY: entry}))
    assert "maps token counts" in _refused(path, f"entries[{KEY!r}]")


@pytest.mark.parametrize("data,needle", [
    ([], "'entries' object"), ({"device": GPU}, "'entries' object"), ({"entries": []}, "'entries' object"),
    ({"entries": "abc"}, "'entries' object"), (dict(_table(), extra=1), "unknown table key"),
    ('{"entries": {"int4/g128 E=4 k=2', "not valid JSON"),  # a truncated write
    (b"\xff\xfe\x00binary", "not valid JSON"),
])
def test_a_file_that_is_no_table_is_refused_naming_it(named, data, needle):
    path = named(data)
    assert needle in _refused(path, "")


def test_a_refused_table_says_what_to_do(named):
    line = _refused(named(_config_with("BLOCK_N", 48)), _WHERE)
    assert "fix or delete the table" in line


def test_the_variable_naming_no_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(configs.ENV_TABLE, str(tmp_path / "missing.json"))
    configs.clear_cache()
    with pytest.raises(MoeConvertError, match="names no file") as e:
        configs.lookup(KEY, 16, GPU)
    assert configs.ENV_TABLE in str(e.value) and "missing.json" in str(e.value)
    monkeypatch.setenv(configs.ENV_TABLE, str(tmp_path))  # a folder is no table either
    with pytest.raises(MoeConvertError, match="names no file"):
        configs.has_entry(KEY, GPU)
    monkeypatch.setenv(configs.ENV_TABLE, "")  # empty: no named table (documented), the others are read
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert configs.lookup(KEY, 16, GPU) is None


def test_the_documented_keys_are_the_kernels():
    assert tuple(configs.TILE_KEYS) == KEYS


def test_the_shipped_tables_pass_the_checks():
    tables = sorted((REPO / "kernels" / "tuned").glob("*.json"))
    assert tables
    for path in tables:
        assert configs.check_table(json.loads(path.read_text()), path)


# ---------------------------------------------------------------------------------------------------
# writing a tuned entry over what is there


@pytest.mark.parametrize("old", [
    '{"entries": {"int4/g128 E=4 k=2', b"\xff\xfe\x00binary", "[]", '{"entries": []}', '{"entries": "abc"}',
    '{"entries": [1, 2]}', "null"])
def test_writing_over_an_unreadable_table_replaces_it_and_says_so(tmp_path, old):
    path = tmp_path / "t.json"
    path.write_bytes(old if isinstance(old, bytes) else old.encode())
    said = []
    configs.write_table(path, GPU, {KEY: {"1": [dict(GOOD), dict(GOOD)]}}, log=said.append)
    data = json.loads(path.read_text())
    assert configs.check_table(data, path) == {KEY: {"1": [GOOD, GOOD]}}
    assert len(said) == 1 and "replacing the unreadable table" in said[0] and str(path) in said[0], said
    assert not list(tmp_path.glob("*.tmp"))


def test_writing_keeps_the_valid_entries_and_drops_each_invalid_one_by_name(tmp_path):
    path = tmp_path / "t.json"
    other = "int8/gch E=8 k=2 H=256 I=128"
    bad = _table(**{other: {"1": [dict(GOOD), dict(GOOD)]}, KEY: {"1": [dict(GOOD, BLOCK_N=48), dict(GOOD)]},
                    "layer 3": {"1": [dict(GOOD), dict(GOOD)]}})
    path.write_text(json.dumps(bad))
    said = []
    new = "mxfp4/mx32 E=4 k=2 H=256 I=128"
    configs.write_table(path, GPU, {new: {"16": [dict(GOOD), dict(GOOD)]}}, log=said.append)
    entries = configs.check_table(json.loads(path.read_text()), path)
    assert set(entries) == {other, new}
    assert len(said) == 2 and any("BLOCK_N" in s for s in said) and any("layer 3" in s for s in said), said


def test_writing_refuses_an_entry_the_kernel_cannot_run(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(MoeConvertError, match="SPLIT_K"):
        configs.write_table(path, GPU, {KEY: {"1": [dict(GOOD, SPLIT_K=0), dict(GOOD)]}})
    assert not path.exists()


def test_a_table_path_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(MoeConvertError, match="cannot write the tuned table") as e:
        configs.check_writable(blocker / "kernel-configs" / "t.json")
    assert "\n" not in str(e.value) and str(blocker) in str(e.value)
    (tmp_path / "t.json").mkdir()
    with pytest.raises(MoeConvertError, match="cannot write the tuned table"):
        configs.check_writable(tmp_path / "t.json")
