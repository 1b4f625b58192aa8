"""Evaluation of Clover GGUFs: quality against the BF16 reference, speed, per-group
sensitivity, reports. Modules: metrics (pure functions), corpus (samples), backends (logit
providers), quality, speed, sensitivity, report, baseline, commands (CLI)."""
