"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("lucegen.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def server_error(e: BaseException) -> APIError:
    """A failure inside the server (logged with its traceback by the caller)."""
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")


def install_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown route, wrong method
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").response()

    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
