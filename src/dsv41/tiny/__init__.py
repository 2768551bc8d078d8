"""The built-in tiny model: a small DeepSeek-V4.1 with every layer role of the real one, in the real formats."""
