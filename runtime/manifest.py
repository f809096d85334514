"""The manifest as the runtime reads it: validated once, then trusted (docs/runtime.md, "Refusals").

:func:`read_checked` refuses, with one line naming the file and what was expected vs found:

* a folder without ``moeconvert.json`` (an unfinished conversion) or with another format version;
* a layout this moeconvert does not know, of another layout version, or made for other kernel library
  versions than this moeconvert's layout is (``layout.made_for``);
* a partition other than the one asked for (``tp_size``/``tp_rank``/``ep_size``/``ep_rank``);
* shards that are missing, of another size than the manifest says (truncated), or whose headers
  disagree with the manifest (names, shapes, dtypes).

Checksums are the loader's business (``verify=True``): they need every byte read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moeconvert.canonical import LayerShape
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import Layout, get_layout
from moeconvert.schemes import Scheme, scheme_from_json
from moeconvert.sources import MANIFEST_NAME, TensorInfo, read_header
from moeconvert.verify import layer_shape_from_manifest, read_manifest


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
        return self.raw.get("num_experts_global", self.raw["num_experts"])

    @property
    def expert_offset(self) -> int:
        return self.raw.get("expert_offset", 0)

    @property
    def hidden_size(self) -> int:
        return self.raw["hidden_size"]

    @property
    def hidden_size_padded(self) -> int:
        return self.raw.get("hidden_size_padded", self.raw["hidden_size"])

    @property
    def intermediate_size(self) -> int:
        return self.raw["intermediate_size"]

    @property
    def intermediate_size_padded(self) -> int:
        return self.raw.get("intermediate_size_padded", self.raw["intermediate_size"])

    @property
    def activation(self) -> str:
        return self.raw["activation"]

    @property
    def activation_params(self) -> dict:
        return self.raw.get("activation_params") or {}

    @property
    def metadata(self) -> dict:
        return self.raw.get("layout_metadata") or {}

    @property
    def top_k(self) -> int | None:
        return self.raw.get("top_k")


@dataclass
class CheckedManifest:
    root: Path
    raw: dict
    layers: list[LayerEntry]
    #: every tensor of the output (MoE and pass-through), name -> where its bytes are
    tensors: dict[str, TensorInfo]
    sha256: dict[str, str] = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        return self.raw["dtype"]

    @property
    def family(self) -> str:
        return self.raw.get("family", "")

    @property
    def partition(self) -> dict:
        return self.raw["partition"]

    @property
    def layout_name(self) -> str:
        return self.raw["layout"]["name"]

    @property
    def made_for(self) -> dict:
        return dict(self.raw["layout"].get("made_for") or {})


def _where() -> str:
    return MANIFEST_NAME


def check_layout(manifest: dict, kind: str) -> Layout:
    """The registered layout of this name and scheme kind, if the file's version and target agree."""
    info = manifest.get("layout") or {}
    layout = get_layout(info.get("name"), kind)
    if kind not in layout.schemes:
        raise MoeConvertError("this moeconvert has no layout of that name for these experts", file=_where(),
                              tensor=f"layout {layout.name}", expected=", ".join(layout.schemes), found=kind)
    if info.get("version") != layout.version:
        newer = isinstance(info.get("version"), int) and info["version"] > layout.version
        raise MoeConvertError(
            "layout version " + ("is newer than this moeconvert knows (upgrade moeconvert)" if newer
                                 else "differs from this moeconvert's (convert the checkpoint again)"),
            file=_where(), tensor=f"layout {layout.name}", expected=layout.version, found=info.get("version"))
    made_for = dict(info.get("made_for") or {})
    if made_for != dict(layout.made_for):
        raise MoeConvertError(
            "layout was made for other kernel library versions than this moeconvert's layout targets "
            "(its bytes may not be what those kernels read; convert again)", file=_where(),
            tensor=f"layout {layout.name} made_for", expected=dict(layout.made_for), found=made_for)
    return layout


def check_partition(manifest: dict, tp_size: int | None, tp_rank: int | None, ep_size: int | None,
                    ep_rank: int | None) -> None:
    part = manifest.get("partition") or {}
    for key, want in (("tp_size", tp_size), ("tp_rank", tp_rank), ("ep_size", ep_size), ("ep_rank", ep_rank)):
        if want is not None and part.get(key) != want:
            raise MoeConvertError(
                f"output was cut for {key} {part.get(key)}, not {want} (convert with --{key.replace('_', '-')} "
                f"{want})", file=_where(), tensor=f"partition.{key}", expected=want, found=part.get(key))


def _check_shards(root: Path, manifest: dict) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for shard in manifest.get("shards") or []:
        path = root / shard["file"]
        if Path(shard["file"]).name != shard["file"]:
            raise MoeConvertError("shard names a path outside the output folder", file=_where(),
                                  found=shard["file"])
        if not path.is_file():
            raise MoeConvertError("shard listed in the manifest is missing", file=str(path))
        size = path.stat().st_size
        if size != shard["size"]:
            what = "truncated shard" if size < shard["size"] else "shard is larger than the manifest says"
            raise MoeConvertError(what, file=str(path), expected=f"{shard['size']} bytes", found=f"{size} bytes")
        infos.update(read_header(path))
    return infos


def _entry_info(infos: dict[str, TensorInfo], entry: dict) -> TensorInfo:
    info = infos.get(entry["name"])
    if info is None:
        raise MoeConvertError("tensor in the manifest is in no shard", file=entry["file"], tensor=entry["name"])
    if (info.file.name, list(info.shape), info.dtype) != (entry["file"], list(entry["shape"]), entry["dtype"]):
        raise MoeConvertError("shard header disagrees with the manifest", file=info.file.name, tensor=entry["name"],
                              expected=f"{entry['file']} {entry['shape']} {entry['dtype']}",
                              found=f"{info.file.name} {list(info.shape)} {info.dtype}")
    return info


def read_checked(root: Path, *, tp_size: int | None = None, tp_rank: int | None = None,
                 ep_size: int | None = None, ep_rank: int | None = None) -> CheckedManifest:
    """Read ``root/moeconvert.json`` and refuse anything the runtime cannot run exactly."""
    manifest = read_manifest(root)
    check_partition(manifest, tp_size, tp_rank, ep_size, ep_rank)
    infos = _check_shards(root, manifest)
    listed: dict[str, TensorInfo] = {}
    sha: dict[str, str] = {}
    for name, e in (manifest.get("tensors") or {}).items():
        listed[name] = _entry_info(infos, e)
        sha[name] = e["sha256"]
    layers = []
    for raw in manifest.get("moe_layers") or []:
        scheme = scheme_from_json(raw["scheme"])
        layout = check_layout(manifest, scheme.kind)
        tensors = {}
        for suffix, e in raw["tensors"].items():
            tensors[suffix] = listed[e["name"]] = _entry_info(infos, e)
            sha[e["name"]] = e["sha256"]
        for name in list(raw.get("router") or []) + list(raw.get("shared_experts") or []):
            if name not in listed:
                raise MoeConvertError("router / shared expert tensor named by the layer is not in the manifest",
                                      file=_where(), tensor=name)
        layers.append(LayerEntry(prefix=raw["prefix"], index=raw.get("layer", len(layers)), raw=raw, scheme=scheme,
                                 layout=layout, shape=layer_shape_from_manifest(raw, manifest["dtype"]),
                                 tensors=tensors, router=list(raw.get("router") or []),
                                 shared=list(raw.get("shared_experts") or [])))
    unlisted = sorted(set(infos) - set(listed))
    if unlisted:
        raise MoeConvertError("tensor in a shard but not in the manifest", file=infos[unlisted[0]].file.name,
                              tensor=unlisted[0])
    return CheckedManifest(root=root, raw=manifest, layers=layers, tensors=listed, sha256=sha)
