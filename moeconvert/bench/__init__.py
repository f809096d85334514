"""``moeconvert bench ...``: how fast conversion (convert.py), loading (load.py) and the kernels (kernel.py,
against the engines' own, contenders.py) are. Never imported by the runtime (tests/test_structure.py)."""
