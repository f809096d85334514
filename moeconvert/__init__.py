"""moeconvert: convert Mixture-of-Experts checkpoints once, offline, into the layouts serving kernels read."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``moeconvert.FORMAT_VERSION`` lives with the format (moeconvert.format); read lazily, so that
    # ``import moeconvert`` stays free of torch and the layouts
    if name == "FORMAT_VERSION":
        from moeconvert.format import FORMAT_VERSION

        return FORMAT_VERSION
    raise AttributeError(f"module 'moeconvert' has no attribute {name!r}")
