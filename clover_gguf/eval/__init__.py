"""Evaluation of Clover GGUFs, by the question each part answers: quality/ (what quantization
costs against the BF16 reference), bench/ (speed, and `clover-gguf serve` under load), render/
(one report renderer per run kind). Here: commands (the `eval` CLI), baseline (the committed
baseline: quality, sensitivity and speed stages, one bundle), workfiles (conversions cached in a
work folder) and sysinfo (the environment every run records)."""
