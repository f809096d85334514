"""Writes the checkpoints in this folder with GPTQModel 7.7.0, the producer of many GPTQ MoE checkpoints on
the Hub, through its own API (``GPTQModel.load(..., QuantizeConfig(...))``, ``.quantize``, ``.save``): GPTQ
itself, with calibration, on a CPU.

    python -m venv /tmp/gm && /tmp/gm/bin/pip install torch==2.13.0 transformers==5.25.0
    pip download --no-deps gptqmodel==7.7.0 && tar xzf gptqmodel-7.7.0.tar.gz
    # 7.7.0 asks for torch>=2.14.1; it runs on 2.13.0, so its other requirements are installed beside it
    grep -v '^torch>=' gptqmodel-7.7.0/requirements.txt > req.txt && echo torch==2.13.0 > pin.txt
    /tmp/gm/bin/pip install -c pin.txt -r req.txt
    /tmp/gm/bin/pip install --no-deps --no-build-isolation ./gptqmodel-7.7.0.tar.gz
    GPTQMODEL_CPU_WORKERS=2 /tmp/gm/bin/python tests/data/gptqmodel/make.py

(GPTQMODEL_CPU_WORKERS: on a machine with fewer than 4 cores GPTQModel 7.7.0's default worker pool is too
small for its own loader.) The model is the tiny Qwen3-MoE of tests/data/autoround/make.py (seed 0, H 128,
I 128, 4 experts, top-2, 2 layers); the calibration set is 32 random sequences of 32 tokens, which routes
tokens to every expert of both layers (checked). ``fallback=None``: an expert left without calibration
tokens would stay bf16, and every expert is checked to be quantized.

* ``w4g32``: 4 bits, group 32, symmetric, ``desc_act: false``;
* ``w4g32-dynamic``: the same, with ``dynamic={"+:.*layers\\.1\\.mlp\\.experts.*": {"bits": 8}}`` (layer 1's
  experts at 8 bits), the form GPTQModel's documentation gives.

GPTQModel writes ``checkpoint_format: gptq`` (v1 zeros, 7 in every 4-bit field) and fp16 scales, and keeps
each expert's own Linear modules (``experts.E.gate_proj.qweight``). Its config's ``meta`` records, among
others, the temporary folder it used.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "autoround"))
from make import base_model  # noqa: E402  the same tiny model as AutoRound's checkpoints

CASES = {"w4g32": None, "w4g32-dynamic": {r"+:.*layers\.1\.mlp\.experts.*": {"bits": 8}}}


def calibration() -> list[dict]:
    ids = torch.randint(0, 62, (32, 32), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in ids]


def main() -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bf16"
        base_model(src)
        for name, dynamic in CASES.items():
            config = QuantizeConfig(bits=4, group_size=32, sym=True, desc_act=False, dynamic=dynamic, device="cpu",
                                    fallback=None)
            model = GPTQModel.load(str(src), config)
            model.quantize(calibration(), batch_size=1)
            shutil.rmtree(HERE / name, ignore_errors=True)
            model.save(str(HERE / name))
            with safe_open(str(HERE / name / "model.safetensors"), "pt") as f:
                names = set(f.keys())
            missing = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for layer in range(2) for e in range(4)
                       for p in ("gate_proj", "up_proj", "down_proj")
                       if f"model.layers.{layer}.mlp.experts.{e}.{p}.qweight" not in names]
            assert not missing, f"experts left unquantized: {missing}"
            print("wrote", HERE / name, file=sys.stderr)


if __name__ == "__main__":
    main()
