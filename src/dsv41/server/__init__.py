"""The OpenAI-compatible HTTP server (hypercorn + Starlette) in front of the engine. See docs/SERVER.md."""
