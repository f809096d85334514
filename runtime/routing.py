"""Routing functions: router logits -> (topk_weights float32 [M, k], topk_ids int32 [M, k]).

Each follows transformers' own router of the family (the model's definition), step for step:

* ``softmax``: softmax over all experts in fp32, top-k, optionally renormalised over the k
  (Qwen2/Qwen3-MoE ``norm_topk_prob``; Mixtral always renormalises).
* ``grouped``: DeepSeek-V3 / GLM-4-MoE "noaux_tc": sigmoid scores; the choice uses
  ``scores + e_score_correction_bias``; groups are ranked by the sum of their two best biased scores,
  ``topk_group`` groups kept, top-k inside them; weights are the *unbiased* scores, renormalised
  (``norm_topk_prob``, + 1e-20) and times ``routed_scaling_factor``.
* ``softmax_group_limited``: DeepSeek-V2: softmax scores; ``topk_method`` greedy (plain top-k) or
  group_limited_greedy (groups ranked by their best score); times ``routed_scaling_factor``;
  renormalised when ``norm_topk_prob`` (vLLM's choice; transformers' V2 never renormalises, and
  DeepSeek-V2 configs say False).
* ``topk_softmax``: gpt-oss: top-k of the logits, softmax over those k.
* ``topk_sigmoid``: Llama 4: top-k of the logits, sigmoid of those (the weight then scales the expert's
  input: :class:`MoELayer`).

Which family routes how is declared in moeconvert/format/families.py (``routing``); ``grouped`` with one
group is MiniMax-M2's router (sigmoid, ``e_score_correction_bias`` for the choice, renormalised).

:func:`router_for` reads the parameters from the converted folder's ``config.json`` (copied from the
source) and the router tensors the manifest lists for the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.format.families import BY_NAME, FAMILIES, read_keys

METHODS = ("softmax", "grouped", "softmax_group_limited", "topk_softmax", "topk_sigmoid")


@dataclass
class RouterConfig:
    method: str
    top_k: int
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # DeepSeek-V2
    #: compute the logits in float32 (DeepSeek / GLM routers do), else in the activation dtype
    fp32_logits: bool = False

    def to_json(self) -> dict:
        return dict(self.__dict__)


def route(router_logits: torch.Tensor, cfg: RouterConfig, *, top_k: int | None = None,
          renormalize: bool | None = None, e_score_correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    k = top_k or cfg.top_k
    renorm = cfg.renormalize if renormalize is None else renormalize
    logits = router_logits
    if cfg.method == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, k, dim=-1)
        if renorm:
            w = w / w.sum(dim=-1, keepdim=True)
    elif cfg.method == "topk_softmax":
        w, ids = torch.topk(logits, k, dim=-1)
        w = torch.softmax(w, dim=1, dtype=w.dtype)
    elif cfg.method == "topk_sigmoid":
        # Llama 4 (transformers' Llama4Router, vLLM's Llama4MoE.custom_routing_function): top-k of the
        # logits, sigmoid of those (the weight then scales the expert's input: MoELayer)
        w, ids = torch.topk(logits, k, dim=-1)
        w = torch.sigmoid(w.float())
    elif cfg.method == "grouped":
        w, ids = _grouped_topk(logits.float(), cfg, k, renorm, e_score_correction_bias)
    elif cfg.method == "softmax_group_limited":
        w, ids = _group_limited_greedy(logits.float(), cfg, k, renorm)
    else:
        raise MoeConvertError("unknown routing method", expected=" | ".join(METHODS), found=cfg.method)
    return w.float().contiguous(), ids.to(torch.int32).contiguous()


def _group_mask(group_scores: torch.Tensor, cfg: RouterConfig, E: int) -> torch.Tensor:
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return mask.unsqueeze(-1).expand(-1, cfg.n_group, E // cfg.n_group).reshape(-1, E).bool()


def _grouped_topk(logits, cfg: RouterConfig, k: int, renorm: bool, bias):
    E = logits.shape[-1]
    scores = logits.sigmoid()
    choice = scores + bias.float() if bias is not None else scores
    group_scores = choice.view(-1, cfg.n_group, E // cfg.n_group).topk(2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(group_scores, cfg, E), float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if renorm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * cfg.routed_scaling_factor, ids


def _group_limited_greedy(logits, cfg: RouterConfig, k: int, renorm: bool):
    E = logits.shape[-1]
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if cfg.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, cfg.n_group, E // cfg.n_group).max(dim=-1).values
        scores = scores.masked_fill(~_group_mask(group_scores, cfg, E), 0.0)
    w, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * cfg.routed_scaling_factor, ids


# ---------------------------------------------------------------------------------------------------
# families (config.json keys as transformers' configs name them)


def _text_config(cfg: dict) -> tuple[dict, str]:
    text = cfg.get("text_config")
    if isinstance(text, dict) and "hidden_size" in text and "hidden_size" not in cfg:
        return text, "text_config."
    return cfg, ""


def router_config(family: str, config: dict, top_k: int | None) -> RouterConfig | None:
    """The routing of a model family (its declared ``routing``, moeconvert/format/families.py), with the
    parameters its config.json holds, each read with its declared type; None when the family's router is
    not one this module reproduces (the caller routes)."""
    spec = BY_NAME.get(family)
    if spec is None or spec.refused:
        raise MoeConvertError("no routing function known for this model family", file="config.json",
                              expected=", ".join(f.name for f in FAMILIES if not f.refused), found=family)
    if spec.routing is None:
        return None
    cfg, section = _text_config(config)
    v = read_keys(cfg, spec, section)
    k = top_k or v[spec.top_k_key]
    if not isinstance(k, int) or k <= 0:
        raise MoeConvertError("no top-k for the router", file="config.json", tensor=section + spec.top_k_key,
                              expected="a positive integer", found=k)
    scaling = float(v.get("routed_scaling_factor", 1.0))
    if spec.routing == "softmax":
        # Mixtral and Qwen3.5 always renormalise; Qwen2/Qwen3-MoE / Qwen3-Next when norm_topk_prob
        return RouterConfig("softmax", k, renormalize=v.get("norm_topk_prob", True))
    if spec.routing == "grouped":
        norm = v.get("norm_topk_prob", True)
        return RouterConfig("grouped", k, renormalize=True if norm is None else norm,
                            n_group=v.get("n_group") or 1, topk_group=v.get("topk_group") or 1,
                            routed_scaling_factor=scaling, fp32_logits=True)
    if spec.routing == "softmax_group_limited":
        return RouterConfig("softmax_group_limited", k, renormalize=bool(v.get("norm_topk_prob")),
                            n_group=v.get("n_group") or 1, topk_group=v.get("topk_group") or 1,
                            routed_scaling_factor=scaling, topk_method=v.get("topk_method", "greedy"),
                            fp32_logits=True)
    return RouterConfig(spec.routing, k)


@dataclass
class Router:
    """A layer's router: ``logits = x @ weight.T (+ bias)``, then :func:`route`."""

    config: RouterConfig
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    e_score_correction_bias: torch.Tensor | None = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.float32 if self.config.fp32_logits else x.dtype
        b = None if self.bias is None else self.bias.to(dt)
        return torch.nn.functional.linear(x.to(dt), self.weight.to(dt), b)

    def __call__(self, x: torch.Tensor, top_k: int | None = None, renormalize: bool | None = None):
        return route(self.logits(x), self.config, top_k=top_k, renormalize=renormalize,
                     e_score_correction_bias=self.e_score_correction_bias)


def router_from_tensors(cfg: RouterConfig, tensors: dict[str, torch.Tensor]) -> Router:
    """``tensors``: the layer's router tensors by full name (``...gate.weight``, ``.bias``,
    ``.e_score_correction_bias``)."""
    by_suffix = {name.rsplit(".", 1)[-1]: t for name, t in tensors.items()}
    if "weight" not in by_suffix:
        raise MoeConvertError("the layer's router has no weight", tensor=", ".join(tensors) or "no router tensors")
    return Router(cfg, by_suffix["weight"], by_suffix.get("bias"), by_suffix.get("e_score_correction_bias"))
