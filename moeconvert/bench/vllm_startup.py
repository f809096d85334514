"""``moeconvert bench vllm-startup SRC OUT``: vLLM's own load-time processing of the source's MoE layers
beside the plugin's loading of the converted folder, layer by layer, in one process on one device.

For each MoE layer the manifest holds, vLLM 0.33.0 builds its MoE module twice with its own
``FusedMoEFactory``:

* **vLLM's own**: the quantization config vLLM makes from the source's config.json (compressed-tensors
  WNA16), or for a bf16 source converted to MXFP4 vLLM's online MXFP4 (``--quantization mxfp4``); the
  source's per-expert tensors go through vLLM's ``load_weights``, then ``process_weights_after_loading``
  repacks (or quantizes) them into the kernel's layout.
* **moeconvert's**: the plugin's config from the converted folder's config.json; the folder's tensors load
  as they are, and processing only builds the kernel.

Both use the same MoE backend (``--moe-backend``, by default the folder's layout: marlin or triton). Each step is timed with the device
synchronised, and on a GPU the memory the layer holds and the most held beyond it during processing (the
second copy) are read from PyTorch's allocator. The two layers' parameters are then compared byte for byte
(not for a layout vLLM never makes, triton-fast: ``bytes_compared`` says so) and both run the same routed
tokens. A warm-up round on the first layer takes the one-time costs of a process out of both columns and
reports them apart (``warmup``): kernel loading, the allocator's first blocks, and for humming its kernels'
tuning heuristics, which humming computes once per distinct sublayer config in a process (about 2.4 s each,
pure Python, kept in memory only), so that every engine start pays them, on the source and the folder alike.
In the warm-up vLLM's layer is built first and takes them all.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

# our parameter -> the name vLLM's compressed-tensors WNA16 method gives the same tensor after processing
_THEIR_NAME = {"w13_weight": "w13_weight_packed", "w2_weight": "w2_weight_packed"}


def _times(r) -> dict:
    """A timed layer's (``harness.Timed``) seconds: building, loading, processing."""
    return {"build_s": r.build_s, "load_s": r.load_s, "process_s": r.process_s}


def _figures(r) -> dict:
    """A timed layer's row: its seconds, the memory it holds and the most held beyond it, its experts class."""
    return {**_times(r), "resident_bytes": r.resident_bytes, "peak_extra_bytes": r.peak_extra_bytes,
            "experts_class": type(r.experts.quant_method.moe_kernel.fused_experts).__name__}


def _online_mxfp4_model(src: Path, scheme_kind: str, dtype: str):
    """For an unquantized source: vLLM's ``ModelConfig`` of ``vllm serve SRC --quantization mxfp4``, whose
    online MXFP4 method reads it while it is built; None for a quantized source."""
    if json.loads((src / "config.json").read_text()).get("quantization_config"):
        return None
    if scheme_kind != "mxfp4":
        raise ValueError(f"{src}: an unquantized source and a {scheme_kind} folder: vLLM has no load-time path "
                         "that ends in this folder's layout to compare with")
    from vllm.config import ModelConfig

    return ModelConfig(model=str(src), quantization="mxfp4", dtype=dtype, max_model_len=256, enforce_eager=True)


def _vllm_source_config(src: Path, vllm_config):
    """The quantization config vLLM uses for the source: its own from config.json, or for
    ``--quantization mxfp4`` the one vLLM made with the model config."""
    from moeconvert.integrations.vllm.harness import quant_config_for

    cfg = quant_config_for(src)
    if cfg is None:
        cfg = vllm_config.quant_config
    name = cfg.get_name()
    return cfg, f"{name} mxfp4" if name == "online" else name


def _same_bytes(ours, theirs) -> dict:
    """Each of our parameters against vLLM's processed parameter of the same role."""
    mine = dict(ours.named_parameters())
    other = dict(theirs.named_parameters())
    out = {}
    for name, p in mine.items():
        # vLLM's own name where its processing kept ours (humming's, MXFP4's), else its compressed-tensors one
        q = other[name] if name in other else other.get(_THEIR_NAME.get(name, name))
        if q is None:
            out[name] = "vLLM holds no such tensor"
        elif p.shape != q.shape or p.dtype != q.dtype:
            out[name] = f"vLLM holds {tuple(q.shape)} {q.dtype}, ours {tuple(p.shape)} {p.dtype}"
        else:
            out[name] = bool(torch.equal(p.data.view(torch.uint8), q.data.view(torch.uint8)))
    return out


def bytes_compared(layout) -> bool | str:
    """True where vLLM's own processing makes this layout's bytes (the oracle tests check them per version,
    ``made_for``), so that the two layers' parameters are compared; else why not (moeconvert's own layout,
    whose vLLM versions only say where it is served)."""
    if "vllm" in layout.made_for and "vllm" not in layout.made_for_optional:
        return True
    return f"no: vLLM's processing never makes the {layout.name} layout ({layout.kernel})"


def _route(M: int, E: int, top_k: int, H: int, Hp: int, dtype: torch.dtype, device: str, seed: int):
    """Tokens (zero-padded to the experts' Hp, as vLLM's MoE runner pads them for MXFP4 Marlin) routed
    top-k by softmax, renormalised."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.nn.functional.pad(torch.randn(M, H, generator=g) * 0.5, (0, Hp - H)).to(device, dtype)
    logits = torch.randn(M, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return x, (w / w.sum(-1, keepdim=True)).to(device), ids.to(device, torch.int32)


def bench_vllm_startup(src: Path | str, out_dir: Path, *, device: str, layers: int | None = None, tokens: int = 64,
                       moe_backend: str | None = None, progress=None) -> dict:
    import vllm

    from moeconvert.layouts import get_layout
    from moeconvert.layouts.output import check_output
    from moeconvert.integrations.vllm import SUPPORTED_VLLM, register
    from moeconvert.integrations.vllm.harness import build_load_process, layer_tensors, one_process, quant_config_for, run_experts
    from moeconvert.modelmap import map_model
    from moeconvert.sources import open_source

    if vllm.__version__ not in SUPPORTED_VLLM:
        raise ValueError(f"this vLLM is {vllm.__version__}; the plugin serves {', '.join(SUPPORTED_VLLM)}")
    register()
    manifest = check_output(out_dir).manifest
    kind = (manifest["scheme"] or {}).get("kind")
    moe_backend = moe_backend or manifest["layout"]["name"]  # marlin | triton: the backend the layout is for
    source = open_source(str(src))  # a folder, or a Hub repo id (its snapshot in the Hub cache)
    src = source.root
    source_layers = {m.prefix: m for m in map_model(source).layers}
    entries = manifest["moe_layers"][: layers or None]
    missing = [m["prefix"] for m in entries if m["prefix"] not in source_layers]
    if missing:
        raise ValueError(f"{src}: holds no MoE layer {missing[0]} (is it the folder's source?)")
    dtype = getattr(torch, manifest["dtype"])
    compared = bytes_compared(get_layout(manifest["layout"]["name"]))
    rows = []
    with one_process(device, moe_backend, _online_mxfp4_model(src, kind, manifest["dtype"])) as vc:
        theirs_cfg, theirs_name = _vllm_source_config(src, vc)
        ours_cfg = quant_config_for(out_dir)

        def both(m: dict) -> tuple:
            kw = dict(prefix=m["prefix"], num_experts=m["num_experts_global"], top_k=m["top_k"],
                      hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size_total"],
                      has_bias=m["has_bias"], dtype=dtype, device=device)
            names = source_layers[m["prefix"]].source_tensors()
            theirs = build_load_process(theirs_cfg, layer_tensors(src, m["prefix"], theirs_cfg, names), **kw)
            ours = build_load_process(ours_cfg, layer_tensors(out_dir, m["prefix"], ours_cfg), **kw)
            return theirs, ours

        # the warm-up round: its figures are reported apart (``warmup``), not with the layers'. vLLM's layer is
        # built first, so the one-time costs land on its side here, though an engine start pays them on the
        # source and the folder alike (bench vllm-serve has them on both)
        theirs, ours = both(entries[0])
        warmup = {"layer": entries[0]["prefix"],
                  "vllm": _times(theirs), "moeconvert": _times(ours)}
        del theirs, ours
        for i, m in enumerate(entries):
            theirs, ours = both(m)
            H = m["hidden_size"]
            x, tw, ids = _route(tokens, m["num_experts_global"], m["top_k"], H, m["hidden_size_padded"], dtype,
                                device, i)
            y_theirs = run_experts(theirs.experts, x, tw, ids)[:, :H]
            y_ours = run_experts(ours.experts, x, tw, ids)[:, :H]
            diff = (y_ours.float() - y_theirs.float()).norm() / y_theirs.float().norm().clamp_min(1e-30)
            rows.append({
                "layer": m["prefix"],
                "vllm": _figures(theirs),
                "moeconvert": _figures(ours),
                "same_bytes": _same_bytes(ours.experts, theirs.experts) if compared is True else None,
                "outputs_identical": bool(torch.equal(y_ours, y_theirs)),
                "output_rel_diff": float(diff),
            })
            del theirs, ours, y_theirs, y_ours
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
            if progress:
                progress(1)

    def total(side: str, key: str) -> float:
        return sum(r[side][key] for r in rows)

    summary = {}
    for side in ("vllm", "moeconvert"):
        summary[side] = {k: total(side, k) for k in ("build_s", "load_s", "process_s")}
        summary[side]["load_and_process_s"] = summary[side]["load_s"] + summary[side]["process_s"]
        summary[side]["median_layer_load_and_process_s"] = statistics.median(
            r[side]["load_s"] + r[side]["process_s"] for r in rows)
        summary[side]["max_peak_extra_bytes"] = max(r[side]["peak_extra_bytes"] for r in rows)
    ours_t = summary["moeconvert"]["load_and_process_s"]
    return {"source": str(src), "folder": str(out_dir), "device": str(device), "vllm_version": vllm.__version__,
            "moe_backend": moe_backend, "vllm_source_method": theirs_name, "layout": manifest["layout"]["name"],
            "scheme": kind, "tokens": tokens, "layers": rows, "summary": summary, "warmup": warmup,
            "bytes_compared": compared,
            "speedup_load_and_process": summary["vllm"]["load_and_process_s"] / ours_t if ours_t > 0 else None}
