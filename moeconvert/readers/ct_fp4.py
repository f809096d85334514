"""compressed-tensors ``mxfp4-pack-quantized`` and ``nvfp4-pack-quantized`` experts (docs/sources.md).

Per projection, as compressed-tensors' ``MXFP4PackedCompressor`` / ``NVFP4PackedCompressor`` write them:
``weight_packed [N, K/2]`` uint8, two e2m1 codes a byte, element 2j in the low nibble of byte j (their
``pack_fp4_to_uint8``: sign in bit 3) -- the canonical packing as it is; and

* MXFP4: ``weight_scale [N, K/32]`` uint8, the e8m0 byte ``127 + floor(log2 scale)``
  (``compress_mx_scale``): the canonical scale byte as it is;
* NVFP4: ``weight_scale [N, K/16]`` float8_e4m3fn, ``weight_global_scale [1]`` fp32 (the value is
  ``e2m1 * scale / global``) and, for W4A4 checkpoints, ``input_global_scale [1]`` fp32, which only
  kernels that quantize activations read (FlashInfer TRT-LLM; Marlin and humming run weight-only): kept as
  the block's input multipliers, which the other layouts drop.

The scheme is taken where vLLM 0.33.0 takes it (``CompressedTensorsMoEMethod.get_moe_method``): from the
weights' arguments of the config group that holds the experts (``_is_mxfp4``: float, 4 bits, group 32,
strategy group, symmetric; ``_is_nvfp4_format``: float, 4 bits, group 16, strategy tensor_group,
symmetric), with the input activations it accepts for each. TP/EP cuts follow vLLM's loader: gate and up
rows per rank, down's packed columns and scale groups per rank, global scales whole.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from moeconvert.canonical import ExpertBlock, Partition
from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, show_value
from moeconvert.readers.base import ROLES, Expert, Reader, check_alike, expect_dtype, expect_shape, suffix_list
from moeconvert.readers.registry import register
from moeconvert.schemes import CompressedTensorsConfig, MXFP4Scheme, NVFP4Scheme, QuantArgs, Scheme
from moeconvert.sources import Source

_SECTION = "quantization_config.config_groups."


class _FP4PackQuantized(Reader):
    compressed_tensors = True
    #: the weights' arguments vLLM requires of this format (its ``_is_mxfp4`` / ``_is_nvfp4_format``)
    group_size: ClassVar[int]
    strategy: ClassVar[str]
    scale_dtypes: ClassVar[tuple[str, ...]]
    required_suffixes: ClassVar[frozenset[str]]
    #: the packed codes' and the scales' suffixes (DeepSeek-V4's own checkpoints: ``weight`` / ``scale``)
    weight_suffix: ClassVar[str] = "weight_packed"
    scale_suffix: ClassVar[str] = "weight_scale"
    #: the packed codes' dtypes (DeepSeek-V4 stores the bytes as int8)
    weight_dtypes: ClassVar[tuple[str, ...]] = ("U8",)

    def _expected_args(self, args: QuantArgs | None) -> str | None:
        """What is wrong with ``args`` for this format's weights (None: nothing)."""
        if args is None:
            return "no weights arguments"
        got = {"type": args.type, "num_bits": args.num_bits, "strategy": args.strategy,
               "group_size": args.group_size, "symmetric": args.symmetric, "dynamic": args.dynamic}
        want = {"type": "float", "num_bits": 4, "strategy": self.strategy, "group_size": self.group_size,
                "symmetric": True, "dynamic": False}
        bad = [k for k in want if got[k] != want[k]]
        return None if not bad else f"{bad[0]} = {show_value(got[bad[0]])}, {self.name} needs {show_value(want[bad[0]])}"

    def _input_problem(self, args: QuantArgs | None) -> str | None:
        return None

    def scheme(self, source: Source, prefix: str, first: Expert, config: CompressedTensorsConfig) -> Scheme:
        if "weight_packed" not in first["gate"]:
            raise MoeConvertError(f"quantization_config says the experts are {self.name}, but they are not packed",
                                  file=str(source.ident), tensor=f"{prefix}.0", expected="weight_packed + weight_scale",
                                  found=suffix_list(first))
        names = {role: first[role]["weight_packed"].rsplit(".", 1)[0] for role in ROLES if "weight_packed" in first[role]}
        group = config.expert_group(names)
        section = f"{_SECTION}{group.name}."
        why = self._expected_args(group.weights)
        if why:
            raise MoeConvertError(f"not an {self.name} weight scheme (vLLM picks its MoE method from these "
                                  f"arguments): {why}", file=CONFIG_NAME, tensor=section + "weights")
        why = self._input_problem(group.input_activations)
        if why:
            raise MoeConvertError(why, file=CONFIG_NAME, tensor=section + "input_activations")
        return MXFP4Scheme() if self.group_size == 32 else NVFP4Scheme()

    def required(self, scheme: Scheme) -> frozenset[str]:
        return self.required_suffixes

    def check(self, source: Source, prefix: str, experts: list[Expert], scheme: Scheme) -> tuple[int, int]:
        # no expert bias: vLLM's compressed-tensors FP4 MoE methods create no bias parameter to load it into
        check_alike(source, prefix, experts, self.required_suffixes, self.suffixes, scheme)
        return self.shapes(source, prefix, experts[0], scheme)

    def shapes(self, source: Source, prefix: str, first: Expert, scheme: Scheme) -> tuple[int, int]:
        t, g = source.tensors, self.group_size
        ws, ss = self.weight_suffix, self.scale_suffix
        for r in ROLES:
            expect_dtype(source, first[r][ws], self.weight_dtypes)
            expect_dtype(source, first[r][ss], self.scale_dtypes)
        I, half_h = t[first["gate"][ws]].shape
        H = 2 * half_h
        for r, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            if k % g:
                raise MoeConvertError(f"input size is not a multiple of {self.name}'s group size", file=str(source.ident),
                                      tensor=first[r][ws], expected=f"a multiple of {g}", found=k)
            expect_shape(source, first[r][ws], (n, k // 2))
            expect_shape(source, first[r][ss], (n, k // g))
            for suffix in ("weight_global_scale", "input_global_scale"):
                if suffix in first[r]:
                    expect_dtype(source, first[r][suffix], ("F32",))
                    expect_shape(source, first[r][suffix], (1,))
        return H, I

    def decode(self, source: Source, layer, part: Partition, e0: int, e1: int) -> ExpertBlock:
        H, I, g = layer.hidden_size, layer.intermediate_size, self.group_size
        Ip, r = I // part.tp_size, part.tp_rank
        if Ip % g:
            raise MoeConvertError(f"a TP rank's share of I would split {self.name} scale groups", tensor=layer.prefix,
                                  expected=f"intermediate_size / tp_size a multiple of {g}", found=Ip)
        rows, packed_cols, scale_cols = (slice(r * Ip // d, (r + 1) * Ip // d) for d in (1, 2, g))
        parts: dict[str, list[torch.Tensor]] = {}
        for ex in layer.experts[e0:e1]:
            # int8 bytes (DeepSeek-V4) are the same bits: vLLM's loader copies them into its uint8 parameter
            w = {role: source.read(ex[role][self.weight_suffix]).view(torch.uint8) for role in ROLES}
            s = {role: self.scale(source, ex[role][self.scale_suffix]) for role in ROLES}
            got = {
                "w13": torch.cat([w["gate"][rows], w["up"][rows]]), "w2": w["down"][:, packed_cols],
                "w13_scale": torch.cat([s["gate"][rows], s["up"][rows]]), "w2_scale": s["down"][:, scale_cols],
            }
            got.update(self.global_scales(source, ex))
            for k, v in got.items():
                parts.setdefault(k, []).append(v)
        return ExpertBlock(scheme=layer.scheme, **{k: torch.stack(v).contiguous() for k, v in parts.items()})

    def scale(self, source: Source, name: str) -> torch.Tensor:
        raise NotImplementedError

    def global_scales(self, source: Source, ex: Expert) -> dict[str, torch.Tensor]:
        return {}


@register
class MXFP4PackQuantized(_FP4PackQuantized):
    name = "mxfp4-pack-quantized"
    title = "compressed-tensors mxfp4-pack-quantized"
    group_size, strategy = 32, "group"
    scale_dtypes = ("U8", "F8_E8M0")  # uint8 by default, float8_e8m0fnu when the config's scale_dtype says so
    suffixes = required_suffixes = frozenset({"weight_packed", "weight_scale"})

    def _input_problem(self, args: QuantArgs | None) -> str | None:
        if args is not None and args.type == "float" and args.num_bits == 8:
            # vLLM 0.33.0 serves MXFP4 weights with FP8 activations by another method (W4A8)
            return "MXFP4 weights with FP8 input activations (vLLM's W4A8 MXFP4 method) are not read"
        return None

    def scale(self, source: Source, name: str) -> torch.Tensor:
        b = source.read(name).view(torch.uint8)
        if bool((b == 255).any()):
            raise MoeConvertError("NaN MXFP4 scale (e8m0 byte 255)", file=source.info(name).file.name, tensor=name,
                                  expected="e8m0 bytes 0..254", found=f"{int((b == 255).sum())} NaN")
        return b


@register
class NVFP4PackQuantized(_FP4PackQuantized):
    name = "nvfp4-pack-quantized"
    title = "compressed-tensors nvfp4-pack-quantized"
    group_size, strategy = 16, "tensor_group"
    scale_dtypes = ("F8_E4M3",)
    required_suffixes = frozenset({"weight_packed", "weight_scale", "weight_global_scale"})
    suffixes = required_suffixes | {"input_global_scale"}

    def _input_problem(self, args: QuantArgs | None) -> str | None:
        # get_moe_method: "For NVFP4 weights, input quantization must also be NVFP4 format or None"
        if args is None:
            return None
        nvfp4 = (args.type, args.num_bits, args.strategy, args.group_size, args.symmetric) == \
            ("float", 4, "tensor_group", 16, True)
        return None if nvfp4 else "NVFP4 weights need NVFP4 input activations or none (vLLM refuses the others)"

    def scale(self, source: Source, name: str) -> torch.Tensor:
        s = source.read(name)
        nan = (s.view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            raise MoeConvertError("NaN NVFP4 scale", file=source.info(name).file.name, tensor=name,
                                  expected="finite e4m3 values", found=f"{int(nan.sum())} NaN")
        if bool((s.float() < 0).any()):
            # vLLM's Marlin path assumes non-negative scales and zeroes negative ones (it only warns)
            raise MoeConvertError("negative NVFP4 scale", file=source.info(name).file.name, tensor=name,
                                  expected="scales >= 0", found=f"{int((s.float() < 0).sum())} negative")
        return s

    def global_scales(self, source: Source, ex: Expert) -> dict[str, torch.Tensor]:
        """The dequantization multipliers: ``1 / weight_global_scale`` in fp32, the division vLLM makes
        (``CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading``)."""
        out = {}
        for role in ROLES:
            for suffix in ("weight_global_scale", "input_global_scale"):
                if suffix in ex[role]:
                    name = ex[role][suffix]
                    v = source.read(name)
                    if not (bool(torch.isfinite(v).all()) and bool((v > 0).all())):
                        raise MoeConvertError("NVFP4 global scale must be finite and positive",
                                              file=source.info(name).file.name, tensor=name,
                                              expected="a finite value > 0", found=float(v.flatten()[0]))
            out[role] = 1.0 / source.read(ex[role]["weight_global_scale"]).float()
        got = {"w13_global": torch.cat([out["gate"], out["up"]]), "w2_global": out["down"][0]}
        if all("input_global_scale" in ex[role] for role in ROLES):
            # W4A4: the activations' multipliers, ``1 / input_global_scale`` as vLLM divides them
            inp = {role: 1.0 / source.read(ex[role]["input_global_scale"]).float() for role in ROLES}
            got.update(w13_input_global=torch.cat([inp["gate"], inp["up"]]), w2_input_global=inp["down"][0])
        return got
