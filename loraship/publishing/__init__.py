"""Where artifacts go and how they look: the Hugging Face Hub, plots."""
