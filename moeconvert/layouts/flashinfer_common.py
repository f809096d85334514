"""What the two FlashInfer MXFP4 layouts share (``flashinfer-cutlass``: flashinfer_cutlass.py,
``flashinfer-trtllm`` for MXFP4: flashinfer_trtllm_mxfp4.py): the library versions they were made for
and the constraints both kernels put on a layer (docs/layouts/flashinfer-mxfp4.md)."""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError

MXFP4_BLOCK = 32
ACTIVATIONS = ("silu", "swigluoai")  # both kernels run these gated activations (vLLM's _supports_activation)
#: vLLM 0.33.0 pins flashinfer-python 0.7.2.post1; every helper these bytes follow is identical in 0.7.4
MADE_FOR = {"vllm": ["0.33.0"], "flashinfer": "0.7.2.post1"}


def common_problems(layout: str, shape: LayerShape, pads: tuple[int, int]) -> list[str]:
    Hp, Ip = shape.hidden_size, shape.intermediate_size
    problems = []
    if shape.dtype != "bfloat16":
        problems.append(
            f"model dtype = {shape.dtype}: the {layout} MXFP4 kernel takes bfloat16 activations only "
            "(vLLM asserts hidden_states.dtype == torch.bfloat16)"
        )
    if shape.activation not in ACTIVATIONS:
        problems.append(f"activation = {shape.activation}: the {layout} MXFP4 kernel runs "
                        f"{' and '.join(ACTIVATIONS)} here")
    for name, k, pad in (("hidden_size Hp", Hp, pads[0]), ("intermediate_size Ip (per TP rank)", Ip, pads[1])):
        if k % MXFP4_BLOCK:
            problems.append(f"{name} = {k} must be a multiple of the MXFP4 block {MXFP4_BLOCK}")
        if k % pad:
            problems.append(f"{name} = {k} must be a multiple of {pad} (vLLM 0.33.0 pads it to {pad} for this "
                            "backend; docs/layouts/flashinfer-mxfp4.md)")
    return problems


def scale_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def check_block(block: ExpertBlock, shape: LayerShape) -> None:
    Hp, Ip = shape.hidden_size, shape.intermediate_size
    if (block.hidden_size, block.intermediate_size) != (Hp, Ip) or block.w13.shape[2] * 2 != Hp:
        raise InternalError(f"block is w13 {tuple(block.w13.shape)} w2 {tuple(block.w2.shape)}, "
                            f"layer says Hp={Hp} Ip={Ip}")
    if block.w13.dtype != torch.uint8 or block.w13_scale is None:
        raise InternalError("an MXFP4 block holds packed uint8 codes and e8m0 scales")
