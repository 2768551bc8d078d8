"""Fetching weights from the Hugging Face Hub (`dsv41 download`, through huggingface_hub)."""
