"""``inspect``'s "which layout for which GPU": the layout named for each GPU family is the MoE backend vLLM
0.33.0 itself picks there (expected values written out here from vLLM's selection code, and that code's
facts read from vLLM's source below), and it says whether the checkpoint fits it and whether the plugin
serves it today."""

from __future__ import annotations

import json
import re

import pytest

from helpers import cli, vllm_reader


def _advice(src, *args) -> list[dict]:
    return json.loads(cli("inspect", src, "--json", *args, expect=0).out)["advice"]


def _by_gpu(group: dict) -> dict[str, tuple]:
    return {r["gpu"]: (r["backend"], r["fits"], r["served_by_plugin"]) for r in group["gpus"]}


def test_int4_g128_goes_to_humming_on_hopper_and_marlin_elsewhere(example_ckpt):
    (group,) = _advice(example_ckpt("qwen3-moe", "w4a16", group_size=128))
    assert group["scheme"] == "w4a16 g128 sym" and len(group["layers"]) == 2
    assert _by_gpu(group) == {"hopper": ("humming", True, True),
                              "blackwell": ("marlin", True, True),  # TRT-LLM's int4 needs group 32
                              "older": ("marlin", True, True)}
    assert "group 128" in next(r["why"] for r in group["gpus"] if r["gpu"] == "blackwell")


def test_symmetric_int4_g32_goes_to_flashinfer_trtllm_on_blackwell(example_ckpt):
    (group,) = _advice(example_ckpt("qwen3-moe", "w4a16", group_size=32, intermediate_size=256))
    assert _by_gpu(group)["blackwell"] == ("flashinfer-trtllm", True, False)


def test_fits_is_the_layouts_own_check(example_ckpt):
    """I = 128 is below what the FlashInfer TRT-LLM layout takes: named for Blackwell, but it does not fit,
    as the backends table says."""
    src = example_ckpt("qwen3-moe", "w4a16", group_size=32)
    report = json.loads(cli("inspect", src, "--json", expect=0).out)
    assert _by_gpu(report["advice"][0])["blackwell"] == ("flashinfer-trtllm", False, False)
    assert not report["backends"]["flashinfer-trtllm"]["ok"]


def test_asymmetric_int4_g32_stays_on_marlin_on_hopper_and_blackwell(example_ckpt):
    """vLLM finds no humming experts for asymmetric experts, and TRT-LLM's int4 takes symmetric only."""
    (group,) = _advice(example_ckpt("qwen3-moe", "w4a16", group_size=32, symmetric=False))
    assert _by_gpu(group) == {"hopper": ("marlin", True, True), "blackwell": ("marlin", True, True),
                              "older": ("marlin", True, True)}
    assert "asymmetric" in next(r["why"] for r in group["gpus"] if r["gpu"] == "hopper")


def test_channelwise_stays_on_marlin_on_hopper(example_ckpt):
    (group,) = _advice(example_ckpt("qwen3-moe", "w4a16", group_size=-1))
    assert _by_gpu(group)["hopper"] == ("marlin", True, True)


def test_int8_goes_to_humming_on_hopper(example_ckpt):
    (group,) = _advice(example_ckpt("qwen3-moe", "w8a16", group_size=128))
    assert _by_gpu(group) == {"hopper": ("humming", True, True), "blackwell": ("marlin", True, True),
                              "older": ("marlin", True, True)}


def test_mxfp4_targets(example_ckpt):
    (qwen,) = _advice(example_ckpt("qwen3-moe", "bf16"), "--format", "mxfp4")
    assert {g: b for g, (b, _, _) in _by_gpu(qwen).items()} == {"hopper": "humming", "blackwell": None,
                                                                "older": "marlin"}
    assert "MXFP8" in next(r["vllm_backend"] for r in qwen["gpus"] if r["gpu"] == "blackwell")
    # the humming MXFP4 layout holds this checkpoint, and the plugin serves it (HummingMXFP4Method)
    assert _by_gpu(qwen)["hopper"] == ("humming", True, True)
    (oss,) = _advice(example_ckpt("gpt-oss", "bf16"), "--format", "mxfp4")
    assert oss["has_bias"]
    assert {g: b for g, (b, _, _) in _by_gpu(oss).items()} == {"hopper": "triton", "blackwell": "flashinfer-trtllm",
                                                               "older": "marlin"}


def test_nvfp4_goes_to_humming_on_hopper_and_flashinfer_trtllm_on_blackwell(example_ckpt):
    (group,) = _advice(example_ckpt("qwen3-moe", scheme="nvfp4", intermediate_size=80))
    # the flashinfer-trtllm NVFP4 layout holds the layer; the plugin does not serve FlashInfer folders
    assert _by_gpu(group) == {"hopper": ("humming", True, True), "blackwell": ("flashinfer-trtllm", True, False),
                              "older": ("marlin", True, True)}


def test_an_unquantized_checkpoint_gets_no_layout_advice(example_ckpt):
    (group,) = _advice(example_ckpt("qwen3-moe", "bf16"))
    assert group["scheme"] == "bfloat16" and group["gpus"] == []


def test_the_table_is_printed(example_ckpt, monkeypatch):
    from moeconvert.cli.options import out

    monkeypatch.setattr(out, "width", 240)  # one line per row
    text = cli("inspect", example_ckpt("qwen3-moe", "w4a16", group_size=128), expect=0).out
    assert "Which layout for which GPU (w4a16 g128 sym): vLLM 0.33.0's own choice" in text
    rows = {line.split("│")[1].split("(")[0].strip(): line for line in text.splitlines() if line.startswith("│ ")}
    assert "repack --backend humming" in rows["Hopper"] and "HummingGroupedExperts" in rows["Hopper"]
    assert "repack --backend flashinfer-trtllm" not in text and "not yet" not in rows["Hopper"]


# --------------------------------------------------------------------------------------------------
# the facts of vLLM 0.33.0's selection the advice rests on, read from its source

def _read():
    return vllm_reader()


def _names(text: str, function: str, enum: str) -> list[str]:
    body = text[text.index(f"def {function}("):]
    body = body[:body.index("\ndef ", 1)]
    return re.findall(rf"{enum}\.([A-Z0-9_]+)", body)


def test_vllm_moves_humming_ahead_of_marlin_on_sm90_only():
    text = _read()("model_executor/layers/quantization/utils/humming/priority.py")
    assert re.search(r"_HUMMING_PREFERRED_CAPABILITIES = frozenset\(\{90\}\)", text)


def test_vllm_wna16_order():
    names = _names(_read()("model_executor/layers/fused_moe/oracle/int_wna16.py"), "_get_priority_backends",
                   "WNA16MoEBackend")
    cuda = [n for n in names if n not in ("ZEN_CPU", "CPU", "XPU", "RDNA3")]
    assert cuda == ["FLASHINFER_TRTLLM", "MARLIN", "BATCHED_MARLIN", "TRITON", "HUMMING", "EMULATION"]


def test_vllm_trtllm_int4_is_sm100_symmetric_group_32_without_bias():
    read = _read()
    experts = read("model_executor/layers/fused_moe/experts/trtllm_mxint4_moe.py")
    assert "is_device_capability_family(100)" in experts
    assert re.search(r"\(weight_key, activation_key\) == \(kInt4Static32, None\)", experts)
    oracle = read("model_executor/layers/fused_moe/oracle/int_wna16.py")
    assert re.search(r"FLASHINFER_TRTLLM and \(may_have_zp or may_have_bias\)", oracle)


def test_vllm_mxfp4_orders():
    text = _read()("model_executor/layers/fused_moe/oracle/mxfp4.py")
    oss = _names(text, "_get_priority_backends_for_gpt_oss", "Mxfp4MoeBackend")
    assert oss[0] == "FLASHINFER_TRTLLM_MXFP4_BF16"
    assert oss.index("TRITON") < oss.index("MARLIN") < oss.index("HUMMING")
    other = _names(text, "_get_priority_backends", "Mxfp4MoeBackend")
    cuda = [n for n in other if n not in ("AITER_MXFP4_BF16", "EMULATION", "XPU", "CPU")]
    assert cuda == ["FLASHINFER_TRTLLM_MXFP4_MXFP8", "DEEPGEMM_MXFP4", "MARLIN", "BATCHED_MARLIN", "HUMMING"]


def test_compressed_tensors_mxfp4_goes_to_marlin_off_sm100(example_ckpt):
    """Its MoE method chooses alone (below), not through the MXFP4 backend list."""
    (group,) = _advice(example_ckpt("qwen3-moe", "mxfp4", num_layers=2, num_experts=4))
    assert {gpu: row[0] for gpu, row in _by_gpu(group).items()} == {"hopper": "marlin", "blackwell": None,
                                                                    "older": "marlin"}


def test_vllm_compressed_tensors_mxfp4_method_runs_cutlass_where_supported_else_marlin():
    text = _read()("model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
                   "compressed_tensors_moe_w4a4_mxfp4.py")
    init = text[text.index("def __init__("):text.index("def supports_eplb")]
    assert "self.mxfp4_backend = Mxfp4MoeBackend.MARLIN" in init
    assert "self.use_cutlass_mxfp4 = CutlassExpertsMxfp4._supports_current_device()" in init
    assert re.search(r"else:\s+logger.info_once\(\"Using MarlinExperts for MXFP4 MoE\"\)\s+"
                     r"self.experts_cls = MarlinExperts", init)
    cutlass = _read()("model_executor/layers/fused_moe/experts/cutlass_moe.py")
    body = cutlass[cutlass.index("class CutlassExpertsMxfp4"):]
    body = body[body.index("def _supports_current_device"):][:400]
    # which GPUs is a question to vLLM's compiled ops (their CUTLASS MXFP4 experts are SM100 kernels)
    assert "ops.mxfp4_experts_quant_supported(capability.to_int())" in body
