"""clover-gguf: Clover (block-diffusion MoE) from safetensors to quantized GGUF for llama.cpp."""

__version__ = "0.1.0"
