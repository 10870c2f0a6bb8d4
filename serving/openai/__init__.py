"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, tokenize, health,
metrics."""

from serving.openai.app import attach_engine, create_app

__all__ = ["attach_engine", "create_app"]
