"""The HTTP side: a pure ASGI middleware, innermost in vLLM's app (behind its API-key check), that validates a
completion or chat request's ``interp`` object (400 naming the key; the engine never sees a bad one), hands the
compiled interventions to the engine hook and adds the results to the response; and the ``/v1/interp/vectors``
routes."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from interp_runner.config.errors import ConfigError
from interp_runner.serve.compile import Served, capture_bytes, compile_interp, result_json
from interp_runner.serve.engine_hook import CURRENT, Call, InterpEngine
from interp_runner.serve.named import NamedVectors, read_upload
from interp_runner.serve.settings import ServeSettings, validate_interp

GENERATING = ("/v1/completions", "/v1/chat/completions")
DONE_EVENT = b"data: [DONE]"


@dataclass
class ServeState:
    settings: ServeSettings
    served: Served
    tokenizer: object  # ``tokens.TextTokenizer`` (answers' ids)
    named: NamedVectors
    engine: InterpEngine
    global_steer: list
    global_vectors: dict


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLarge"}
    return json.dumps({"error": {"message": message, "type": kind.get(status, "Error"), "param": param,
                                 "code": status}}).encode()


def config_error_response(err: ConfigError, prefix: str = "") -> tuple[int, bytes]:
    path, reason = err.problems[0]
    path = f"{prefix}{path}" if prefix and path else path
    message = "; ".join(f"{prefix}{p}: {r}" if prefix else f"{p}: {r}" for p, r in err.problems)
    return 400, error_body(400, message, path)


async def read_body(receive, limit: int) -> bytes | None:
    """The request's body, or None if it is longer than ``limit`` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        if not message.get("more_body"):  # an oversized body is read to its end (not kept): the client hears 413
            return b"".join(chunks) if size <= limit else None


async def respond(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def replay(body: bytes, receive):
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # a disconnect, as the server reports it

    return again


class InterpMiddleware:
    def __init__(self, app, state: ServeState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATING:
            return await self.app(scope, receive, send)
        state = self.state
        body = await read_body(receive, state.settings.max_body_bytes)
        if body is None:
            return await respond(send, 413, error_body(413, f"request body over {state.settings.max_body_bytes} "
                                                            "bytes (serve.max_body_bytes)"))
        try:
            request = json.loads(body)
        except ValueError:
            request = None  # vLLM answers malformed JSON itself
        if not isinstance(request, dict) or ("interp" not in request and not state.global_steer):
            return await self.app(scope, replay(body, receive), send)
        try:
            call = self._call(request)
        except ConfigError as err:
            return await respond(send, *config_error_response(err))
        if "interp" in request:
            del request["interp"]
            body = json.dumps(request).encode()
        token = CURRENT.set(call)
        try:
            await self.app(scope, replay(body, receive), self._sender(send, call))
        finally:
            CURRENT.reset(token)

    def _call(self, request: dict) -> Call:
        state = self.state
        spec = None
        if "interp" in request:
            spec = validate_interp(request["interp"])
            if request.get("n", 1) != 1 or request.get("best_of") not in (None, 1) or request.get("use_beam_search"):
                raise ConfigError.at("interp", "a request with an interp object generates one sequence (n = 1)")
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                if len(prompt) != 1:
                    raise ConfigError.at("interp", "a request with an interp object takes one prompt")
        compiled = compile_interp(spec, state.served, state.named.vectors, state.tokenizer, state.global_steer,
                                  state.global_vectors)
        max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
        size = capture_bytes(compiled, state.served.facts, max_tokens if isinstance(max_tokens, int) else None)
        if size is None:
            raise ConfigError.at("interp.capture.positions", "all_generated needs max_tokens in the request")
        if size > state.settings.max_capture_bytes:
            raise ConfigError.at("interp.capture", f"would return {size} bytes, over the server's "
                                                   f"{state.settings.max_capture_bytes} (serve.max_capture_bytes)")
        return Call(compiled)

    @staticmethod
    def _sender(send, call: Call):
        """``send`` with the ``interp`` results added: to a JSON response's object, or as a last event (no choices)
        before a stream's ``[DONE]``."""
        if not call.compiled.reported:
            return send
        start: dict | None = None
        streaming = False
        buffered: list[bytes] = []
        head: dict | None = None  # a stream's first event: its id, model, ...

        async def wrapped(message):
            nonlocal start, streaming, head
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                if streaming or message["status"] != 200:
                    call.compiled.reported = message["status"] == 200
                    return await send(message)
                start = message  # sent with the body, whose length changes
                return None
            if message["type"] != "http.response.body" or not call.compiled.reported:
                return await send(message)
            chunk = message.get("body", b"")
            if streaming:
                if head is None and chunk.startswith(b"data: {"):
                    head = json.loads(chunk[6:].split(b"\n\n")[0])
                at = chunk.find(DONE_EVENT)
                if at >= 0 and call.result is not None:
                    event = {k: head.get(k) for k in ("id", "object", "created", "model")} if head else {}
                    event.update(choices=[], interp=result_json(call.compiled, call.result))
                    chunk = chunk[:at] + b"data: " + json.dumps(event).encode() + b"\n\n" + chunk[at:]
                return await send({**message, "body": chunk})
            buffered.append(chunk)
            if message.get("more_body"):
                return None
            body = b"".join(buffered)
            try:
                obj = json.loads(body)
                if call.result is not None and isinstance(obj, dict):
                    obj["interp"] = result_json(call.compiled, call.result)
                    body = json.dumps(obj).encode()
            except ValueError:
                pass
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return wrapped


def vector_routes(state: ServeState) -> APIRouter:
    router = APIRouter()
    limit = state.settings.max_upload_bytes

    @router.post("/v1/interp/vectors")
    async def register_vector(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return JSONResponse(json.loads(error_body(413, f"upload over {limit} bytes (serve.max_upload_bytes)")),
                                status_code=413)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return JSONResponse(json.loads(error_body(413, f"upload over {limit} bytes "
                                                               "(serve.max_upload_bytes)")), status_code=413)
        try:
            data = json.loads(body)
        except ValueError as err:
            return JSONResponse(json.loads(error_body(400, f"malformed JSON: {err}")), status_code=400)
        try:
            upload, vec = await asyncio.to_thread(read_upload, data, state.served.facts.hidden_size,
                                                  state.settings.vector_dirs, state.settings.max_inline_values)
            from interp_runner.payload import vector_key

            await state.engine.register({vector_key(vec): vec})  # on the workers before its first request
            replaced = state.named.add(upload.name, vec, upload.replace)
        except ConfigError as err:
            status, body = config_error_response(err)
            if err.problems[0][0] == "replace":
                status = 409
            return JSONResponse(json.loads(body), status_code=status)
        listing = next(v for v in state.named.listing() if v["name"] == upload.name)
        return JSONResponse({**listing, "replaced": replaced}, status_code=200 if replaced else 201)

    @router.get("/v1/interp/vectors")
    async def list_vectors():
        return {"object": "list", "data": state.named.listing()}

    @router.delete("/v1/interp/vectors/{name}")
    async def delete_vector(name: str):
        if not state.named.remove(name):
            return JSONResponse(json.loads(error_body(404, f"no vector named {name!r}", "name")), status_code=404)
        return {"name": name, "deleted": True}

    return router
