"""gguf_io"""
