"""Structured output: xgrammar grammars for JSON schemas and forced DSML tool calls (they speak the chat vocabulary)."""
