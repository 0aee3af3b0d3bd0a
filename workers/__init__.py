"""sprawl's processes: one module per worker, plus the `sprawl` command line."""
