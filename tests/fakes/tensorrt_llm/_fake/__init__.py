"""Private machinery of the TensorRT-LLM contract fake (not part of the real API)."""
