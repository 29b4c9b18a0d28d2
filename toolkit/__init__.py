"""llm-scale-toolkit: the optimizations used to train LLMs across many accelerators, run for real."""
from .runtime.launch import LaunchError, LaunchTimeout, launch

__version__ = "0.1.0"
__all__ = ["launch", "LaunchError", "LaunchTimeout", "__version__"]
