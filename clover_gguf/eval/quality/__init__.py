"""What quantization costs against the BF16 reference: the quality run (run), its metrics
(pure functions), held-out samples (corpus), block-logit providers (backends), per-group
sensitivity, and the tool-call eval (tools, tool_blocks, stability)."""
