"""GPTQ experts (``quant_method: gptq``, as GPTQModel and AutoRound write them; docs/sources.md).

Per projection: ``qweight [K/pf, N]`` int32, the unsigned codes packed LSB-first along K (the same rule as
compressed-tensors, transposed); ``qzeros [G, N/pf]`` int32 packed along N; ``scales [G, N]``;
``g_idx [K]`` (the group of each input column); optional ``bias [N]``.

Read as vLLM 0.33.0 / 0.34.0 serve GPTQ MoE (quantization/auto_gptq.py ``AutoGPTQConfig`` and
``AutoGPTQMoEMethod``), which transposes ``qweight`` to ``[N, K/pf]`` and hands it to the same Marlin
processing as compressed-tensors (fused_moe/oracle/int_wna16.py ``_process_weights_marlin``):

* symmetric only, 4 or 8 bits (``AutoGPTQConfig.TYPE_MAP``: uint4b8, uint8b128): the zero point is
  2^(b-1), implicit; the stored ``qzeros`` are loaded but never read by the kernel;
* no activation ordering: ``desc_act: true`` with groups is refused at config parse
  (utils/gptq_utils.py ``normalize_and_validate_gptq_desc_act``), and ``g_idx`` is not loaded at all, so
  a ``g_idx`` other than the plain one (column k in group k // group_size) would be served wrong.

So the canonical block is the codes as stored and the scales, and everything vLLM would ignore is checked
instead: every stored zero must be the one the ``checkpoint_format`` says a symmetric checkpoint holds
(v1 ``gptq`` stores zero - 1, i.e. 2^(b-1) - 1; ``gptq_v2`` stores 2^(b-1)), and ``g_idx`` must be plain.

``dynamic`` (GPTQModel's and AutoRound's per-module rules: ``"-:regex"`` leaves the modules it matches
unquantized, ``"+:regex"`` or a bare regex overrides ``bits`` / ``group_size`` / ``desc_act`` / ``sym``
for them) is applied as vLLM applies it to a MoE layer (utils/gptq_utils.py ``get_dynamic_override``,
``override_config``): the first rule whose regex ``re.match``-es the layer's prefix decides for all its
experts. A producer applied the rules to each expert's own modules; where a rule would give one of them
another config than the layer's prefix gets, vLLM would serve those bytes under the wrong config, so the
layer is refused naming the rule and the module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, config_int, config_value, show_value
from moeconvert.packing import unpack_int32
from moeconvert.readers.base import (FLOAT_DTYPES, LEFT_FLOAT, Expert, LayerNames, Projection, Reader, expect_dtype,
                                     expect_finite, expect_shape, suffix_list)
from moeconvert.readers.registry import register
from moeconvert.schemes import Scheme, WNA16Scheme, float_dtype_name
from moeconvert.sources import Source

_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what the stored zero is below 2^(b-1)


@dataclass(frozen=True)
class Rule:
    """One ``dynamic`` entry: its key as written, the regex, and the overrides (None: a ``-:`` rule)."""

    key: str
    regex: re.Pattern
    overrides: dict | None


@dataclass(frozen=True)
class GPTQConfig:
    bits: int
    group_size: int  # -1: one group spanning K
    checkpoint_format: str  # "gptq" (v1) or "gptq_v2"
    desc_act: bool = False
    dynamic: tuple[Rule, ...] = ()

    def rule(self, name: str) -> Rule | None:
        """The rule vLLM applies to the module ``name``: the first whose regex matches it from its start."""
        return next((r for r in self.dynamic if r.regex.match(name)), None)

    def under(self, rule: Rule | None, section: str) -> "GPTQConfig | None":
        """This config as ``rule`` leaves it for the modules it matches (None: left unquantized), refused
        where vLLM refuses the result (``override_config``: only ``TYPE_MAP``'s bits and symmetry)."""
        if rule is not None and rule.overrides is None:
            return None
        o = {} if rule is None else rule.overrides
        # as vLLM's override_config reads them: a value of another type leaves the base config's
        bits = o["bits"] if isinstance(o.get("bits"), int) else self.bits
        group = o["group_size"] if isinstance(o.get("group_size"), int) else self.group_size
        sym = o["sym"] if isinstance(o.get("sym"), bool) else True
        key = f"{section}dynamic.{rule.key}" if rule is not None else section.rstrip(".")
        if bits not in (4, 8):
            raise _refuse("", key, "vLLM serves GPTQ MoE experts with 4 or 8 bits only", "bits 4 or 8", bits)
        if not sym:
            raise _refuse("", key, "asymmetric GPTQ is refused by vLLM 0.33.0 and 0.34.0", "sym true", sym)
        if group == 0:
            raise _refuse("", key, "no group size", "group_size -1 (channelwise) or > 0", group)
        return replace(self, bits=bits, group_size=group, dynamic=())

    @property
    def stored_zero(self) -> int:
        """The value every ``qzeros`` field holds in a symmetric checkpoint of this format."""
        return (1 << (self.bits - 1)) - _FORMATS[self.checkpoint_format]


def _refuse(section: str, key: str, message: str, expected: str, value) -> MoeConvertError:
    return MoeConvertError(message, file=CONFIG_NAME, tensor=section + key, expected=expected,
                           found=show_value(value))


@register
class GPTQ(Reader):
    name = "gptq"
    title = "GPTQ"
    quant_method = "gptq"
    suffixes = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    @classmethod
    def parse_config(cls, qc: dict, section: str) -> GPTQConfig:
        # the keys AutoGPTQConfig.from_config requires, refused where it (or its MoE method) refuses them
        bits = config_int(qc, "bits", section=section)
        group_size = config_int(qc, "group_size", min=-1, section=section)
        desc_act = config_value(qc, "desc_act", bool, section=section)
        sym = config_value(qc, "sym", bool, section=section)
        if bits not in (4, 8):
            raise _refuse(section, "bits", "vLLM serves GPTQ MoE experts with 4 or 8 bits only", "4 or 8", bits)
        if group_size == 0:
            raise _refuse(section, "group_size", "no group size", "-1 (channelwise) or > 0", group_size)
        if not sym:
            raise _refuse(section, "sym", "asymmetric GPTQ is refused by vLLM 0.33.0 and 0.34.0 (AutoGPTQConfig "
                          "serves uint4b8 / uint8b128 only)", "true", sym)
        if desc_act and group_size != -1:
            raise _refuse(section, "desc_act", "GPTQ group activation ordering is refused by vLLM 0.33.0 and 0.34.0 "
                          "(normalize_and_validate_gptq_desc_act)", "false", desc_act)
        dynamic = _parse_dynamic(config_value(qc, "dynamic", dict, default=None, section=section) or {},
                                 desc_act, group_size, section)
        fmt = config_value(qc, "checkpoint_format", str, default="gptq", section=section)
        if fmt not in _FORMATS:
            raise _refuse(section, "checkpoint_format", "unsupported GPTQ checkpoint format",
                          " or ".join(_FORMATS), fmt)
        pack_dtype = config_value(qc, "pack_dtype", str, default="int32", section=section)
        if pack_dtype != "int32":
            raise _refuse(section, "pack_dtype", "GPTQ words must be int32", "int32", pack_dtype)
        return GPTQConfig(bits=bits, group_size=group_size, checkpoint_format=fmt, desc_act=desc_act,
                          dynamic=dynamic)

    def layer_config(self, config: GPTQConfig, names: LayerNames):
        section = "quantization_config."
        layer_rule = config.rule(names.prefix)
        if config.rule(names.vllm) is not layer_rule:
            rule = config.rule(names.vllm) or layer_rule
            raise MoeConvertError(f"the dynamic rule {rule.key!r} matches only one of the MoE layer's checkpoint "
                                  f"name and the name vLLM gives it ({names.vllm}), which vLLM's rules are "
                                  "matched against", file=CONFIG_NAME, tensor=names.prefix,
                                  expected="one rule for both names", found=f"{rule.key!r} for one")
        layer = config.under(layer_rule, section)
        seen: dict[int, GPTQConfig | None] = {id(layer_rule): layer}
        for module in names.modules or tuple(names.first.values()):
            rule = config.rule(module)
            if id(rule) not in seen:
                seen[id(rule)] = config.under(rule, section)
            if seen[id(rule)] != layer:
                shown = "none" if rule is None else repr(rule.key)
                raise MoeConvertError(
                    f"GPTQ dynamic rules give this expert module another config than vLLM gives its MoE layer "
                    f"({names.prefix}: {_describe(layer)}), whose experts vLLM serves under one config",
                    file=CONFIG_NAME, tensor=module, expected=f"the layer's rule ({_describe_rule(layer_rule)})",
                    found=f"rule {shown} ({_describe(seen[id(rule)])})")
        return LEFT_FLOAT if layer is None else layer

    def scheme(self, source: Source, prefix: str, first: Expert, config: GPTQConfig) -> Scheme:
        suffixes = set(first["gate"])
        if "qweight" not in suffixes or "scales" not in suffixes:
            raise MoeConvertError("quant_method gptq, but the experts are not GPTQ-packed", file=str(source.ident),
                                  tensor=f"{prefix}.0", expected="qweight, qzeros, scales, g_idx",
                                  found=suffix_list(first))
        scale_dtype = float_dtype_name(source.tensors[first["gate"]["scales"]].dtype)
        if scale_dtype is None:
            raise MoeConvertError("unexpected dtype", file=str(source.ident), tensor=first["gate"]["scales"],
                                  expected="F16, BF16 or F32", found=source.tensors[first["gate"]["scales"]].dtype)
        return WNA16Scheme(bits=config.bits, group_size=config.group_size, symmetric=True, scale_dtype=scale_dtype)

    def required(self, scheme: WNA16Scheme) -> frozenset[str]:
        return frozenset({"qweight", "qzeros", "scales"})

    def optional(self, scheme: WNA16Scheme) -> frozenset[str]:
        return frozenset({"g_idx"})  # the plain order when absent

    def shapes(self, source: Source, prefix: str, first: Expert, scheme: WNA16Scheme) -> tuple[int, int]:
        pf = scheme.pack_factor
        t = source.tensors
        for r in ("gate", "up", "down"):
            expect_dtype(source, first[r]["qweight"], ("I32",))
            expect_dtype(source, first[r]["qzeros"], ("I32",))
            expect_dtype(source, first[r]["scales"], FLOAT_DTYPES)
        Kp, I = t[first["gate"]["qweight"]].shape
        H = Kp * pf
        _, H_down = t[first["down"]["qweight"]].shape
        if H_down != H:
            raise MoeConvertError("down_proj's output size disagrees with gate_proj's input size",
                                  file=str(source.ident), tensor=first["down"]["qweight"],
                                  expected=f"[{-(-I // pf)}, {H}]", found=list(t[first["down"]["qweight"]].shape))
        for r, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            if k % pf or n % pf:
                raise MoeConvertError("GPTQ packs whole int32 words along K (qweight) and N (qzeros)",
                                      file=str(source.ident), tensor=first[r]["qweight"],
                                      expected=f"K and N multiples of {pf}", found=f"K {k}, N {n}")
            if scheme.group_size > 0 and k % scheme.group_size:
                raise MoeConvertError("input size is not a multiple of the group size", file=str(source.ident),
                                      tensor=first[r]["qweight"], expected=f"multiple of {scheme.group_size}",
                                      found=k)
            G = scheme.groups(k)
            expect_shape(source, first[r]["qweight"], (k // pf, n))
            expect_shape(source, first[r]["qzeros"], (G, n // pf))
            expect_shape(source, first[r]["scales"], (G, n))
            if "g_idx" in first[r]:
                expect_dtype(source, first[r]["g_idx"], ("I32", "I64"))
                expect_shape(source, first[r]["g_idx"], (k,))
                # expert 0's now (a desc_act checkpoint that says otherwise is refused before anything is
                # written); every other expert's when it is decoded
                _check_g_idx(source, first[r]["g_idx"], scheme, k)
        return H, I

    def projection(self, source: Source, names: dict[str, str], scheme: WNA16Scheme, config, n: int,
                   k: int) -> Projection:
        if "g_idx" in names:
            _check_g_idx(source, names["g_idx"], scheme, k)
        # vLLM never reads a symmetric checkpoint's qzeros, so a wrong one would be served silently: it must
        # hold what its checkpoint_format says (v1 stores zero - 1, the source of GPTQ's off-by-one)
        zeros = unpack_int32(source.read(names["qzeros"]), scheme.bits, n, dim=1)
        bad = zeros != config.stored_zero
        if bool(bad.any()):
            g, col = (int(i) for i in bad.nonzero()[0])
            raise MoeConvertError("zero point out of range for a symmetric GPTQ checkpoint",
                                  file=source.tensors[names["qzeros"]].file.name, tensor=names["qzeros"],
                                  expected=f"{config.stored_zero} everywhere (checkpoint_format "
                                           f"{config.checkpoint_format}, {scheme.bits} bits)",
                                  found=f"{int(zeros[g, col])} at group {g}, column {col}")
        codes = unpack_int32(source.read(names["qweight"]), scheme.bits, k, dim=0).T.contiguous()
        scale = expect_finite(source, names["scales"], source.read(names["scales"])).T.contiguous()
        return Projection(codes, scale)


def _describe(config: GPTQConfig | None) -> str:
    if config is None:
        return "unquantized"
    return f"{config.bits} bits, " + ("channelwise" if config.group_size == -1 else f"group {config.group_size}")


def _describe_rule(rule: Rule | None) -> str:
    return "none" if rule is None else repr(rule.key)


def _parse_dynamic(dynamic: dict, desc_act: bool, group_size: int, section: str) -> tuple[Rule, ...]:
    """``dynamic``'s rules, in order, each checked where vLLM 0.33.0 / 0.34.0 would fail on it: a regex that
    does not compile, a positive rule that is not an object, activation ordering with groups in any
    positive rule (``normalize_and_validate_gptq_desc_act``, at config parse, whatever the rule matches)."""
    rules = []
    for key, overrides in dynamic.items():
        negative = key.startswith("-:")
        pattern = key[2:] if negative or key.startswith("+:") else key
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise _refuse(section, f"dynamic.{key}", "a dynamic rule's regex does not compile", "a regex",
                          f"{e}") from None
        if negative:
            rules.append(Rule(key, regex, None))
            continue
        if not isinstance(overrides, dict):
            raise _refuse(section, f"dynamic.{key}", "a dynamic rule maps to its overrides", "an object",
                          overrides)
        rule_desc_act = overrides.get("desc_act", desc_act)
        if rule_desc_act and overrides.get("group_size", group_size) != -1:
            raise _refuse(section, f"dynamic.{key}", "GPTQ group activation ordering is refused by vLLM 0.33.0 "
                          "and 0.34.0 (normalize_and_validate_gptq_desc_act)", "desc_act false", rule_desc_act)
        rules.append(Rule(key, regex, dict(overrides)))
    return tuple(rules)


def _check_g_idx(source: Source, name: str, scheme: WNA16Scheme, k: int) -> None:
    g_idx = source.read(name).to(torch.int64)
    plain = torch.arange(k) // (k if scheme.group_size == -1 else scheme.group_size)
    if torch.equal(g_idx, plain):
        return
    G = scheme.groups(k)
    counts = torch.bincount(g_idx.clamp(0, G), minlength=G + 1)
    if bool((g_idx < 0).any()) or bool((g_idx >= G).any()) or not bool((counts[:G] == k // G).all()):
        raise MoeConvertError("g_idx is not a grouping of the input columns", file=source.tensors[name].file.name,
                              tensor=name, expected=f"each group 0..{G - 1} exactly {k // G} times", found=
                              "other group indices")
    raise MoeConvertError("g_idx reorders the input columns (activation ordering), which vLLM 0.33.0 and 0.34.0 "
                          "do not serve (they do not load g_idx)", file=source.tensors[name].file.name, tensor=name,
                          expected="column k in group k // group_size", found="a permuted order")
