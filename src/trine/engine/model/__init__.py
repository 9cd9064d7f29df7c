"""The model: a Llama/Qwen transformer body, LoRA adapters, batch-invariant kernels, weights and tokenizer."""
