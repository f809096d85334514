"""Writes the checkpoints in this folder with llm-compressor 0.14.0.1, the producer of the compressed-tensors
MXFP4 and NVFP4 MoE checkpoints on the Hub, through its own API (``oneshot`` with a ``QuantizationModifier``),
on a CPU.

    python -m venv /tmp/lc && /tmp/lc/bin/pip install torch==2.13.0 transformers==5.17.0 llmcompressor==0.14.0.1
    /tmp/lc/bin/python tests/data/llm-compressor/make.py

(llm-compressor 0.14.0.1 pins transformers <= 5.17.0; with 5.25.0 it writes the same bytes.) The model is the
tiny Qwen3-MoE of tests/data/autoround/make.py. transformers holds its experts as fused 3-D parameters, which
a ``targets="Linear"`` recipe cannot match: llm-compressor's own ``linearize_moe`` turns them into one Linear
per expert and projection first, as its ``oneshot`` would. The routers and lm_head are left unquantized.

* ``mxfp4a16``: scheme ``MXFP4A16`` (weights only, e8m0 group-32 scales), no calibration data;
* ``nvfp4a16``: scheme ``NVFP4A16`` (weights only, e4m3 group-16 scales and a global scale per tensor);
* ``nvfp4``: scheme ``NVFP4`` (W4A4: also a static global scale of each layer's input), calibrated on 32
  random sequences of 32 tokens with every expert calibrated on every token (``moe_calibrate_all_experts``).

llm-compressor gives each expert's gate and up projections one global scale (and q, k, v one), and each
down projection its own.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "autoround"))
from make import base_model  # noqa: E402  the same tiny model as AutoRound's checkpoints

CASES = {"mxfp4a16": "MXFP4A16", "nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}


def calibration():
    from datasets import Dataset

    ids = torch.randint(0, 62, (32, 32), generator=torch.Generator().manual_seed(0)).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32 for _ in ids]})


def main() -> None:
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bf16"
        base_model(src)
        for name, scheme in CASES.items():
            model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
            linearize_moe(model)
            recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head", "re:.*mlp.gate$"])
            data = (dict(dataset=calibration(), num_calibration_samples=32, max_seq_length=32,
                         moe_calibrate_all_experts=True) if scheme == "NVFP4" else {})
            oneshot(model=model, recipe=recipe, **data)
            shutil.rmtree(HERE / name, ignore_errors=True)
            model.save_pretrained(HERE / name, save_compressed=True)
            PreTrainedTokenizerFast.from_pretrained(src).save_pretrained(HERE / name)
            print("wrote", HERE / name, file=sys.stderr)


if __name__ == "__main__":
    main()
