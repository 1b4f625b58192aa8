"""The GPU planner: which recipe and placement fit a GPU, how fast and at what quality cost
(`clover-gguf plan`, docs/plan.md). The planner's logic is in plan.planner; the package
re-exports the names the CLI and scripts use."""

from __future__ import annotations

from .planner import cpu_layers_regex, format_plan, make_plan
from .sizes import PlanError

__all__ = ["PlanError", "make_plan", "format_plan", "cpu_layers_regex"]
