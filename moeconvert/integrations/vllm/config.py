"""``quant_method: "moeconvert"``: the quantization config vLLM builds from a converted folder's config.json.

MoE layers the folder's manifest holds get our method (their tensors load as they are); every other
layer goes to the quantization config vLLM itself builds for the source checkpoint (compressed-tensors,
GPTQ, AWQ, FP8: :func:`_source_config`), or is unquantized, exactly as vLLM would load the source.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from moeconvert.errors import MoeConvertError
from moeconvert.format.manifest import made_for_versions
from moeconvert.integrations.vllm import SUPPORTED_VLLM
from moeconvert.integrations.vllm.methods.spec import alternatives, convert_again, eplb_refusal, layout_fits
from moeconvert.integrations.vllm.scope import load_format, load_format_refusal, method_name, refusal, vllm_prefix

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# our stacked names under a layer's experts container -> the parameter of vLLM's RoutedExperts child
#: (humming names its zero points ``w13_zero_point``: vLLM's ``_replace_layer_parameters``)
_STACKED = re.compile(r"\.experts\.((?:w13|w2)_(?:weight|weight_scale|weight_zero_point|zero_point|bias))$")
#: a stored TP size's rank tensors (``--tp-sizes``): read only by ``--load-format moeconvert``, which takes
#: every stacked tensor itself; any other loader never hands them to the model
_STORED_TP = re.compile(r"\.experts\.tp\d+\.((?:w13|w2)_(?:weight|weight_scale|weight_zero_point|zero_point|bias))$")


def _versions(versions) -> str:
    return ", ".join(versions)


def _show(value: object) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _layout_named(raw: dict) -> str | None:
    """The layout config.json names, where it names one (a refusal's fix converts to it again)."""
    layout = raw.get("layout")
    return layout["name"] if isinstance(layout, dict) and isinstance(layout.get("name"), str) else None


def _refuse(key: str, expected: str, found: object, layout: str | None, file: str = "config.json") -> ValueError:
    """One line, as vLLM shows a config it cannot take: the file, the key, expected vs found, and the fix
    (the folder's files are made by the conversion, never by hand: convert again, to ``layout``)."""
    return ValueError(f"moeconvert: {file}: quantization_config.{key}: expected {expected}, found {_show(found)}; "
                      f"{convert_again(layout)}")


def _check_groups(groups: dict, layout: str | None) -> None:
    """The source's compressed-tensors groups as vLLM's ``CompressedTensorsConfig.from_config`` reads them
    (``_quantization_scheme_map_from_config``: each group's ``targets`` iterated, its ``weights`` and any
    ``input_activations`` through compressed-tensors' ``QuantizationArgs``), checked first so that a refusal
    is one line naming the key, not pydantic's many lines naming neither file nor group."""
    from compressed_tensors.quantization import QuantizationArgs
    from pydantic import ValidationError

    base = "source_quantization_config.config_groups"
    for name, group in groups.items():
        targets = group.get("targets")
        if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
            raise _refuse(f"{base}.{name}.targets", "a list of module names or patterns", targets, layout)
        for part in ("weights", "input_activations"):
            if part == "input_activations" and group.get(part) is None:
                continue
            try:
                QuantizationArgs.model_validate(group.get(part))
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(p) for p in first.get("loc", ()))
                why = " ".join(str(first.get("msg")).split())
                raise _refuse(f"{base}.{name}.{part}" + (f".{where}" if where else ""),
                              f"what compressed-tensors' QuantizationArgs takes ({why})", first.get("input"),
                              layout) from None


def _vllm_pick(source: dict) -> str:
    """The quantization method vLLM itself picks for a checkpoint with this quantization_config: its own
    ``ModelConfig._verify_quantization`` (every method's ``override_quantization_method``, in vLLM's order of
    preference: e.g. ``auto_gptq`` for GPTQ, which runs Marlin) run on the source's config alone, with the
    user's settings vLLM was started with (``--allow-deprecated-quantization``)."""
    from types import SimpleNamespace

    from vllm.config import ModelConfig, get_current_vllm_config_or_none

    vc = get_current_vllm_config_or_none()
    mc = vc.model_config if vc is not None else None
    probe = SimpleNamespace(quantization=None, model_arch_config=SimpleNamespace(quantization_config=source),
                            hf_config=getattr(mc, "hf_config", None),
                            allow_deprecated_quantization=bool(getattr(mc, "allow_deprecated_quantization", False)))
    ModelConfig._verify_quantization(probe)
    return probe.quantization


def _source_config(source: dict, layout: str | None) -> QuantizationConfig:
    """vLLM's own quantization config of the source checkpoint, for every layer that is not a routed expert
    (attention, shared experts, dense MLPs): the config vLLM would build serving the source itself
    (:func:`_vllm_pick`): compressed-tensors, GPTQ / AWQ (vLLM's ``auto_gptq`` / ``auto_awq``, Marlin), FP8."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    key = "source_quantization_config"
    if not isinstance(source.get("quant_method"), str):
        raise _refuse(f"{key}.quant_method", "the source's quantization method (a string)", source.get("quant_method"),
                      layout)
    if source["quant_method"] == "compressed-tensors":
        # vLLM takes a compressed-tensors config without config_groups as "nothing is quantized" and
        # would load the source's packed linear weights as plain ones (compressed_tensors.py from_config)
        groups = source.get("config_groups")
        if not (isinstance(groups, dict) and groups and all(isinstance(g, dict) for g in groups.values())):
            raise _refuse(f"{key}.config_groups", "the source's compressed-tensors groups (an object of objects)",
                          groups, layout)
        _check_groups(groups, layout)
    try:
        name = _vllm_pick(source)
        return get_quantization_config(name).from_config(source)
    except Exception as e:  # noqa: BLE001 - whatever vLLM refuses in it (one line, the key named)
        text = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"moeconvert: config.json: quantization_config.{key}: vLLM's "
                         f"{source['quant_method']} config refuses it ({text}); {convert_again(layout)}") from None


class MoeconvertConfig(QuantizationConfig):
    def __init__(self, raw: dict):
        super().__init__()
        import vllm

        if vllm.__version__ not in SUPPORTED_VLLM:
            raise ValueError(f"moeconvert: this vLLM is {vllm.__version__}; the moeconvert plugin serves its folders on "
                             f"vLLM {_versions(SUPPORTED_VLLM)} only (the MoE layer's internals change between releases): "
                             f"pip install vllm=={SUPPORTED_VLLM[-1]}")
        from moeconvert.format import FORMAT_VERSION

        self.raw = raw
        named = _layout_named(raw)
        # the keys moeconvert writes (convert.served_config), each of its JSON type before it is read
        if raw.get("format_version") != FORMAT_VERSION or isinstance(raw.get("format_version"), bool):
            raise _refuse("format_version", f"{FORMAT_VERSION} (this moeconvert's output format)",
                          raw.get("format_version"), named)
        layout = raw.get("layout")
        if not (isinstance(layout, dict) and isinstance(layout.get("name"), str) and
                type(layout.get("version")) is int):
            raise _refuse("layout", 'an object {"name": ..., "version": ...}', layout, named)
        if not (isinstance(raw.get("made_for"), dict) and all(
                isinstance(v, str) or isinstance(v, list) and v and all(isinstance(x, str) for x in v)
                for v in raw["made_for"].values())):
            raise _refuse("made_for", 'an object of versions or lists of them, e.g. {"vllm": ["0.33.0", "0.34.0"]}',
                          raw.get("made_for"), named)
        made_for = made_for_versions(raw["made_for"].get("vllm"))
        if not set(made_for) & set(SUPPORTED_VLLM):
            raise ValueError(f"moeconvert: this folder's layout was made for vLLM {_versions(made_for) or 'none'}; the "
                             f"plugin serves {_versions(SUPPORTED_VLLM)}: {convert_again(named)}")
        if not isinstance(raw.get("partition"), dict):
            raise _refuse("partition", "an object (tp_size, tp_rank, ep_size, ep_rank)", raw.get("partition"), named)
        self.partition = raw["partition"]
        if raw.get("load_format") is not None and not isinstance(raw["load_format"], str):
            raise _refuse("load_format", 'the name of a vLLM load format, e.g. "moeconvert", or absent',
                          raw["load_format"], named)
        dtype = raw.get("dtype")
        if dtype not in _DTYPES:
            raise ValueError(f"moeconvert: quantization_config.dtype must be one of {sorted(_DTYPES)}, found {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.layers: dict[str, dict] = {}  # MoE layer prefix -> its manifest entry (maybe_update_config)
        self.renames = None  # the model class's checkpoint-to-module renames (apply_vllm_mapper)
        self.manifest: dict | None = None
        self.inner = None
        source = raw.get("source_quantization_config")
        if source is not None and not isinstance(source, dict):
            raise _refuse("source_quantization_config", "an object (the source's quantization_config) or null", source,
                          named)
        if source and source.get("quant_method") == "mxfp4":
            # an MXFP4 checkpoint (gpt-oss's own) quantizes its MoE experts only, which are the folder's now:
            # vLLM's Mxfp4Config gives every linear layer UnquantizedLinearMethod (quantization/mxfp4.py)
            source = None
        if source:
            self.inner = _source_config(source, named)
            self.inner.packed_modules_mapping = self.packed_modules_mapping  # one mapping, updated by the model

    # -- what vLLM asks of every quantization config ---------------------------------------------------

    def get_name(self) -> str:
        return "moeconvert"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [self.dtype]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75  # Marlin's MoE kernel (and compressed-tensors' linear layers need no more)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> "MoeconvertConfig":
        return cls(config)

    @staticmethod
    def get_checkpoint_weight_mapper():
        from vllm.model_executor.models.utils import WeightsMapper

        # vLLM's own mapper (it drops activation-order metadata), then ours: a stacked MoE tensor goes to
        # the RoutedExperts child that holds the parameter (idempotent: the new name no longer matches)
        return QuantizationConfig.get_checkpoint_weight_mapper() | WeightsMapper(
            orig_to_new_regex={_STACKED: r".experts.routed_experts.\1", _STORED_TP: None})

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """vLLM's loader hands over the model class's renames from checkpoint names to its module names
        (model_loader/utils.py configure_quant_config): the manifest names each MoE layer as the checkpoint does
        (DeepSeek-V4's ``layers.L.ffn.experts``, which its model builds as ``model.layers.L.ffn.experts``)."""
        self.renames = hf_to_vllm_mapper
        if self.manifest is not None:
            self._key_layers(self.manifest)
        if self.inner is not None:
            self.inner.apply_vllm_mapper(hf_to_vllm_mapper)

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Read the folder's manifest (checked as ``moeconvert verify`` checks it, without hashing data)."""
        from moeconvert.layouts.output import check_output

        root = Path(model_name).expanduser()
        if not root.is_dir():
            # a path (absolute, relative or with more than owner/name) is a folder that is not there: the
            # Hub would refuse the name as a repo id (HFValidationError), which says nothing of the folder
            if root.is_absolute() or model_name.startswith((".", "~")) or model_name.count("/") != 1:
                raise ValueError(f"moeconvert: {model_name}: no such folder (expected the folder moeconvert wrote, "
                                 "with its config.json and moeconvert.json); check the path given to vLLM")
            from huggingface_hub import snapshot_download

            try:
                root = Path(snapshot_download(model_name, revision=revision, local_files_only=True))
            except Exception as e:  # noqa: BLE001 - any of the Hub's errors: one line, as vLLM shows a config it refuses
                raise ValueError(f"moeconvert: {model_name}: not a folder here, and not in the Hugging Face cache "
                                 f"({type(e).__name__}); download it first (hf download {model_name})") from e
        try:
            checked = check_output(root)
        except MoeConvertError as e:
            raise ValueError(f"moeconvert: {e.line()}") from e
        self.use_manifest(checked.manifest)
        if self.inner is not None:
            # vLLM's GPTQ / AWQ configs read which modules are quantized from the folder's safetensors headers
            # (AutoGPTQConfig.maybe_update_config): the non-expert tensors are the source's, copied unchanged
            self.inner.maybe_update_config(str(root), hf_config=hf_config, revision=revision)

    def use_manifest(self, manifest: dict) -> None:
        layout = {"name": manifest["layout"]["name"], "version": manifest["layout"]["version"]}
        for key, mine, theirs in (("layout", self.raw["layout"], layout),
                                  ("made_for", self.raw["made_for"], manifest["layout"]["made_for"]),
                                  ("partition", self.partition, manifest["partition"])):
            if mine != theirs:
                raise _refuse(key, f"{_show(theirs)}, what moeconvert.json says", mine, layout["name"])
        # the layers' own schemes: one kind may hold several (a GPTQ checkpoint's per-layer bits, ``dynamic``)
        kinds = {m["scheme"]["kind"] for m in manifest["moe_layers"]}
        import vllm

        why = refusal(manifest["layout"]["name"], kinds.pop() if len(kinds) == 1 else None, manifest["family"],
                      [(m["activation"], m.get("activation_params") or {}) for m in manifest["moe_layers"]],
                      vllm_version=vllm.__version__)
        if why is not None:
            raise ValueError(f"moeconvert: {why}")
        self._check_served(manifest, manifest["moe_layers"][0]["scheme"]["kind"])
        if self.raw.get("load_format") != load_format(manifest["family"]):
            raise _refuse("load_format", f"{_show(load_format(manifest['family']))} (what a {manifest['family']} "
                          "folder is served with)", self.raw.get("load_format"), layout["name"])
        if manifest["dtype"] != self.raw["dtype"]:
            raise ValueError(f"moeconvert: config.json says dtype {self.raw['dtype']}, the manifest {manifest['dtype']}")
        self.manifest = manifest
        self._key_layers(manifest)

    def _key_layers(self, manifest: dict) -> None:
        """Key each manifest entry by the prefix vLLM builds the layer with: MiniMax-M2's block name differs
        from its module path; the model class's renames, where it has them, map the checkpoint's name."""
        renamed = self.renames.map_name if self.renames is not None else (lambda name: name)
        named = {m["prefix"]: vllm_prefix(manifest["family"], m["prefix"]) for m in manifest["moe_layers"]}
        self.layers = {renamed(named[m["prefix"]]) or named[m["prefix"]]: m for m in manifest["moe_layers"]}

    @staticmethod
    def _check_served(manifest: dict, kind: str) -> None:
        """This vLLM must be one the folder's layout lists: the layout (same name and version, so the same
        bytes; ``check_output`` holds the folder's own list within it) was checked against the processing of
        exactly those versions (``Layout.made_for``), and any other may hold other bytes."""
        import vllm

        from moeconvert.layouts import get_layout

        layout = get_layout(manifest["layout"]["name"], kind)
        served = tuple(v for v in made_for_versions(layout.made_for.get("vllm")) if v in SUPPORTED_VLLM)
        if vllm.__version__ not in served:
            raise ValueError(f"moeconvert: this vLLM is {vllm.__version__}; this folder's layout ({layout.name} "
                             f"version {layout.version}, {kind}) is served on vLLM {_versions(served)} only, the "
                             f"versions whose processing its bytes were checked against: pip install "
                             f"vllm=={served[-1] if served else SUPPORTED_VLLM[-1]}")

    # -- per layer -------------------------------------------------------------------------------------

    def _check_parallel(self, prefix: str, layer, entry: dict, method_cls) -> "RankShare":
        """What this rank of vLLM's layer takes from the folder, or a refusal before any byte is read (each
        worker builds its own layers, so each checks its own rank).

        A folder converted for one rank (``--tp-rank`` / ``--ep-rank``) serves that rank only. A full folder
        (TP 1, EP 1: every expert stacked) serves any EP shape vLLM builds (``--enable-expert-parallel``,
        also with ``--data-parallel-size``, which vLLM folds into EP: fused_moe/config.py,
        ``FusedMoEParallelConfig.make``), whatever the expert placement, since the loader takes the experts
        vLLM's own expert map gives the layer; and the TP sizes whose cuts the layout declares exact
        (``Layout.tp_cuts``; DP without EP is TP across DP there)."""
        from moeconvert.layouts.output import layer_shape_from_manifest, parse_scheme
        from moeconvert.integrations.vllm.methods.base import RankShare
        from moeconvert.layouts import get_layout

        from vllm.config import get_current_vllm_config_or_none

        vc = get_current_vllm_config_or_none()
        loading_with = vc.load_config.load_format if vc is not None else None
        why = load_format_refusal(self.manifest["family"], prefix, loading_with)
        if why is not None:
            raise ValueError(f"moeconvert: {why}")
        pc = layer.moe_config.moe_parallel_config
        have = {"tp_size": pc.tp_size, "tp_rank": pc.tp_rank, "ep_size": pc.ep_size if pc.use_ep else 1,
                "ep_rank": pc.ep_rank if pc.use_ep else 0}
        shape = (f"TP {have['tp_size']} rank {have['tp_rank']}, EP {have['ep_size']} rank {have['ep_rank']}"
                 + (f", DP {pc.dp_size}" if pc.dp_size != 1 else "") + (", with EPLB" if pc.enable_eplb else ""))
        want = {k: self.partition.get(k) for k in ("tp_size", "tp_rank", "ep_size", "ep_rank")}
        if want != {"tp_size": 1, "tp_rank": 0, "ep_size": 1, "ep_rank": 0}:  # a one-rank folder: today's rule
            if have != want or pc.dp_size != 1 or pc.pcp_size != 1 or pc.enable_eplb:
                raise ValueError(
                    f"moeconvert: {prefix}: this folder was converted for TP {want['tp_size']} rank {want['tp_rank']}, "
                    f"EP {want['ep_size']} rank {want['ep_rank']}; this vLLM builds the layer for {shape}: convert "
                    f"the checkpoint without --tp-rank/--ep-rank ({self._command()}) and one folder serves every EP "
                    "shape, or for this rank (--tp-size / --ep-size)")
            return RankShare()
        if pc.enable_eplb and not method_cls.spec.supports_eplb()[0]:
            alts = alternatives(entry["scheme"]["kind"], entry["activation"], entry.get("activation_params"),
                                layout_fits(entry, self.manifest["dtype"]), exclude=method_cls.spec, eplb=True)
            raise ValueError("moeconvert: " + eplb_refusal(method_cls.spec, prefix, shape, alts,
                                                           lambda spec: self._command(spec.layout)))
        if layer.moe_config.num_logical_experts != entry["num_experts_global"]:
            raise ValueError(
                f"moeconvert: {prefix}: this vLLM builds the layer over {layer.moe_config.num_logical_experts} "
                f"experts; the folder holds {entry['num_experts_global']}")
        layout_name, kind = self.manifest["layout"]["name"], entry["scheme"]["kind"]
        layout = get_layout(layout_name, kind)
        if have["ep_size"] > 1:
            # a choice vLLM makes over a rank's own experts (humming's sign-magnitude) must be the folder's
            from moeconvert.integrations.vllm.methods.base import local_experts

            stored = entry.get("tp_sizes", {}).get(str(have["tp_size"])) or {}
            metadata = (stored["rank_layout_metadata"][have["tp_rank"]] if "rank_layout_metadata" in stored
                        else entry["layout_metadata"])
            why = layout.experts_problem(metadata, local_experts(layer))
            if why is not None:
                raise ValueError(f"moeconvert: {prefix}: this vLLM builds the layer for {shape}; {why}")
        if have["tp_size"] == 1:
            return RankShare(experts_from_layer=True)
        cuts = layout.tp_cuts(layer_shape_from_manifest(entry, self.manifest["dtype"]),
                              parse_scheme(entry["scheme"], "scheme"), have["tp_size"])
        if not isinstance(cuts, dict):
            T = have["tp_size"]
            stored = entry.get("tp_sizes", {}).get(str(T))
            if stored and stored["stored"]:
                if loading_with != "moeconvert":
                    raise ValueError(
                        f"moeconvert: {prefix}: this vLLM builds the layer for {shape}; the folder stores its TP {T} "
                        f"rank tensors beside the full ones, which only moeconvert's model loader reads: serve with "
                        f"--load-format moeconvert (this vLLM loads with {loading_with!r})")
                return RankShare(experts_from_layer=True, tp_size=T, tp_rank=have["tp_rank"], stored=stored)
            fix = (f"or convert once more adding this TP size: {self._command(tp_sizes=T)}"
                   if cuts.convertible else f"a TP rank of {T} cannot hold it in this layout at all")
            raise ValueError(
                f"moeconvert: {prefix}: this vLLM builds the layer for {shape}; this folder holds the full (TP 1) "
                f"tensors, a {layout_name} TP rank of {T} is not a slice of them ({cuts}) and the folder stores "
                f"no TP {T} tensors: serve with --enable-expert-parallel (any EP size), {fix}")
        return RankShare(experts_from_layer=True, tp_size=have["tp_size"], tp_rank=have["tp_rank"], cuts=cuts)

    def _command(self, backend: str | None = None, tp: tuple[int, int] | None = None, tp_sizes: int | None = None) -> str:
        """The conversion that made this folder, for a refusal to name (with another backend, TP rank, or one
        more of ``--tp-sizes``)."""
        m = self.manifest or {}
        verb = (f"quantize {m['source']['id']} OUT --format {m['quantization']['format']}" if m.get("quantization")
                else f"repack {(m.get('source') or {}).get('id', 'SRC')} OUT")
        cmd = f"moeconvert {verb} --backend {backend or m.get('backend', 'marlin')}"
        if tp_sizes:
            have = {int(k) for m2 in m.get("moe_layers", []) for k in m2.get("tp_sizes", {})}
            cmd += " --tp-sizes " + ",".join(str(n) for n in sorted({1, tp_sizes} | have))
        return cmd + (f" --tp-size {tp[0]} --tp-rank {tp[1]}" if tp else "")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        if isinstance(layer, RoutedExperts):
            from moeconvert.integrations.vllm.methods import method_class

            owner = prefix.removesuffix(".routed_experts")
            if self.manifest is None:
                raise ValueError("moeconvert: the folder's manifest was not read (maybe_update_config)")
            entry = self.layers.get(owner)
            if entry is None:
                raise ValueError(f"moeconvert: {owner} is an MoE layer the folder's manifest does not hold")
            method = method_class(method_name(self.manifest["layout"]["name"], entry["scheme"]["kind"]))
            share = self._check_parallel(owner, layer, entry, method)
            return method(layer.moe_config, entry, self.manifest, share)
        if self.inner is not None:
            return self.inner.get_quant_method(layer, prefix)
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None
