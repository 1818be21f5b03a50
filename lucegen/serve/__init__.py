"""`lucegen run` and the OpenAI-compatible `lucegen serve`.

cli       register(subparsers): the run and serve subcommands
app       create_app(engine, tokenizer, model_name, api_key): the FastAPI app and its one-thread worker
protocol  request validation and response bodies (OpenAI's shapes)
errors    APIError and the handlers that give every error OpenAI's shape
"""
from .cli import register

__all__ = ["register"]
