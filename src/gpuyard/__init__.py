"""gpuyard: a GPU backend for AI."""

__version__ = "0.1.0"
