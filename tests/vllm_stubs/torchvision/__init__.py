"""An import-only stand-in for torchvision, put on the vLLM child's path where torchvision is absent.

vLLM 0.33.0's Qwen3.5 model module (vllm/model_executor/models/qwen3_5.py) imports its Qwen3-VL module,
which imports transformers' Qwen2-VL image processor, which imports torchvision at module level. vLLM
requires torchvision (its wheel pins it), but the CPU test environment has no build of it matching its
CPU torch (PyPI's is a CUDA build). Without it vLLM cannot inspect its own Qwen3.5-MoE classes and a
Qwen3.5-MoE config never reaches them. The text model never calls torchvision: every name here is a
placeholder, and calling one raises.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Meta(type):
    def __getattr__(cls, name):
        return cls

    def __call__(cls, *args, **kwargs):
        raise RuntimeError("torchvision is not installed: this is an import-only stand-in (tests/vllm_stubs)")


class _Absent(metaclass=_Meta):
    pass


def _getattr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Absent


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``torchvision.*`` module, empty but for placeholders."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _getattr
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
__getattr__ = _getattr
__version__ = "0.0.0+stand-in"
