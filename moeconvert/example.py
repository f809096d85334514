"""Small but real MoE checkpoints, made by the real producers, for `moeconvert example` and the tests.

The model is built by ``transformers`` from a tiny config of the family, with random weights under a
fixed seed, and saved with ``save_pretrained``. For the int schemes, compressed-tensors itself computes
the quantization parameters (``calculate_qparams`` from per-group min/max) and compresses every
targeted ``Linear`` weight (``PackedQuantizationCompressor.compress``), and its ``QuantizationConfig``
writes the ``quantization_config``: a genuine ``pack-quantized`` checkpoint. The compression works on
the saved per-expert 2-D weights, because transformers >= 5 keeps experts fused in memory, where
compressed-tensors finds no expert ``nn.Linear`` to quantize.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError

FAMILIES = ("qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v2", "deepseek-v3", "glm4-moe", "gpt-oss")
SCHEMES = ("bf16", "fp16", "w4a16", "w8a16")

# Routers and lm_head stay unquantized, as in RedHatAI's W4A16 MoE checkpoints.
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*router$", "re:.*shared_expert_gate$"]


def _config_kwargs(family: str, H: int, I: int, E: int, layers: int) -> tuple[str, dict]:
    common = dict(hidden_size=H, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
    if family == "qwen3-moe":
        return "qwen3_moe", dict(common, head_dim=H // 4, intermediate_size=2 * H, moe_intermediate_size=I,
                                 num_experts=E, norm_topk_prob=True)
    if family == "qwen2-moe":
        return "qwen2_moe", dict(common, intermediate_size=2 * H, moe_intermediate_size=I, num_experts=E,
                                 shared_expert_intermediate_size=I)
    if family == "mixtral":
        return "mixtral", dict(common, intermediate_size=I, num_local_experts=E)
    if family in ("deepseek-v2", "deepseek-v3"):
        kw = dict(common, num_key_value_heads=4, intermediate_size=2 * H, moe_intermediate_size=I,
                  n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=64,
                  kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)
        if family == "deepseek-v3":
            kw.update(n_group=2, topk_group=1)
        return family.replace("-", "_"), kw
    if family == "glm4-moe":
        return "glm4_moe", dict(common, head_dim=H // 4, intermediate_size=2 * H, moe_intermediate_size=I,
                                n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=1)
    if family == "gpt-oss":
        return "gpt_oss", dict(common, head_dim=H // 4, intermediate_size=I, num_local_experts=E,
                               layer_types=["sliding_attention", "full_attention"] * ((layers + 1) // 2))
    raise MoeConvertError("unknown example family", expected=" | ".join(FAMILIES), found=family)


def make_example(out_dir: str | Path, family: str = "qwen3-moe", scheme: str = "w4a16", *,
                 group_size: int = 128, symmetric: bool = True, num_layers: int | None = None,
                 num_experts: int = 8, hidden_size: int = 256, intermediate_size: int = 128,
                 seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Write a checkpoint of ``family`` in ``scheme`` to ``out_dir`` and return its path."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise MoeConvertError("moeconvert example needs transformers: pip install 'moeconvert[example]'") from e
    if scheme not in SCHEMES:
        raise MoeConvertError("unknown example scheme", expected=" | ".join(SCHEMES), found=scheme)
    quantized = scheme in ("w4a16", "w8a16")
    if quantized and family == "gpt-oss":
        raise MoeConvertError("gpt-oss keeps its experts as fused 3-D tensors, which compressed-tensors does "
                              "not quantize; use --scheme bf16 or fp16")
    if quantized and group_size != -1 and (hidden_size % group_size or intermediate_size % group_size):
        raise MoeConvertError("group size must divide the hidden and intermediate sizes", tensor="--group-size",
                              expected=f"a divisor of {hidden_size} and {intermediate_size}", found=group_size)
    layers = num_layers or (3 if family in ("deepseek-v2", "deepseek-v3", "glm4-moe") else 2)
    model_type, kw = _config_kwargs(family, hidden_size, intermediate_size, num_experts, layers)
    dtype = torch.float16 if scheme == "fp16" else torch.bfloat16
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # from_config leaves some parameters (expert tensors, biases) as whatever init the class picks;
    # draw every parameter from one seeded stream so the files are reproducible and non-degenerate.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dtype.is_floating_point:
                std = 1.0 if "norm" in name else 0.05
                mean = 1.0 if "norm" in name else 0.0
                p.copy_((torch.randn(p.shape, generator=gen) * (0.02 if "norm" in name else std) + mean).to(p.dtype))
    out = Path(out_dir)
    save_kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if not quantized:
        model.save_pretrained(out, **save_kw)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        _compress(Path(tmp), out, bits=int(scheme[1]), group_size=group_size, symmetric=symmetric,
                  max_shard_size=max_shard_size)
    return out


def _compress(src: Path, out: Path, *, bits: int, group_size: int, symmetric: bool,
              max_shard_size: str | None) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_args import QuantizationArgs
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from compressed_tensors.utils.match import match_name
    from safetensors.torch import load_file
    from huggingface_hub import save_torch_state_dict

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="channel" if group_size == -1 else "group",
                            group_size=None if group_size == -1 else group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out_tensors: dict[str, torch.Tensor] = {}
    ignore = list(IGNORE)
    for name, w in tensors.items():
        module = name.rsplit(".", 1)[0]
        # every 2-D `.weight` is a Linear's in these models, except embeddings
        is_linear = name.endswith(".weight") and w.dim() == 2 and "embed_tokens" not in name
        if not is_linear or any(match_name(module, ign) for ign in IGNORE):
            out_tensors[name] = w
            continue
        N, K = w.shape
        g = K if group_size == -1 else group_size
        if K % g:
            # e.g. MLA's small low-rank projections: left in bf16 and listed in `ignore`, as
            # llm-compressor recipes do for layers the group size does not divide
            out_tensors[name] = w
            ignore.append(module)
            continue
        groups = w.float().reshape(N, K // g, g)
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zp}
        for suffix, t in PackedQuantizationCompressor.compress(state, scheme).items():
            out_tensors[f"{module}.{suffix}"] = t.contiguous().clone()
    out.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(out_tensors, out, max_shard_size=max_shard_size or "5GB", safe_serialization=True,
                          metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                            quantization_status="compressed", ignore=ignore)
    cfg["quantization_config"] = qc.to_dict()
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            (out / extra).write_bytes((src / extra).read_bytes())
