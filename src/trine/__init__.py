"""trine: a self-hosted engine for LLM post-training (the PyTRIO API)."""
__version__ = "0.1.0"
