"""GET /openapi.json: an OpenAPI 3.1 document of the routes this server serves.

The paths and methods come from the app's own routes (Starlette's `BaseSchemaGenerator.get_endpoints`), so a
route is listed exactly when it is served; request bodies are the pydantic models the handlers validate with
(`pydantic.json_schema.models_json_schema`, JSON Schema 2020-12 as OpenAPI 3.1 takes it), errors OpenAI's
error object. Built once per app, off the event loop.
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema
from starlette.schemas import BaseSchemaGenerator

from .messages_protocol import CountTokensRequest, MessagesRequest
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses_protocol import ResponsesRequest

# path -> (summary, request model or None, what a 200 carries)
JSON, SSE = "application/json", "text/event-stream"
OPERATIONS = {
    "/v1/chat/completions": ("Create a chat completion (OpenAI)", ChatCompletionRequest, (JSON, SSE)),
    "/v1/completions": ("Create a completion from a raw prompt (OpenAI)", CompletionRequest, (JSON, SSE)),
    "/v1/responses": ("Create a response (OpenAI Responses API, stateless)", ResponsesRequest, (JSON, SSE)),
    "/v1/messages": ("Create a message (Anthropic Messages API)", MessagesRequest, (JSON, SSE)),
    "/v1/messages/count_tokens": ("Count a message request's prompt tokens (Anthropic)", CountTokensRequest,
                                  (JSON,)),
    "/tokenize": ("Tokenize a prompt or a chat request (vLLM)", TokenizeRequest, (JSON,)),
    "/detokenize": ("Token ids to text (vLLM)", DetokenizeRequest, (JSON,)),
    "/v1/models": ("List the served model names", None, (JSON,)),
    "/v1/models/{model}": ("Retrieve one served model name", None, (JSON,)),
    "/health": ("Readiness and counters (503 unless ready)", None, (JSON,)),
    "/ping": ("Liveness (vLLM's): 200 when ready, else 503", None, ()),
    "/metrics": ("Prometheus metrics", None, ("text/plain",)),
    "/version": ("The server's version", None, (JSON,)),
    "/openapi.json": ("This document", None, (JSON,)),
}
# the same operation under another spelling of its path
ALIASES = {"/chat/completions": "/v1/chat/completions", "/completions": "/v1/completions",
           "/responses": "/v1/responses", "/v1/tokenize": "/tokenize", "/v1/detokenize": "/detokenize",
           "/models": "/v1/models", "/v1/health": "/health"}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


OPEN = {"/health", "/v1/health", "/ping", "/metrics", "/version", "/openapi.json"}  # no key needed


def _operation(path: str, method: str, schemas: dict) -> dict:
    summary, model, media = OPERATIONS.get(ALIASES.get(path, path), (f"{method.upper()} {path}", None, (JSON,)))
    operation = {
        "summary": summary,
        "operationId": (method + path).replace("/", "_").replace(".", "_").replace("{", "").replace("}", ""),
        "responses": {"200": {"description": "success", "content": {m: {} for m in media}} if media
                      else {"description": "success"},
                      "default": {"description": "an error", "content": {JSON: {"schema": {
                          "$ref": "#/components/schemas/Error"}}}}},
    }
    if model is not None:
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": schemas[model.__name__]}}}
    if path in OPEN:
        operation["security"] = []
    if "{model}" in path:
        operation["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    return operation


def openapi_document(routes, version: str, title: str, *, auth: bool) -> dict:
    """The document for these routes; `auth`: the API needs a bearer key (--api-key-file)."""
    models = {m for summary, m, media in OPERATIONS.values() if m is not None}
    refs, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                    ref_template="#/components/schemas/{model}")
    schemas = {model.__name__: ref for (model, _), ref in refs.items()}
    paths: dict[str, dict] = {}
    for endpoint in BaseSchemaGenerator().get_endpoints(routes):
        paths.setdefault(endpoint.path, {})[endpoint.http_method] = _operation(endpoint.path, endpoint.http_method,
                                                                               schemas)
    document = {"openapi": "3.1.0", "info": {"title": title, "version": version},
                "paths": dict(sorted(paths.items())),
                "components": {"schemas": {**defs.get("$defs", {}), "Error": ERROR}}}
    if auth:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document
