"""The two registries, and the one link between them: a layout names the runtime kernels that read it.

* a layout and a runtime kernel from outside the package, registered by call
  (``moeconvert.layouts.register``, ``moeconvert.runtime.register_kernel``) and through the entry-point
  groups ``moeconvert.layouts`` / ``moeconvert.kernels`` (a dist-info folder on ``sys.path``): a real
  checkpoint converted with ``--backend`` that name and loaded is dispatched to that kernel;
* a plugin that cannot be loaded is one error line naming its entry point;
* every built-in layout's kernel names are registered, and the old disagreement (a kernel claiming a
  layout its code cannot read, here vLLM's ``triton`` MXFP4 layout) cannot come back.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch

import moeconvert.layouts as layouts
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import get_layout, layout_classes, layout_names, register
from moeconvert.layouts.plain import PlainLayout
from moeconvert.runtime import Kernel, KernelFallbackWarning, dispatch, load, register_kernel
from moeconvert.schemes import MXFP4Scheme

from helpers import cli, rel, same_bits, st_tensors

# A plugin: the plain layout's bytes under another name, read by a kernel of its own. The same source
# is the module the entry points name.
PLUGIN = '''
import torch

from moeconvert.layouts.plain import PlainLayout
from moeconvert.runtime import Kernel

CALLS = []


class ToyLayout(PlainLayout):
    name = "toy-plain"
    version = 1
    schemes = ("wna16",)
    runtime_kernels = ("toy-dense",)
    kernel = "toy-dense (a dense einsum over every expert, tests/test_registry.py)"


def _unavailable(layer, device):
    return None if layer.entry.expert_offset == 0 else "toy-dense runs whole layers only (no EP cut)"


def _run(layer, x, topk_weights, topk_ids):
    """Every expert on every token, weighted by a dense [M, E] routing matrix: not the reference's
    algorithm (a grouped loop over the chosen experts), the same function."""
    CALLS.append(layer.prefix)
    d = layer.dequantized()
    h = torch.einsum("mk,enk->men", x.float(), d.w13)
    inter = h.shape[-1] // 2
    y = torch.einsum("mei,ehi->meh", layer.act(h[..., :inter], h[..., inter:]), d.w2)
    w = torch.zeros(x.shape[0], d.w13.shape[0]).scatter_add_(1, topk_ids.long(), topk_weights.float())
    return (y * w[..., None]).sum(1).to(x.dtype)


KERNEL = Kernel("toy-dense", _unavailable, _run)
'''


def _plugin_module() -> types.ModuleType:
    mod = types.ModuleType("toy_registry_plugin")
    exec(compile(PLUGIN, "<toy plugin>", "exec"), mod.__dict__)
    return mod


@pytest.fixture
def registries(monkeypatch):
    """Both registries as they are now, restored after the test; entry points not loaded yet."""
    monkeypatch.setattr(layouts, "_REGISTRY", {k: list(v) for k, v in layouts._REGISTRY.items()})
    monkeypatch.setattr(layouts._PLUGINS, "loaded", False)
    monkeypatch.setattr(dispatch, "_KERNELS", dict(dispatch._KERNELS))
    monkeypatch.setattr(dispatch._PLUGINS, "loaded", False)
    monkeypatch.setattr(dispatch, "_SAID", set())
    monkeypatch.delitem(sys.modules, "toy_registry_plugin", raising=False)
    yield
    sys.modules.pop("toy_registry_plugin", None)


def _dist(tmp_path: Path, monkeypatch, entry_points: str, module: str | None = PLUGIN) -> None:
    """A distribution as pip leaves it: a module and a dist-info folder with entry_points.txt."""
    site = tmp_path / "site"
    info = site / "toy_registry_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-registry-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    if module is not None:
        (site / "toy_registry_plugin.py").write_text(module)
    monkeypatch.syspath_prepend(str(site))


@pytest.fixture(scope="module")
def w4a16(example_ckpt):
    return example_ckpt("qwen3-moe", "w4a16", num_layers=2, num_experts=4)


@pytest.fixture(scope="module")
def plain_out(w4a16, tmp_path_factory):
    out = tmp_path_factory.mktemp("registry") / "plain"
    cli("repack", w4a16, out, "--backend", "plain", expect=0)
    return out


def _converts_and_dispatches(src: Path, plain_out: Path, out: Path, calls: list) -> None:
    cli("repack", src, out, "--backend", "toy-plain", expect=0)
    mine, plain = st_tensors(out), st_tensors(plain_out)
    assert mine.keys() == plain.keys() and all(same_bits(mine[k], plain[k]) for k in mine)  # plain's bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)  # its own kernel runs: nothing to say
        model = load(out, device="cpu")
    assert model.manifest["layout"]["name"] == "toy-plain"
    assert set(model.kernels().values()) == {"toy-dense"}
    x = torch.randn(9, next(iter(model)).hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in model:
        assert layer.kernel == "toy-dense" and layer.kernel_note is None
        w, ids = layer.route(layer.router_logits(x))
        y, want = layer(x, w, ids), layer.reference(x, w, ids)
        assert y.dtype == want.dtype and rel(y, want) < 1e-5
    assert calls == list(model.moe_layers)


def test_a_layout_and_a_kernel_registered_by_call(registries, w4a16, plain_out, tmp_path):
    plugin = _plugin_module()
    register(plugin.ToyLayout)
    register_kernel(plugin.KERNEL)
    assert "toy-plain" in layout_names() and "toy-dense" in dispatch.kernel_names()
    _converts_and_dispatches(w4a16, plain_out, tmp_path / "out", plugin.CALLS)
    # and the name can be forced like a built-in one
    assert next(iter(load(tmp_path / "out", device="cpu", kernel="toy-dense"))).kernel == "toy-dense"


def test_a_layout_and_a_kernel_from_entry_points(registries, w4a16, plain_out, tmp_path, monkeypatch):
    _dist(tmp_path, monkeypatch, """
        [moeconvert.layouts]
        toy-plain = toy_registry_plugin:ToyLayout

        [moeconvert.kernels]
        toy-dense = toy_registry_plugin:KERNEL
    """)
    assert "toy_registry_plugin" not in sys.modules  # loaded lazily, by the first use of a registry
    assert "toy-plain" in layout_names() and "toy-dense" in dispatch.kernel_names()
    assert layout_names().count("toy-plain") == 1  # loaded once
    _converts_and_dispatches(w4a16, plain_out, tmp_path / "out", sys.modules["toy_registry_plugin"].CALLS)


def test_an_entry_point_may_name_a_module_that_registers_on_import(registries, tmp_path, monkeypatch):
    module = PLUGIN + textwrap.dedent('''
        from moeconvert.layouts import register
        from moeconvert.runtime import register_kernel

        register(ToyLayout)
        register_kernel(KERNEL)
    ''')
    _dist(tmp_path, monkeypatch, """
        [moeconvert.layouts]
        toy = toy_registry_plugin

        [moeconvert.kernels]
        toy = toy_registry_plugin
    """, module)
    assert get_layout("toy-plain", "wna16").runtime_kernels == ("toy-dense",)
    assert "toy-dense" in dispatch.kernel_names()


@pytest.mark.parametrize("group,value,ask", [
    ("moeconvert.layouts", "toy_registry_missing:ToyLayout", layout_names),
    ("moeconvert.layouts", "toy_registry_plugin:KERNEL", layout_names),  # not a Layout subclass
    ("moeconvert.kernels", "toy_registry_plugin:NOT_THERE", dispatch.kernel_names),
    ("moeconvert.kernels", "toy_registry_plugin:ToyLayout", dispatch.kernel_names),  # not a Kernel
])
def test_a_broken_plugin_is_one_line_naming_its_entry_point(registries, tmp_path, monkeypatch, group, value, ask):
    _dist(tmp_path, monkeypatch, f"[{group}]\nbroken = {value}\n")
    with pytest.raises(MoeConvertError) as exc:
        ask()
    text = str(exc.value)
    assert "\n" not in text
    assert f"entry point 'broken = {value}' (group {group}, distribution toy-registry-plugin)" in text
    with pytest.raises(MoeConvertError):
        ask()  # said again on the next use, not silently missing


def test_a_broken_layout_plugin_is_a_user_error_of_the_cli(registries, tmp_path, monkeypatch, w4a16):
    _dist(tmp_path, monkeypatch, "[moeconvert.layouts]\nbroken = toy_registry_missing:ToyLayout\n")
    err = cli("repack", w4a16, tmp_path / "out", "--backend", "plain", expect=2).err
    assert err.count("\n") == 1 and "entry point 'broken = toy_registry_missing:ToyLayout'" in err


def test_a_layout_states_its_kernels_itself(registries):
    class Inherits(PlainLayout):  # would silently claim the reference as its own kernel
        name = "toy-inherits"
        version = 1
        schemes = ("wna16",)

    with pytest.raises(ValueError, match="must declare its own runtime_kernels"):
        register(Inherits)


# ---------------------------------------------------------------------------------------------------
# the built-in layouts and kernels


def test_every_builtin_layout_names_registered_kernels():
    known = set(dispatch.kernel_names())
    assert dispatch.REFERENCE in known
    for cls in layout_classes():
        assert isinstance(vars(cls).get("runtime_kernels"), tuple), cls
        assert set(cls.runtime_kernels) <= known, (cls.name, cls.schemes, cls.runtime_kernels)
    assert dispatch.reads("vllm-marlin") == [("marlin", "wna16"), ("marlin", "mxfp4")]
    assert sorted(dispatch.reads("triton")) == [("triton", "wna16"), ("triton-fast", "mxfp4"), ("triton-fast", "wna16")]
    assert dispatch.reads(dispatch.REFERENCE) == [("plain", "float"), ("plain", "wna16"), ("plain", "mxfp4")]


def test_our_triton_kernels_read_every_layout_that_names_them():
    from moeconvert.runtime import moeconvert_triton

    for cls in layout_classes():
        if moeconvert_triton.NAME in cls.runtime_kernels:
            assert moeconvert_triton.forward_for(cls()) is not None, (cls.name, cls.schemes)


def _layer(layout, scheme):
    entry = types.SimpleNamespace(layout=layout, scheme=scheme, expert_offset=0)
    return types.SimpleNamespace(entry=entry, prefix="model.layers.0.mlp.experts")


def test_the_triton_mxfp4_layout_is_not_claimed_by_our_kernels(registries, monkeypatch):
    # The link is declared once, by the layout; the kernel side has no (layout, kind) list to disagree.
    import moeconvert.kernels

    assert "reads" not in {f.name for f in dataclasses.fields(Kernel)}
    assert not hasattr(moeconvert.kernels, "SUPPORTED") and not hasattr(moeconvert.kernels, "supports")
    # vLLM's triton MXFP4 layout is triton_kernels' Hopper swizzle: neither of our Triton kernels reads it,
    # so even where they could run (the interpreter) the layer runs the reference, and says why
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(dispatch.ENV_KERNEL, raising=False)
    layer = _layer(get_layout("triton", "mxfp4"), MXFP4Scheme())
    assert ("triton", "mxfp4") not in dispatch.reads("triton")
    with pytest.warns(KernelFallbackWarning, match="the runtime does not call triton_kernels.matmul_ogs"):
        choice = dispatch.select(layer, torch.device("cpu"))
    assert choice.kernel == dispatch.REFERENCE and "triton_kernels.matmul_ogs" in choice.note
    with pytest.raises(MoeConvertError, match="kernel triton does not read the 'triton' layout of mxfp4 experts"):
        dispatch.select(layer, torch.device("cpu"), "triton")


def test_a_layout_naming_a_kernel_nobody_registered_falls_back_and_says_so(registries, monkeypatch):
    monkeypatch.delenv(dispatch.ENV_KERNEL, raising=False)
    plugin = _plugin_module()
    register(plugin.ToyLayout)  # its kernel's distribution is not installed
    layer = _layer(get_layout("toy-plain", "wna16"), types.SimpleNamespace(kind="wna16"))
    with pytest.warns(KernelFallbackWarning, match="toy-dense: no runtime kernel of that name is registered"):
        choice = dispatch.select(layer, torch.device("cpu"))
    assert choice.kernel == dispatch.REFERENCE
