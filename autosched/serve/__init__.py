"""Serving a generation artifact: the engine (:mod:`.engine`: one generator, any number of asyncio clients,
continuous batching and prefix caching), the OpenAI-compatible HTTP API over it (:mod:`.app`), its metrics
(:mod:`.metrics`), the tokenizer's side (:mod:`.tokenizer`) and the uvicorn server that drains on SIGTERM
(:mod:`.server`). The runtime half of the project: it imports the generation runtime, never the build."""

from .app import create_app
from .engine import BadRequest, Engine, EngineError, QueueFull, RequestOutput, RequestParams, Unavailable
from .metrics import ServerMetrics

__all__ = ["BadRequest", "Engine", "EngineError", "QueueFull", "RequestOutput", "RequestParams", "ServerMetrics",
           "Unavailable", "create_app"]
