"""Writes the checkpoints in this folder with AutoRound, the producer of many GPTQ and AWQ MoE checkpoints on
the Hub, through its own end-to-end API (``AutoRound(...).quantize_and_save``), so that the readers are tested
on what a producer writes and not only on what the formats' specifications say.

    python -m venv /tmp/ar && /tmp/ar/bin/pip install torch==2.13.0 auto-round==0.16.1 transformers==5.25.0
    /tmp/ar/bin/python tests/data/autoround/make.py

(the checkpoints here were written so, on a CPU). The model is a tiny Qwen3-MoE made by transformers from
random weights (seed 0, H 128, I 128, 4 experts, top-2, 2 layers), with a word-level tokenizer of its 64
tokens. AutoRound runs in its round-to-nearest mode (``iters=0``, ``disable_opt_rtn``: no calibration data),
which packs and writes as its tuned mode does. AutoRound unfuses transformers' 3-D experts into per-expert
Linears, leaves each router (``mlp.gate``) unquantized and says so in the config: GPTQ's ``dynamic`` gets a
``-:`` rule per router, AWQ's ``modules_to_not_convert`` lists them.

* ``gptq-w4g32``: ``format="auto_gptq"``, 4 bits, group 32, symmetric;
* ``gptq-w4g32-w8-layer1``: the same, with layer 1's experts at 8 bits (``layer_config``), which AutoRound
  writes as a ``+:`` rule in ``dynamic``;
* ``awq-w4g32``: ``format="auto_awq"``, 4 bits, group 32, with zero points;
* ``auto-round-w4g32``: ``format="auto_round"`` (AutoRound's own format, ``quant_method: auto-round``, which
  vLLM serves as ``inc``), GPTQ packing, 4 bits, group 32, symmetric;
* ``auto-round-awq-w4g32``: ``format="auto_round:auto_awq"``, AWQ packing, 4 bits, group 32, with zero points.

AutoRound writes its own format from the safetensors files without loading the model (its "model-free"
mode), with a ``-:``-free ``extra_config`` entry per router instead of GPTQ's rules.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

HERE = Path(__file__).resolve().parent
CASES = {
    "gptq-w4g32": ("auto_gptq", dict(sym=True)),
    "gptq-w4g32-w8-layer1": ("auto_gptq", dict(sym=True, layer_config={"model.layers.1.mlp.experts": {"bits": 8}})),
    "awq-w4g32": ("auto_awq", dict(sym=False)),
    "auto-round-w4g32": ("auto_round", dict(sym=True)),
    "auto-round-awq-w4g32": ("auto_round:auto_awq", dict(sym=False)),
}


def base_model(path: Path) -> None:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=256,
                         tie_word_embeddings=False)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(62)} | {"<unk>": 62, "<eos>": 63}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


def main() -> None:
    from auto_round import AutoRound

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bf16"
        base_model(src)
        for name, (fmt, kwargs) in CASES.items():
            out = Path(tmp) / name
            AutoRound(str(src), bits=4, group_size=32, iters=0, disable_opt_rtn=True, **kwargs).quantize_and_save(
                str(out), format=fmt)
            written = next(p.parent for p in out.rglob("config.json"))  # AutoRound adds a subfolder
            shutil.rmtree(HERE / name, ignore_errors=True)
            shutil.copytree(written, HERE / name)
            print("wrote", HERE / name, file=sys.stderr)


if __name__ == "__main__":
    main()
