"""The OpenAI-compatible HTTP app: GET /health, GET /v1/models, POST /v1/chat/completions and /v1/completions.

One engine, one sequence at a time: every generation runs on the Worker's single thread, in arrival order, from
a reset state (generate() resets the engine). Text reaches the async response through an asyncio.Queue. A client
that disconnects (or a stream that is dropped) sets its request's cancel flag, which generate() checks between
tokens, also while the request still waits in the queue.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.base import ContextOverflow, Engine
from ..engine.generate import Generation, check_request, generate
from ..model.tokenizer import Tokenizer, TokenizerError
from .errors import APIError, install_handlers, server_error
from .protocol import ChatRequest, CompletionRequest, Reply, parse, sse

log = logging.getLogger("lucegen.serve")
DISCONNECT_POLL_S = 0.05


class Worker:
    """Runs generations one at a time on one thread: the engine is never used by two requests at once."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lucegen-engine")

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int, request: ChatRequest | CompletionRequest,
               cancel: threading.Event) -> tuple[asyncio.Queue, asyncio.Future]:
        """Queue a generation; its text pieces arrive on the queue, then None once the future is done (and
        the outcome is logged)."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        job = partial(generate, self.engine, self.tokenizer, prompt_ids, max_tokens, request.sampling(),
                      request.stops(), ignore_eos=request.ignore_eos,
                      on_text=lambda text: loop.call_soon_threadsafe(pieces.put_nowait, text),
                      cancelled=cancel.is_set)
        future = loop.run_in_executor(self.executor, job)
        future.add_done_callback(lambda f: (pieces.put_nowait(None), report(request_id, f)))
        return pieces, future


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, api_key: str | None = None) -> FastAPI:
    worker = Worker(engine, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="lucegen", lifespan=lifespan)
    install_handlers(app)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name}

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "lucegen", "max_model_len": engine.max_context}]}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = parse(await request.body(), ChatRequest)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, **{"enable_thinking": False, **body.chat_template_kwargs})
        except TokenizerError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        return await complete(request, body, tokenizer.encode(text), Reply(True, model_name), "messages")

    @v1.post("/completions")
    async def completions(request: Request):
        body = parse(await request.body(), CompletionRequest)
        ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        return await complete(request, body, ids, Reply(False, model_name), "prompt")

    async def complete(request: Request, body: ChatRequest | CompletionRequest, prompt_ids: list[int],
                       reply: Reply, prompt_field: str):
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist: this server serves {model_name!r}",
                           param="model", code="model_not_found")
        try:
            max_tokens = check_request(engine, prompt_ids, body.limit())
        except ContextOverflow as e:
            param = prompt_field if len(prompt_ids) >= engine.max_context else "max_tokens"
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, f"{prompt_field}: {e}", param=prompt_field) from None
        cancel = threading.Event()
        watcher = asyncio.create_task(watch_disconnect(request, cancel))
        pieces, future = worker.submit(reply.id, prompt_ids, max_tokens, body, cancel)
        if body.stream:
            return StreamingResponse(events(reply, body, pieces, future, cancel, watcher),
                                     media_type="text/event-stream")
        try:
            result = await future
        except Exception as e:
            raise server_error(e) from None
        finally:  # also when this handler is cancelled
            cancel.set()
            watcher.cancel()
        return JSONResponse(reply.completion(result))

    async def events(reply: Reply, body: ChatRequest | CompletionRequest, pieces: asyncio.Queue,
                     future: asyncio.Future, cancel: threading.Event, watcher: asyncio.Task) -> AsyncIterator[str]:
        usage = body.include_usage
        try:
            if reply.chat:  # the role comes first, as OpenAI sends it
                yield sse(reply.chunk("", first=True, include_usage=usage))
            while (text := await pieces.get()) is not None:
                yield sse(reply.chunk(text, include_usage=usage))
            result = future.result()
            yield sse(reply.chunk(None, result.finish_reason, include_usage=usage))
            if usage:
                yield sse(reply.usage_chunk(result))
            yield sse("[DONE]")
        except Exception as e:  # the status line has gone out: the error travels as an event
            yield sse(server_error(e).body())
            yield sse("[DONE]")
        finally:  # also when the client went away and the response task was cancelled
            cancel.set()
            watcher.cancel()

    app.include_router(v1)
    return app


async def watch_disconnect(request: Request, cancel: threading.Event) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    cancel.set()


def report(request_id: str, future: asyncio.Future) -> None:
    if future.cancelled():  # the server shut down before the request's turn
        return
    if future.exception():
        log.error("%s failed", request_id, exc_info=future.exception())
        return
    result: Generation = future.result()
    log.info("%s: prompt %d tokens (%.1f tok/s), output %d tokens (%.1f tok/s), finish %s", request_id,
             result.prompt_tokens, result.prefill_tps, result.completion_tokens, result.decode_tps,
             result.finish_reason)
