"""loraship: one resumable pipeline from base model + data to a proven GGUF."""

__version__ = "0.1.0"
