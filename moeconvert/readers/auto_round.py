"""AutoRound's own format (``quant_method: auto-round``, AutoRound's default export; docs/sources.md).

Its integer checkpoints hold GPTQ-packed (``packing_format: auto_round:auto_gptq``, the default) or
AWQ-packed (``auto_round:auto_awq``) tensors under the same names as those formats. vLLM 0.33.0 and 0.34.0
serve them as ``inc`` (quantization/inc): a MoE layer of 4 or 8 bits gets the GPTQ or AWQ Marlin MoE
method (``INCWNA16MoEScheme``: ``AutoGPTQMoEMethod`` / ``AutoAWQMoEMethod`` built from the layer's bits,
group size and symmetry), so the experts are read by the GPTQ and AWQ readers, with the config those
methods are given:

* ``auto_round:auto_gptq``: symmetric only (vLLM runs asymmetric GPTQ packing on its MoeWNA16 kernel, not
  Marlin), zeros stored as GPTQ v1 (zero - 1), as AutoRound writes them;
* ``auto_round:auto_awq``: with zero points (``sym: false``), 4 bits.

Layers outside ``block_name_to_quantize`` (vLLM's ``startswith`` test) are read as float. vLLM resolves
``extra_config`` (per-module bits, group size, symmetry) for a MoE layer by rules of its own (exact names,
suffixes, regexes, the sub-modules' entries); an entry that names or matches a MoE layer or one of its
experts' modules is refused, naming it, rather than resolved here by rules that might not be vLLM's.
Entries for other modules (AutoRound writes one per router it leaves unquantized) are vLLM's to apply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, config_int, config_value, show_value
from moeconvert.readers.awq import AWQ, AWQConfig
from moeconvert.readers.base import LEFT_FLOAT, LayerNames
from moeconvert.readers.gptq import GPTQ, GPTQConfig
from moeconvert.readers.registry import register

PACKINGS = {"auto_round:auto_gptq": "auto-round-gptq", "auto_round:auto_awq": "auto-round-awq"}
#: vLLM's INCConfig.SUPPORTED_BACKENDS that leave the packing's own method (an ``awq`` backend on GPTQ
#: packing, or the reverse, would hand the tensors to the other format's method)
_BACKENDS = {"auto-round-gptq": ("auto", "marlin", "gptq", "gptq:marlin"),
             "auto-round-awq": ("auto", "marlin", "awq", "awq:marlin")}
_REGEX_CHARS = set(r"*+?^$()[]{}|\\")  # what makes an extra_config key a regex for vLLM's INC parser


@dataclass(frozen=True)
class AutoRoundConfig:
    packing: str
    #: the config the experts' GPTQ or AWQ tensors are read with
    inner: GPTQConfig | AWQConfig
    blocks: tuple[str, ...] | None
    extra: tuple[str, ...]

    def reader_name(self) -> str:
        return PACKINGS[self.packing]


def _refuse(key: str, message: str, expected: str, value) -> MoeConvertError:
    return MoeConvertError(message, file=CONFIG_NAME, tensor=key, expected=expected, found=show_value(value))


def parse_config(qc: dict, section: str) -> AutoRoundConfig:
    """The ``auto-round`` config, refused where vLLM's INCConfig refuses it or runs its experts on another
    kernel than the GPTQ / AWQ Marlin MoE methods."""
    data_type = config_value(qc, "data_type", str, default="int", section=section)
    if data_type != "int":
        raise _refuse(section + "data_type", "only AutoRound's integer checkpoints are read", "int", data_type)
    packing = config_value(qc, "packing_format", str, default="auto_round:auto_gptq", section=section)
    if packing not in PACKINGS:
        raise _refuse(section + "packing_format", "AutoRound integer packing not read", " or ".join(PACKINGS),
                      packing)
    name = PACKINGS[packing]
    backend_key = next((k for k in ("backend", "vllm_backend") if k in qc), "backend")
    backend = config_value(qc, backend_key, str, default="auto", section=section)
    if backend not in _BACKENDS[name]:
        raise _refuse(section + backend_key, f"this backend does not serve {packing} experts with that packing's "
                      "Marlin MoE method in vLLM", " or ".join(_BACKENDS[name]), backend)
    bits = config_int(qc, "bits", section=section)
    group_size = config_int(qc, "group_size", min=-1, section=section)
    sym = config_value(qc, "sym", bool, default=True, section=section)
    if name == "auto-round-gptq":
        if bits not in (4, 8):
            raise _refuse(section + "bits", "vLLM serves AutoRound MoE experts on Marlin with 4 or 8 bits only "
                          "(other widths go to its humming or MoeWNA16 kernels)", "4 or 8", bits)
        if not sym:
            raise _refuse(section + "sym", "vLLM runs asymmetric auto_gptq-packed MoE experts on its MoeWNA16 "
                          "kernel, not Marlin", "true", sym)
        if group_size == 0:
            raise _refuse(section + "group_size", "no group size", "-1 (channelwise) or > 0", group_size)
        inner = GPTQConfig(bits=bits, group_size=group_size, checkpoint_format="gptq")
    else:
        if bits != 4:
            raise _refuse(section + "bits", "vLLM serves AWQ MoE experts with 4 bits only", "4", bits)
        if sym:
            raise _refuse(section + "sym", "vLLM's AWQ MoE Marlin path needs zero points (sym false)", "false", sym)
        if group_size <= 0:
            raise _refuse(section + "group_size", "AWQ MoE experts need groups along K", "> 0", group_size)
        inner = AWQConfig(group_size=group_size, modules_to_not_convert=())
    blocks_key = next((k for k in ("block_name_to_quantize", "to_quant_block_names") if k in qc),
                      "block_name_to_quantize")
    blocks = qc.get(blocks_key)
    if isinstance(blocks, str):
        blocks = blocks.split(",")  # as vLLM's INCConfig splits it
    if blocks is not None and not (isinstance(blocks, list) and all(isinstance(b, str) for b in blocks)):
        raise _refuse(section + blocks_key, "invalid value", "a string or a list of strings", blocks)
    extra = config_value(qc, "extra_config", dict, default=None, section=section) or {}
    return AutoRoundConfig(packing=packing, inner=inner, blocks=tuple(blocks) if blocks is not None else None,
                           extra=tuple(extra))


def _touches(key: str, names: LayerNames) -> bool:
    """Whether vLLM might apply the extra_config entry ``key`` to this MoE layer: it names the layer, one of
    its modules or something below it, is a suffix of one of those names, or is a regex that finds one."""
    layer_names = (names.prefix, names.vllm)
    every = (*layer_names, *(names.modules or tuple(names.first.values())))
    if key in every or any(n.endswith("." + key) for n in every) or any(key.startswith(n + ".") for n in layer_names):
        return True
    if any(c in _REGEX_CHARS for c in key):
        try:
            regex = re.compile(key)
        except re.error:
            return False  # vLLM skips a key that does not compile
        return any(regex.search(n) for n in every)
    return False


class _AutoRound:
    """What both AutoRound readers add to the GPTQ / AWQ reader they extend: the layer's config."""

    quant_method = None  # chosen by packing_format (registry.SourceFormat.layer)

    def layer_config(self, config: AutoRoundConfig, names: LayerNames):
        key = next((k for k in config.extra if _touches(k, names)), None)
        if key is not None:
            raise MoeConvertError("per-module settings for MoE experts in an AutoRound config are not read (vLLM "
                                  "resolves them per layer by its own rules)", file=CONFIG_NAME,
                                  tensor=f"quantization_config.extra_config.{key}",
                                  expected=f"no entry for {names.prefix} or its experts", found="an entry")
        if config.blocks is not None and not any(n.startswith(b) for b in config.blocks
                                                 for n in (names.prefix, names.vllm)):
            return LEFT_FLOAT
        return config.inner


@register
class AutoRoundGPTQ(_AutoRound, GPTQ):
    name = "auto-round-gptq"
    title = "AutoRound (auto_round:auto_gptq packing)"


@register
class AutoRoundAWQ(_AutoRound, AWQ):
    name = "auto-round-awq"
    title = "AutoRound (auto_round:auto_awq packing)"
