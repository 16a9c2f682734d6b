"""fedpipe: federated split-learning pipelines for LLMs on edge devices."""

__version__ = "0.1.0"
__all__ = ["__version__"]
