"""Quantization kernels: Triton (``quant_triton``) beside their torch references (``reference``).

Import ``toolkit.quant`` rather than these modules: it checks inputs and picks the implementation.
"""
