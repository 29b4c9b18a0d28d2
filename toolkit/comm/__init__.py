"""Communication techniques, one module per technique (import them by name, e.g. ``toolkit.comm.quant_a2a``)."""
