"""Every refusal ``nb serve`` sends, in OpenAI's error shape, with a status code a client can act on.

400 for a request that can never be served (bad fields, too long for ``max_model_len``, no
tokenizer or chat template), 404 for another model's name, 429 when the server already holds its
limit of open requests, 500 for a request whose step failed (the others go on), 503 once the
engine has stopped. "Busy" and "no such model" are said by one helper each, whichever route or
stage finds them, so every endpoint says them the same way.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from neuron_buckets.engine.lora_pool import UnknownAdapter
from neuron_buckets.utils.errors import UserError


class ErrorBody(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


class ServerBusy(UserError):
    """More requests are open than the server's bound; the client should retry later (HTTP 429)."""


class EngineDead(RuntimeError):
    """The engine loop stopped after an error; nothing more can be served (HTTP 503)."""


class StepFailed(RuntimeError):
    """The step that ran this request raised; the request is aborted, the loop goes on (HTTP 500)."""


class UnknownModel(UserError):
    """The request names another model than the one this server serves (HTTP 404)."""


def server_busy(limit: int) -> ServerBusy:
    """The 429 of a server that holds ``limit`` open requests already."""
    return ServerBusy(f"the server holds its limit of {limit} open requests; retry later")


def check_model(requested: str | None, served: str) -> None:
    """A 404 for a request that names another model than the one served (none named: this one)."""
    if requested is not None and requested != served:
        raise UnknownModel(f"the model {requested!r} does not exist; this server serves {served!r}")


# The status of each error a route may raise; the first type that matches wins.
STATUS: dict[type[Exception], int] = {
    UnknownAdapter: 404, ServerBusy: 429, UnknownModel: 404, EngineDead: 503, StepFailed: 500, UserError: 400,
    ValueError: 400, Exception: 500,
}


def error_response(status: int, message: str) -> JSONResponse:
    kind = HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    """pydantic's errors as one line: 'temperature: Input should be a valid number; ...'."""
    parts = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"] if p != "body")
        message = e["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


async def on_error(_: Request, e: Exception) -> JSONResponse:
    """Every refusal in OpenAI's error shape."""
    if isinstance(e, HTTPException):
        return error_response(e.status_code, str(e.detail))
    if isinstance(e, RequestValidationError):
        return error_response(400, validation_message(e))
    return error_response(next(s for t, s in STATUS.items() if isinstance(e, t)), str(e))
