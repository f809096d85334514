"""moeconvert: convert Mixture-of-Experts checkpoints once, offline, into the layouts serving kernels read."""

__version__ = "0.1.0"

#: Version of the output format (the layout of ``moeconvert.json`` and the tensor naming contract).
FORMAT_VERSION = 2
