"""Per-rank lesson programs: ``run(ctx, cfg) -> dict`` (and optionally ``validate(cfg, world_size)``)."""
