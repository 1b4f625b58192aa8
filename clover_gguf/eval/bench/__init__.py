"""How fast: the runtime's speed against the PyTorch reference (speed), Clover's passes against
upstream llama.cpp's (passes, with upstream's Qwen3-MoE twin), and `clover-gguf serve` under
concurrent clients (throughput) and an agent loop (agent)."""

from ...errors import CloverError


class BenchError(CloverError, RuntimeError):
    """A benchmark could not measure: a worker, server or llama.cpp call failed (one line)."""
