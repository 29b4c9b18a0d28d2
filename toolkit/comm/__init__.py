"""Communication techniques (one module per technique)."""
from . import quant_a2a  # lesson 04: int8/int4 all-to-all for MoE dispatch
