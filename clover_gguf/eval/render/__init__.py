"""Eval reports: one renderer per run kind (quality, sensitivity, speed, passes, tools, agent,
throughput), report.py's `render` dispatching a run JSON to its renderer, and helpers.py (what
every report shares)."""
