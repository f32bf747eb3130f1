"""Search: cost models, tuner and database (issue 4; not built yet)."""
