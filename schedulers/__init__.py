"""Slicers, schedules and their analyses (imports only smg)."""
