"""The manifest as the runtime reads it: checked once, then trusted (docs/runtime.md, "Refusals").

:func:`read_checked` is :func:`moeconvert.layouts.output.check_output` (every field validated, the manifest
checked against itself, against each layer's layout plan and against the shard headers, the output's
config.json parsed) plus what only a loader refuses: a layout made for other kernel library versions
(``layout.made_for``), and a partition other than the one asked for. With ``verify=True`` the shard
headers' and config.json's sha256 are checked too; tensor checksums are the readers' business
(loader.py), since they need every byte read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moeconvert.canonical import LayerShape
from moeconvert.errors import MoeConvertError
from moeconvert.format import MANIFEST_NAME, TensorInfo
from moeconvert.layouts.output import check_output
from moeconvert.layouts import Layout
from moeconvert.schemes import Scheme


@dataclass
class LayerEntry:
    """One MoE layer of the manifest, with the layout and sizes its tensors are decoded with."""

    prefix: str
    index: int  # the decoder layer number
    raw: dict  # the manifest entry itself
    scheme: Scheme
    layout: Layout
    shape: LayerShape  # what the layout planned with (padded H, I for MXFP4)
    tensors: dict[str, TensorInfo]  # suffix -> where its bytes are
    router: list[str]
    shared: list[str]

    @property
    def num_experts(self) -> int:
        return self.raw["num_experts"]

    @property
    def num_experts_global(self) -> int:
        return self.raw["num_experts_global"]

    @property
    def expert_offset(self) -> int:
        return self.raw["expert_offset"]

    @property
    def hidden_size(self) -> int:
        return self.raw["hidden_size"]

    @property
    def hidden_size_padded(self) -> int:
        return self.raw["hidden_size_padded"]

    @property
    def intermediate_size(self) -> int:
        return self.raw["intermediate_size"]

    @property
    def intermediate_size_padded(self) -> int:
        return self.raw["intermediate_size_padded"]

    @property
    def activation(self) -> str:
        return self.raw["activation"]

    @property
    def activation_params(self) -> dict:
        return self.raw["activation_params"]

    @property
    def metadata(self) -> dict:
        return self.raw["layout_metadata"]

    @property
    def top_k(self) -> int | None:
        return self.raw["top_k"]

    @property
    def zero_experts(self) -> int:
        """Zero-computation experts the router may pick (global ids ``num_experts_global`` and up; LongCat-Flash)."""
        return (self.raw.get("zero_experts") or {}).get("num", 0)

    @property
    def router_weight_on_input(self) -> bool:
        """The router weight scales the expert's input, not its output (Llama 4)."""
        return self.raw.get("apply_router_weight_on_input", False)


@dataclass
class CheckedManifest:
    root: Path
    raw: dict
    layers: list[LayerEntry]
    #: every tensor of the output (MoE and pass-through), name -> where its bytes are
    tensors: dict[str, TensorInfo]
    sha256: dict[str, str] = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the output's config.json

    @property
    def dtype(self) -> str:
        return self.raw["dtype"]

    @property
    def family(self) -> str:
        return self.raw["family"]

    @property
    def partition(self) -> dict:
        return self.raw["partition"]

    @property
    def layout_name(self) -> str:
        return self.raw["layout"]["name"]

    @property
    def made_for(self) -> dict:
        return dict(self.raw["layout"]["made_for"])


def check_partition(manifest: dict, tp_size: int | None, tp_rank: int | None, ep_size: int | None,
                    ep_rank: int | None) -> None:
    part = manifest["partition"]
    for key, want in (("tp_size", tp_size), ("tp_rank", tp_rank), ("ep_size", ep_size), ("ep_rank", ep_rank)):
        if want is not None and part[key] != want:
            raise MoeConvertError(
                f"output was cut for {key} {part[key]}, not {want} (convert with --{key.replace('_', '-')} "
                f"{want})", file=MANIFEST_NAME, tensor=f"partition.{key}", expected=want, found=part[key])


def read_checked(root: Path, *, tp_size: int | None = None, tp_rank: int | None = None,
                 ep_size: int | None = None, ep_rank: int | None = None, verify: bool = False) -> CheckedManifest:
    """Read ``root/moeconvert.json`` and refuse anything the runtime cannot run exactly. ``verify``:
    also the sha256 of every shard header and of config.json (cheap: a few KB per file)."""
    out = check_output(root, hash_headers=verify, made_for=True)
    check_partition(out.manifest, tp_size, tp_rank, ep_size, ep_rank)
    layers = []
    for cl in out.layers:
        raw = cl.raw
        layers.append(LayerEntry(prefix=raw["prefix"], index=raw["layer"], raw=raw, scheme=cl.scheme,
                                 layout=cl.layout, shape=cl.shape,
                                 tensors={suffix: out.infos[e["name"]] for suffix, e in raw["tensors"].items()},
                                 router=list(raw["router"]), shared=list(raw["shared_experts"])))
    return CheckedManifest(root=root, raw=out.manifest, layers=layers, tensors=out.infos, sha256=out.sha256,
                           config=out.config)
