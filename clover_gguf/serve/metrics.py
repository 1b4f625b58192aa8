"""GET /metrics: the server's counters as Prometheus text (format 0.0.4), under llama-server's
metric names where they mean the same thing (`llamacpp:*`) and Clover's own (`clover:*`) for
what only a block-diffusion server has: denoising steps, tokens per step, snapshots."""

from __future__ import annotations

# (name, type, help, value from Engine.stats() | the HTTP side's counters)
METRICS = [
    ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens processed, excluding those restored from a snapshot",
     lambda s: s["prefill_tokens"]),
    ("llamacpp:prompt_tokens_cached_total", "counter", "Prompt tokens restored from a snapshot",
     lambda s: s["reused_tokens"]),
    ("llamacpp:prompt_seconds_total", "counter", "Seconds spent restoring and committing prompts",
     lambda s: s["prompt_seconds"]),
    ("llamacpp:tokens_predicted_total", "counter", "Tokens generated and returned (up to an end token or stop string)",
     lambda s: s["completion_tokens"]),
    ("llamacpp:tokens_predicted_seconds_total", "counter", "Seconds spent generating",
     lambda s: s["generation_seconds"]),
    ("llamacpp:n_decode_total", "counter", "Denoising graphs computed (one per step, for every sequence in it)",
     lambda s: s["denoise_graphs"]),
    ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s",
     lambda s: _ratio(s["prefill_tokens"], s["prompt_seconds"])),
    ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s",
     lambda s: _ratio(s["completion_tokens"], s["generation_seconds"])),
    ("llamacpp:requests_processing", "gauge", "Requests decoding now", lambda s: s["processing"]),
    ("llamacpp:requests_deferred", "gauge", "Requests waiting for a free sequence", lambda s: s["queued"]),
    ("llamacpp:n_busy_slots_per_decode", "gauge", "Average sequences per denoising graph",
     lambda s: _ratio(s["sequence_steps"], s["denoise_graphs"])),
    ("clover:requests_total", "counter", "Requests the worker started", lambda s: s["requests"]),
    ("clover:requests_cancelled_total", "counter", "Requests stopped because their client went away",
     lambda s: s["cancelled"]),
    ("clover:requests_errors_total", "counter", "Requests that failed inside the engine", lambda s: s["errors"]),
    ("clover:requests_queue_timeout_total", "counter", "Requests refused (503) after waiting --queue-timeout",
     lambda s: s["queue_timeouts"]),
    ("clover:server_errors_total", "counter", "HTTP 500 answers: faults of the server, never of a request",
     lambda s: s["server_errors"]),
    ("clover:denoise_steps_total", "counter", "Denoising steps, summed over sequences", lambda s: s["sequence_steps"]),
    ("clover:positions_denoised_total", "counter", "Block positions generated (a last block may run past the end)",
     lambda s: s["generated_tokens"]),
    ("clover:tokens_per_step", "gauge", "Block positions unmasked per denoising step, on average",
     lambda s: _ratio(s["generated_tokens"], s["sequence_steps"])),
    ("clover:history_tokens_total", "counter", "Tokens committed for the snapshot of a conversation's next turn",
     lambda s: s["history_tokens"]),
    ("clover:largest_group", "gauge", "The most requests decoded at once", lambda s: s["largest_group"]),
    ("clover:snapshot_hits_total", "counter", "Prompts that restored a snapshot", lambda s: s["cache"]["hits"]),
    ("clover:snapshot_misses_total", "counter", "Prompts that found no snapshot", lambda s: s["cache"]["misses"]),
    ("clover:snapshots", "gauge", "Memory snapshots kept", lambda s: s["cache"]["snapshots"]),
    ("clover:snapshot_bytes", "gauge", "Bytes of the snapshots kept", lambda s: s["cache"]["bytes"]),
]  # fmt: skip


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def prometheus_text(stats: dict) -> str:
    out = []
    for name, kind, help_, value in METRICS:
        v = value(stats)
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {v if isinstance(v, int) else float(v)!r}"]
    return "\n".join(out) + "\n"
