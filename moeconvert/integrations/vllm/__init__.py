"""The vLLM plugin: a quantization method that loads a moeconvert folder's MoE tensors as they are.

vLLM runs every ``vllm.general_plugins`` entry point in every process it starts; :func:`register`
adds the ``moeconvert`` quantization method, which a converted folder's config.json names, and the
``moeconvert`` load format (``--load-format moeconvert``: each rank reads only its experts' bytes). It must never
raise: an exception there would stop vLLM for every model, not only ours.
"""

from __future__ import annotations

import logging

#: the vLLM versions whose MoE layer internals (and model loaders) the plugin was checked against; a folder is
#: served on those of them its layout lists (``Layout.made_for["vllm"]``: its bytes checked against their processing)
SUPPORTED_VLLM = ("0.33.0", "0.34.0")

_log = logging.getLogger(__name__)


def register() -> None:
    try:
        from vllm.model_executor.layers.quantization import register_quantization_config

        from moeconvert.integrations.vllm.config import MoeconvertConfig

        register_quantization_config("moeconvert")(MoeconvertConfig)

        from vllm.model_executor.model_loader import register_model_loader

        from moeconvert.integrations.vllm.loader import MoeconvertModelLoader

        register_model_loader("moeconvert")(MoeconvertModelLoader)  # --load-format moeconvert
    except Exception as e:  # noqa: BLE001 - see the module docstring
        _log.warning("moeconvert: the vLLM plugin could not register its quantization method: %s", e)
