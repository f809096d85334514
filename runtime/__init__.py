"""moeconvert's runtime: a converted folder -> MoE layers on the device (docs/runtime.md).

```python
from moeconvert.runtime import load
model = load("out/", device="cuda")
layer = model.moe_layers["model.layers.3.mlp.experts"]
w, ids = layer.route(layer.router_logits(x))
y = layer(x, w, ids)            # layer.kernel says what runs
```

Kernels of other distributions: ``register_kernel(Kernel(name, unavailable, run))``, or the
``moeconvert.kernels`` entry-point group (docs/runtime.md, "Adding a runtime kernel").
"""

from moeconvert.runtime.dispatch import Kernel, KernelFallbackWarning, register_kernel
from moeconvert.runtime.layer import MoELayer
from moeconvert.runtime.model import MoEModel, load

__all__ = ["load", "MoEModel", "MoELayer", "KernelFallbackWarning", "Kernel", "register_kernel"]
