"""Header-only checkpoints of real models at full size, for planning (``moeconvert example --header-only``).

The tensor names, shapes and dtypes and the config are those of the published checkpoint (bf16
weights, as the checkpoint is after its FP8 weights are cast up, which is what ``quantize`` takes).
Kimi-K3 also comes in the form it ships in (``scheme="mxfp4"``): its routed experts in compressed-tensors
``mxfp4-pack-quantized``, everything else bf16.
The shard files are sparse: a header and a hole of the data's size, so a 1.3 TB checkpoint takes a few
megabytes of disk; every weight reads back as zero. ``repack``/``quantize --dry-run`` plan it exactly as
they plan the real one, and a real run would convert zeros.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from moeconvert.errors import MoeConvertError
from moeconvert.format import INDEX_NAME

SHARD_BYTES = 5 * 10**9

# config.json of the published checkpoints (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct), without
# their FP8 quantization_config; rope scaling and other keys that do not change a tensor are left out.
_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
}
_KIMI_K2 = {**_DEEPSEEK_V3, "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
            "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "num_nextn_predict_layers": 0, "max_position_embeddings": 131072,
            "rope_theta": 50000.0, "bos_token_id": 163584, "eos_token_id": 163585}
# Kimi-K3 at the shape its announcement gives (896 routed experts, top-16, experts on a 3584-wide latent of
# the 7168-wide hidden state, expert intermediate 3072, 92 MoE layers, 2 shared experts), under the keys of
# vLLM 0.33.0's KimiK3Config / KimiLinearConfig (vllm/transformers_utils/configs/kimi_k3.py, kimi_linear.py)
# and the tensor names its loader maps (vllm/models/kimi_k3). Its attention and latent projections have
# no published names here, so the description holds the MoE blocks, norms, embeddings and head only:
# what the conversion plans (every byte it writes is an expert's).
_KIMI_K3_TEXT = {
    "model_type": "kimi_linear", "torch_dtype": "bfloat16", "vocab_size": 163840, "hidden_size": 7168,
    "routed_expert_hidden_size": 3584, "moe_intermediate_size": 3072, "num_experts": 896,
    "num_experts_per_token": 16, "num_shared_experts": 2, "num_hidden_layers": 92, "first_k_dense_replace": 0,
    "moe_layer_freq": 1, "hidden_act": "situ", "activation_situ_beta": 1.0, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "tie_word_embeddings": False,
}
_KIMI_K3 = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": _KIMI_K3_TEXT}
MODELS = {"deepseek-v3": _DEEPSEEK_V3, "kimi-k2": _KIMI_K2, "kimi-k3": _KIMI_K3}
#: the forms --header-only writes, per model: bf16, and the ones a model ships in
SCHEMES = {"deepseek-v3": ("bf16",), "kimi-k2": ("bf16",), "kimi-k3": ("bf16", "mxfp4")}

# Kimi-K3's routed experts as compressed-tensors' mxfp4-pack-quantized compressor writes MXFP4 weights
# (weight-only: no input activation scheme), every other module left in bf16. About 1.44 TB at full size:
# 92 x 896 x 3 x 3072 x 3584 codes at half a byte, and one scale byte per 32.
_KIMI_K3_MXFP4_CONFIG = {
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
        "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
        "weights": {"dynamic": False, "group_size": 32, "num_bits": 4, "scale_dtype": "torch.uint8",
                    "strategy": "group", "symmetric": True, "type": "float"}}},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": None, "ignore": [], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {}}


def _decoder_layer(c: dict, i: int) -> list[tuple[str, list[int], str]]:
    H, p = c["hidden_size"], f"model.layers.{i}."
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    out = [
        (p + "input_layernorm.weight", [H], "BF16"),
        (p + "post_attention_layernorm.weight", [H], "BF16"),
        (p + "self_attn.q_a_proj.weight", [c["q_lora_rank"], H], "BF16"),
        (p + "self_attn.q_a_layernorm.weight", [c["q_lora_rank"]], "BF16"),
        (p + "self_attn.q_b_proj.weight", [heads * (nope + rope), c["q_lora_rank"]], "BF16"),
        (p + "self_attn.kv_a_proj_with_mqa.weight", [c["kv_lora_rank"] + rope, H], "BF16"),
        (p + "self_attn.kv_a_layernorm.weight", [c["kv_lora_rank"]], "BF16"),
        (p + "self_attn.kv_b_proj.weight", [heads * (nope + v), c["kv_lora_rank"]], "BF16"),
        (p + "self_attn.o_proj.weight", [H, heads * v], "BF16"),
    ]

    def mlp(prefix: str, inter: int) -> list:
        return [(prefix + "gate_proj.weight", [inter, H], "BF16"), (prefix + "up_proj.weight", [inter, H], "BF16"),
                (prefix + "down_proj.weight", [H, inter], "BF16")]

    if i < c["first_k_dense_replace"]:
        return out + mlp(p + "mlp.", c["intermediate_size"])
    E, I = c["n_routed_experts"], c["moe_intermediate_size"]
    out += [(p + "mlp.gate.weight", [E, H], "BF16"), (p + "mlp.gate.e_score_correction_bias", [E], "F32")]
    for e in range(E):
        out += mlp(f"{p}mlp.experts.{e}.", I)
    return out + mlp(p + "mlp.shared_experts.", I * c["n_shared_experts"])


def _kimi_k3_tensors(c: dict) -> list[tuple[str, list[int], str]]:
    t, mxfp4 = c["text_config"], "quantization_config" in c
    H, L, V = t["hidden_size"], t["routed_expert_hidden_size"], t["vocab_size"]
    E, I, S = t["num_experts"], t["moe_intermediate_size"], t["num_shared_experts"]
    out = [("language_model.model.embed_tokens.weight", [V, H], "BF16")]
    for i in range(t["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        out += [(p + "input_layernorm.weight", [H], "BF16"), (p + "post_attention_layernorm.weight", [H], "BF16"),
                (p + "block_sparse_moe.gate.weight", [E, H], "BF16"),
                (p + "block_sparse_moe.gate.e_score_correction_bias", [E], "F32")]
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            for proj, (n, k) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
                if mxfp4:  # two e2m1 codes a byte, one e8m0 scale byte per 32 along K
                    out += [(f"{q}{proj}.weight_packed", [n, k // 2], "U8"),
                            (f"{q}{proj}.weight_scale", [n, k // 32], "U8")]
                else:
                    out.append((f"{q}{proj}.weight", [n, k], "BF16"))
        q = p + "block_sparse_moe.shared_experts."
        out += [(q + "gate_proj.weight", [I * S, H], "BF16"), (q + "up_proj.weight", [I * S, H], "BF16"),
                (q + "down_proj.weight", [H, I * S], "BF16")]
    return out + [("language_model.model.norm.weight", [H], "BF16"), ("language_model.lm_head.weight", [V, H], "BF16")]


def tensors(c: dict) -> list[tuple[str, list[int], str]]:
    """Every tensor of the checkpoint, in the order its shards hold them."""
    if c.get("model_type") == "kimi_k3":
        return _kimi_k3_tensors(c)
    H, V, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    out = [("model.embed_tokens.weight", [V, H], "BF16")]
    for i in range(n):
        out += _decoder_layer(c, i)
    for i in range(n, n + c["num_nextn_predict_layers"]):  # the multi-token-prediction layer
        p = f"model.layers.{i}."
        out += _decoder_layer(c, i) + [
            (p + "embed_tokens.weight", [V, H], "BF16"), (p + "enorm.weight", [H], "BF16"),
            (p + "hnorm.weight", [H], "BF16"), (p + "eh_proj.weight", [H, 2 * H], "BF16"),
            (p + "shared_head.norm.weight", [H], "BF16"), (p + "shared_head.head.weight", [V, H], "BF16")]
    return out + [("model.norm.weight", [H], "BF16"), ("lm_head.weight", [V, H], "BF16")]


_ITEMSIZE = {"BF16": 2, "F32": 4, "U8": 1}


def make_header_only(out_dir: str | Path, model: str = "deepseek-v3", num_layers: int | None = None,
                     scheme: str = "bf16") -> Path:
    """Write ``model``'s full-size checkpoint as sparse safetensors shards (headers, no data) to ``out_dir``;
    ``num_layers`` keeps only the first decoder layers (every layer at full size); ``scheme`` is one of the
    model's :data:`SCHEMES`."""
    if model not in MODELS:
        raise MoeConvertError("no full-size description of this model", tensor="--family",
                              expected=" | ".join(MODELS), found=model)
    if scheme not in SCHEMES.get(model, ("bf16",)):
        raise MoeConvertError(f"--header-only writes {model} in", tensor="--scheme",
                              expected=" | ".join(SCHEMES.get(model, ("bf16",))), found=scheme)
    c = json.loads(json.dumps(MODELS[model]))
    if scheme == "mxfp4":
        c["quantization_config"] = _KIMI_K3_MXFP4_CONFIG
    if num_layers is not None:
        (c.get("text_config") or c)["num_hidden_layers"] = num_layers
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: list[list] = [[]]
    size = 0
    for name, shape, dtype in tensors(c):
        n = _ITEMSIZE[dtype]
        for d in shape:
            n *= d
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shape, dtype, n))
        size += n
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype, n in group:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
            weight_map[name] = fname
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + pos)  # a hole: no data blocks on disk
        total += pos
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    return out


# Qwen/Qwen3-30B-A3B's config.json (the keys that shape a tensor or the engine's model), for checkpoints with
# random weights at the published size: `moeconvert example OUT --family qwen3-30b-a3b --random-weights`.
_QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 40960, "max_window_layers": 48,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False,
    "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# DeepSeek-V3 and Kimi-K2 as for --header-only (their first N layers: `--layers N`; a DeepSeek-V3 MoE layer
# is 5.6 GB in W4A16, a Kimi-K2 one 8.5 GB)
RANDOM_MODELS = {"qwen3-30b-a3b": _QWEN3_30B_A3B, "deepseek-v3": _DEEPSEEK_V3, "kimi-k2": _KIMI_K2}


def _qwen3_moe_tensors(c: dict) -> list[tuple[str, list[int], str]]:
    H, V, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    E, I = c["num_experts"], c["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", [V, H], "BF16")]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [H], "BF16"), (p + "post_attention_layernorm.weight", [H], "BF16"),
                (p + "self_attn.q_proj.weight", [c["num_attention_heads"] * hd, H], "BF16"),
                (p + "self_attn.k_proj.weight", [c["num_key_value_heads"] * hd, H], "BF16"),
                (p + "self_attn.v_proj.weight", [c["num_key_value_heads"] * hd, H], "BF16"),
                (p + "self_attn.o_proj.weight", [H, c["num_attention_heads"] * hd], "BF16"),
                (p + "self_attn.q_norm.weight", [hd], "BF16"), (p + "self_attn.k_norm.weight", [hd], "BF16"),
                (p + "mlp.gate.weight", [E, H], "BF16")]
        for e in range(E):
            out += [(f"{p}mlp.experts.{e}.gate_proj.weight", [I, H], "BF16"),
                    (f"{p}mlp.experts.{e}.up_proj.weight", [I, H], "BF16"),
                    (f"{p}mlp.experts.{e}.down_proj.weight", [H, I], "BF16")]
    return out + [("model.norm.weight", [H], "BF16"), ("lm_head.weight", [V, H], "BF16")]


def _w4a16_config(group_size: int, ignore: list[str]) -> dict:
    """config.json's quantization_config as compressed-tensors writes it for llm-compressor's W4A16 preset
    (every Linear but those ``ignore`` names: the same keys ``moeconvert example`` gets from
    compressed-tensors itself)."""
    return {
        "config_groups": {"group_0": {
            "format": "pack-quantized", "input_activations": None, "output_activations": None,
            "targets": ["Linear"], "weights": {"dynamic": False, "group_size": group_size, "num_bits": 4,
                                               "strategy": "group", "symmetric": True, "type": "int"}}},
        "format": "pack-quantized", "global_compression_ratio": None, "ignore": ignore,
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "sparsity_config": {}}


def make_random_weights(out_dir: str | Path, model: str = "qwen3-30b-a3b", *, layers: int | None = None,
                        scheme: str = "w4a16", group_size: int = 128, seed: int = 0, device: str = "cpu",
                        progress=None) -> Path:
    """Write ``model`` at its published size (or its first ``layers`` decoder layers) with random but valid
    weights: bf16 ``N(0, 0.02)`` matrices, unit norms, zero router score biases, and for ``w4a16`` every Linear
    but lm_head and the routers (and, for DeepSeek-V3 / Kimi-K2, their MLA attention, which stays bf16 as in
    the W4A16 checkpoints published for them) in compressed-tensors ``pack-quantized`` int4 (uniform codes,
    scales about ``0.02 / 4.6`` so the weights have the bf16 ones' spread). With ``layers``, a DeepSeek-V3 /
    Kimi-K2 checkpoint has no multi-token-prediction layer. For start-up and memory measurements at real size:
    the tokens mean nothing, but they are the same wherever the same bytes are served. Written shard by shard
    (5 GB each), never more than one shard in memory."""
    import torch
    from safetensors.torch import save_file

    if model not in RANDOM_MODELS:
        raise MoeConvertError("no full-size description of this model", tensor="--family",
                              expected=" | ".join(RANDOM_MODELS), found=model)
    if scheme not in ("bf16", "w4a16"):
        raise MoeConvertError("random weights are written in", tensor="--scheme", expected="bf16 | w4a16",
                              found=scheme)
    c = dict(RANDOM_MODELS[model])
    mla = "kv_lora_rank" in c
    if layers is not None:
        c["num_hidden_layers"] = min(layers, c["num_hidden_layers"])
        if mla:
            c["num_nextn_predict_layers"] = 0
        else:
            c["max_window_layers"] = c["num_hidden_layers"]
    names = tensors(c) if mla else _qwen3_moe_tensors(c)
    ignore = ["lm_head", "re:.*mlp.gate$"] + (["re:.*self_attn.*"] if mla else [])
    gen = torch.Generator(device=device).manual_seed(seed)
    quantized = scheme == "w4a16"

    def ignored(module: str) -> bool:  # the config's ignore list, read as compressed-tensors reads it
        return any(re.match(p[3:], module) if p.startswith("re:") else module == p for p in ignore)

    def is_quantized(name: str, shape: list[int]) -> bool:
        return (quantized and len(shape) == 2 and name.endswith("proj.weight") and shape[1] % group_size == 0
                and "embed" not in name and not ignored(name[: -len(".weight")]))

    def make(name: str, shape: list[int], dtype: str) -> dict[str, "torch.Tensor"]:
        if len(shape) == 1:  # norms 1, the routers' score-correction biases 0
            fill = torch.zeros if name.endswith("bias") else torch.ones
            return {name: fill(shape, dtype=torch.float32 if dtype == "F32" else torch.bfloat16)}
        if not is_quantized(name, shape):
            w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
            return {name: w.to(torch.bfloat16).cpu()}
        N, K = shape
        base = name[: -len(".weight")]
        words = torch.randint(-(2**31), 2**31, (N, K // 8), generator=gen, device=device, dtype=torch.int64)
        scale = 0.0043 * (1 + 0.1 * torch.randn((N, K // group_size), generator=gen, device=device))
        return {base + ".weight_packed": words.to(torch.int32).cpu(),
                base + ".weight_scale": scale.to(torch.bfloat16).cpu(),
                base + ".weight_shape": torch.tensor([N, K], dtype=torch.int64)}

    def nbytes(name: str, shape: list[int], dtype: str) -> int:
        n = 1
        for d in shape:
            n *= d
        return n // 2 if is_quantized(name, shape) else n * _ITEMSIZE[dtype]

    groups: list[list] = [[]]
    size = 0
    for name, shape, dtype in names:
        n = nbytes(name, shape, dtype)
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shape, dtype))
        size += n
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard: dict = {}
        for name, shape, dtype in group:
            shard.update(make(name, shape, dtype))
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del shard
        if progress:
            progress(k + 1, len(groups))
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if quantized:
        c["quantization_config"] = _w4a16_config(group_size, ignore)
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    return out
