"""The small routes clients and probes look for, on the real server: `GET /v1/models/{model}` (the official
client's `models.retrieve`), vLLM's `GET /ping`, and `GET /openapi.json` (an OpenAPI 3.1 document whose paths are
exactly the routes served, with valid JSON schemas for the request bodies)."""

from __future__ import annotations

import httpx
import jsonschema
import openai
import pytest

from server_harness import ALIAS, SERVED_NAME, client, server  # noqa: F401 (pytest fixtures)


def test_models_retrieve(client):  # noqa: F811
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    for name in (SERVED_NAME, ALIAS):
        model = client.models.retrieve(name)
        assert model.id == name and model.object == "model"
        assert model.model_dump() == listed[name]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert set(info.value.body) == {"message", "type", "param", "code"}


def test_model_route_needs_the_key(server):  # noqa: F811
    r = httpx.get(f"{server.url}/v1/models/{SERVED_NAME}", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_ping(server):  # noqa: F811
    r = httpx.get(f"{server.url}/ping", timeout=30)  # a probe: no key
    assert r.status_code == 200 and r.content == b""
    assert httpx.post(f"{server.url}/ping", timeout=30).status_code == 405


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_openapi_document(server):  # noqa: F811
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] == "dsv41" and doc["info"]["version"]
    paths = doc["paths"]
    for path, method in [("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/responses", "post"),
                         ("/v1/messages", "post"), ("/v1/models", "get"), ("/v1/models/{model}", "get"),
                         ("/health", "get"), ("/ping", "get"), ("/metrics", "get"), ("/openapi.json", "get"),
                         ("/tokenize", "post"), ("/version", "get")]:
        assert method in paths[path], (path, method)
    schemas = doc["components"]["schemas"]
    for name, schema in schemas.items():
        jsonschema.Draft202012Validator.check_schema(schema)
    for ref in _refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    body = paths["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "input" in schemas[body["$ref"].rsplit("/", 1)[1]]["properties"]
    assert doc["security"] == [{"bearer": []}] and paths["/health"]["get"]["security"] == []
    ids = [op["operationId"] for item in paths.values() for op in item.values()]
    assert len(ids) == len(set(ids))
    # every path listed is served: none answers 404 (a body-less POST is refused, not missing)
    with server.http() as http:
        for path, item in paths.items():
            url = path.replace("{model}", SERVED_NAME)
            for method in item:
                answer = http.request(method.upper(), url, json={} if method == "post" else None)
                assert answer.status_code not in (404, 405), (method, path, answer.status_code)
        assert http.get("/v1/no-such-route").status_code == 404
