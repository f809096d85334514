"""Header-only checkpoints of real models at full size, for planning (``moeconvert example --header-only``).

The tensor names, shapes and dtypes and the config are those of the published checkpoint (bf16
weights, as the checkpoint is after its FP8 weights are cast up, which is what ``quantize`` takes).
The shard files are sparse: a header and a hole of the data's size, so a 1.3 TB checkpoint takes a few
megabytes of disk; every weight reads back as zero. ``repack``/``quantize --dry-run`` plan it exactly as
they plan the real one, and a real run would convert zeros.
"""

from __future__ import annotations

import json
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
MODELS = {"deepseek-v3": _DEEPSEEK_V3, "kimi-k2": _KIMI_K2}


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


def tensors(c: dict) -> list[tuple[str, list[int], str]]:
    """Every tensor of the checkpoint, in the order its shards hold them."""
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


_ITEMSIZE = {"BF16": 2, "F32": 4}


def make_header_only(out_dir: str | Path, model: str = "deepseek-v3") -> Path:
    """Write ``model``'s full-size checkpoint as sparse safetensors shards (headers, no data) to ``out_dir``."""
    if model not in MODELS:
        raise MoeConvertError("no full-size description of this model", tensor="--family",
                              expected=" | ".join(MODELS), found=model)
    c = MODELS[model]
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
