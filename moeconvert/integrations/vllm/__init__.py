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

#: why :func:`register` failed in this process (None: it did not, or has not run)
REGISTER_ERROR: str | None = None


def register() -> None:
    global REGISTER_ERROR
    try:
        from vllm.model_executor.layers.quantization import register_quantization_config

        from moeconvert.integrations.vllm.config import MoeconvertConfig

        register_quantization_config("moeconvert")(MoeconvertConfig)

        from vllm.model_executor.model_loader import register_model_loader

        from moeconvert.integrations.vllm.loader import MoeconvertModelLoader

        register_model_loader("moeconvert")(MoeconvertModelLoader)  # --load-format moeconvert
    except Exception as e:  # noqa: BLE001 - see the module docstring
        REGISTER_ERROR = f"{type(e).__name__}: {e}"
        _log.warning("moeconvert: the vLLM plugin could not register its quantization method: %s", e)


def registration_problem() -> str | None:
    """Why vLLM in this process would not serve a moeconvert folder, in one line, or None: vLLM finds its
    plugins by the ``vllm.general_plugins`` entry point of an installed distribution (a checkout on
    ``PYTHONPATH`` has none), and :func:`register` can fail (e.g. an install missing one of the packages).
    Call it after vLLM loaded its plugins (``vllm.plugins.load_general_plugins``)."""
    from importlib.metadata import entry_points

    if not any(ep.name == "moeconvert" for ep in entry_points(group="vllm.general_plugins")):
        return ("moeconvert is not installed where vLLM looks for plugins: no 'vllm.general_plugins' entry point "
                "named moeconvert (pip install moeconvert, or pip install -e . in a checkout)")
    if REGISTER_ERROR is not None:
        return f"moeconvert's vLLM plugin did not register: {REGISTER_ERROR}"
    return None
