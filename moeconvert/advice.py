"""Which layout to convert to for which GPU: the MoE backend vLLM 0.33.0 itself picks there for these experts.

A converted folder should be served on the kernel vLLM would have chosen for the source on that GPU, so
that converting never costs serving speed. vLLM's choice, as its code makes it (docs/vllm.md, "Which
layout for which GPU", says where; tests/test_advice.py reads those places in vLLM's source):

- **int4 / int8 weights, 16-bit activations (WNA16).** vLLM walks FlashInfer TRT-LLM, Marlin, batched
  Marlin, Triton, humming in that order and takes the first that supports the layer; on SM90 (Hopper)
  humming is moved ahead of Marlin. FlashInfer TRT-LLM's int4 experts run on the SM100 family only,
  for symmetric int4 in groups of 32 without expert biases; and vLLM builds humming experts only for
  symmetric compressed-tensors experts with group scales (asymmetric ones find no humming experts,
  channelwise ones are held to Marlin by its compressed-tensors MoE method). So: Hopper humming for
  symmetric group-scale experts, else Marlin; SM100 Blackwell FlashInfer TRT-LLM for those layers, else
  Marlin; every other CUDA GPU Marlin.
- **MXFP4 weights.** For gpt-oss vLLM walks FlashInfer TRT-LLM (bf16 activations, then MXFP8), AMD's,
  Triton (triton_kernels' matmul_ogs), FlashInfer CUTLASS, Marlin, humming: on SM100 FlashInfer TRT-LLM
  with bf16 activations, on Hopper Triton. For other models it walks FlashInfer TRT-LLM with MXFP8
  activations, DeepGEMM, Marlin, humming: on Hopper humming (ahead of Marlin), on SM100 FlashInfer
  TRT-LLM with MXFP8 activations, which no layout here writes (the bf16-activation variant's is the
  nearest), elsewhere Marlin. (Its online MXFP4 of a bf16 source walks gpt-oss's list instead, so on
  Hopper FlashInfer CUTLASS with bf16 activations comes before humming where it is installed.) The humming MXFP4 layout (``quantize --format mxfp4 --backend humming``)
  holds what vLLM's HUMMING path makes on Hopper, and the vLLM plugin serves it (``inspect`` says so
  from the layout's ``vllm_method``). compressed-tensors ``mxfp4-pack-quantized`` checkpoints choose
  otherwise: their MoE method (``CompressedTensorsW4A4Mxfp4MoEMethod``) runs CUTLASS MXFP4 where vLLM's
  compiled ops support it (``mxfp4_experts_quant_supported``: SM100 kernels), which no layout here
  writes, and Marlin everywhere else.
- **NVFP4 weights** (compressed-tensors ``nvfp4-pack-quantized``). vLLM walks FlashInfer TRT-LLM, FlashInfer
  CuteDSL, FlashInfer CUTLASS, vLLM's CUTLASS, Marlin, humming (``select_nvfp4_moe_backend``), humming moved
  ahead of Marlin on SM90. The FlashInfer and CUTLASS NVFP4 MoE kernels need SM100 or later: on Hopper
  humming (16-bit activations), which the humming NVFP4 layout holds; on SM100 FlashInfer TRT-LLM for W4A4
  checkpoints, which the flashinfer-trtllm NVFP4 layout holds; on SM80-89 Marlin (on SM120 the CUTLASS
  kernels come first, which no layout here writes).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the GPU families the advice covers, in the order shown
GPUS = (
    ("hopper", "Hopper (SM90: H100, H200, H20)"),
    ("blackwell", "Blackwell (SM100: B200, GB200, B300)"),
    ("older", "Ampere, Ada, consumer Blackwell (SM80-89, SM120)"),
)


@dataclass(frozen=True)
class Advice:
    gpu: str  # a key of GPUS
    backend: str | None  # what to pass to --backend; None: no layout here reproduces vLLM's choice
    vllm_backend: str  # what vLLM 0.33.0 picks there for these experts
    why: str

    def to_json(self) -> dict:
        return {"gpu": self.gpu, "gpu_name": dict(GPUS)[self.gpu], "backend": self.backend,
                "vllm_backend": self.vllm_backend, "why": self.why}


def advise(kind: str, family: str, bits: int | None = None, group_size: int | None = None,
           symmetric: bool | None = None, has_bias: bool = False, source_format: str | None = None) -> list[Advice]:
    """The layout to convert to on each GPU family for experts of scheme ``kind`` ("wna16", "mxfp4", "nvfp4";
    anything else: none, the source is not quantized) of a model of ``family``. ``bits``,
    ``group_size`` (-1 channelwise), ``symmetric`` and ``has_bias`` describe WNA16 experts (every layer's:
    a checkpoint whose layers differ is judged by the caller per layer). ``source_format``: the reader
    of the experts as stored (``moeconvert.readers``), where it changes vLLM's choice."""
    if kind == "wna16":
        trtllm = bits == 4 and group_size == 32 and symmetric is True and not has_bias
        humming = symmetric is True and group_size != -1
        return [
            Advice("hopper", "humming", "humming (HummingGroupedExperts)",
                   "vLLM moves humming ahead of Marlin on SM90; faster than Marlin at prefill (docs/kernels.md)")
            if humming else
            Advice("hopper", "marlin", "Marlin (MarlinExperts)",
                   "vLLM runs humming only for symmetric experts with group scales; these are "
                   f"{_describe(bits, group_size, symmetric, has_bias)}"),
            Advice("blackwell", "flashinfer-trtllm", "FlashInfer TRT-LLM int4 (TrtLlmMxint4ExpertsMonolithic)",
                   "vLLM's first choice on SM100 for symmetric int4 in groups of 32 without expert biases")
            if trtllm else
            Advice("blackwell", "marlin", "Marlin (MarlinExperts)",
                   "FlashInfer TRT-LLM's int4 experts take only symmetric int4, group 32, no biases: "
                   f"these are {_describe(bits, group_size, symmetric, has_bias)}"),
            Advice("older", "marlin", "Marlin (MarlinExperts)", "vLLM's first choice there for WNA16 experts"),
        ]
    if kind == "nvfp4":
        return [
            Advice("hopper", "humming", "humming (HummingGroupedExperts), 16-bit activations",
                   "vLLM moves humming ahead of Marlin on SM90; FlashInfer's and vLLM's CUTLASS NVFP4 MoE kernels "
                   "need SM100 (docs/layouts/humming.md, \"NVFP4\")"),
            Advice("blackwell", "flashinfer-trtllm", "FlashInfer TRT-LLM NVFP4 (TrtLlmNvFp4Experts)",
                   "vLLM's first choice on SM100 for W4A4 checkpoints (NVFP4 activations: the flashinfer-trtllm "
                   "layout refuses a W4A16 one); docs/layouts/flashinfer-nvfp4.md"),
            Advice("older", "marlin", "Marlin NVFP4 (MarlinExperts)",
                   "vLLM's first NVFP4 choice on SM80-89 (on SM120 its CUTLASS kernels come first, which no "
                   "layout here writes)"),
        ]
    if kind == "mxfp4" and source_format == "mxfp4-pack-quantized":
        return [
            Advice("hopper", "marlin", "Marlin MXFP4 (MarlinExperts)",
                   "vLLM's compressed-tensors MXFP4 MoE method runs Marlin wherever CUTLASS MXFP4 does not "
                   "support the GPU"),
            Advice("blackwell", None, "CUTLASS MXFP4 (CutlassExpertsMxfp4)",
                   "the compressed-tensors MXFP4 method's choice on SM100; no layout here writes it"),
            Advice("older", "marlin", "Marlin MXFP4 (MarlinExperts)", "as on Hopper"),
        ]
    if kind == "mxfp4":
        if family == "gpt-oss":
            return [
                Advice("hopper", "triton", "Triton (triton_kernels matmul_ogs)",
                       "for gpt-oss vLLM ranks triton_kernels ahead of Marlin and humming"),
                Advice("blackwell", "flashinfer-trtllm", "FlashInfer TRT-LLM MXFP4, bf16 activations",
                       "vLLM's first choice for gpt-oss on SM100"),
                Advice("older", "marlin", "Marlin MXFP4 (MarlinExperts)",
                       "vLLM's first choice there that runs MXFP4 weights with 16-bit activations"),
            ]
        return [
            Advice("hopper", "humming", "humming (HummingGroupedExperts)",
                   "vLLM moves humming ahead of Marlin on SM90 for MXFP4 checkpoints; its online "
                   "--quantization mxfp4 of a bf16 source tries FlashInfer CUTLASS first where that is "
                   "installed (docs/layouts/humming.md)"),
            Advice("blackwell", None, "FlashInfer TRT-LLM MXFP4, MXFP8 activations",
                   "no layout here writes it: flashinfer-trtllm holds the bf16-activation variant's layout"),
            Advice("older", "marlin", "Marlin MXFP4 (MarlinExperts)",
                   "vLLM's first choice there that runs MXFP4 weights with 16-bit activations"),
        ]
    return []


def _describe(bits, group_size, symmetric, has_bias) -> str:
    group = "channelwise" if group_size == -1 else f"group {group_size}"
    return (f"int{bits}, {group}, {'symmetric' if symmetric else 'asymmetric'}"
            + (", with biases" if has_bias else ""))
