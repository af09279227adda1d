"""Endpoints and flags users reach for when they switch from vLLM: GET /v1/models/{id}, several
--served-model-name values, --version, CORS, --root-path, TLS."""
from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import octavo
from tests.server.conftest import ServerProcess, stop_all, wait_all_healthy


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory) -> dict[str, ServerProcess]:
    """The module's two servers, started side by side (each start is seconds of imports and loading).
    named: several served names, --max-logprobs. edge: HTTPS, behind a proxy prefix, one browser origin
    allowed, an API key, no access log."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = _self_signed(folder)
    started = wait_all_healthy([
        ServerProcess(model_path, folder / "named.log", "--num-blocks", "64", "--served-model-name", "org/main-name",
                      "alias", "--max-logprobs", "30", api_key=None, wait=False),
        ServerProcess(model_path, folder / "edge.log", "--num-blocks", "64", "--served-model-name", "tiny",
                      "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/api",
                      "--allowed-origins", '["https://ui.example"]', "--disable-log-requests", "--log-level", "info",
                      tls=ssl.create_default_context(cafile=str(cert)), wait=False),
    ])
    yield dict(zip(("named", "edge"), started))
    stop_all(started)


@pytest.fixture
def named_server(servers) -> ServerProcess:
    return servers["named"]


@pytest.fixture
def edge_server(servers) -> ServerProcess:
    return servers["edge"]


def test_retrieve_a_model_and_several_names(named_server):
    client = named_server.openai()
    assert [m.id for m in client.models.list().data] == ["org/main-name", "alias"]
    m = client.models.retrieve("org/main-name")
    assert m.id == "org/main-name" and m.object == "model" and m.owned_by == "octavo"
    assert client.models.retrieve("alias").id == "alias"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("other")
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    # Requests may name the model by any of its names; responses carry the first.
    for name in ("org/main-name", "alias"):
        r = client.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert r.model == "org/main-name"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=1)


def test_max_logprobs(named_server, server):
    messages = [{"role": "user", "content": "hi"}]
    r = named_server.openai().chat.completions.create(model="alias", messages=messages, max_tokens=1, logprobs=True,
                                                      top_logprobs=25)
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 25
    with pytest.raises(openai.BadRequestError) as exc:  # the default, vLLM's: 20
        server.openai().chat.completions.create(model="tiny", messages=messages, max_tokens=1, logprobs=True,
                                                top_logprobs=21)
    assert exc.value.body["param"] == "top_logprobs" and "--max-logprobs" in exc.value.body["message"]
    with server.http() as http:
        err = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "prompt_logprobs": 21}).json()["error"]
    assert err["param"] == "prompt_logprobs"


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = folder / "key.pem", folder / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def test_https_root_path_cors(edge_server):
    srv = edge_server
    # TLS: the openai client talks to it through the trusted certificate.
    assert srv.openai().completions.create(model="tiny", prompt="Hi", max_tokens=1).model == "tiny"
    with srv.http() as http:
        # The proxy strips /api (uvicorn's root_path, as vLLM uses it); links the app makes carry it.
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.get("/openapi.json").json()["servers"] == [{"url": "/api"}]
        # Public routes stay public and private ones private.
        assert httpx.get(f"{srv.url}/health", verify=srv.tls).status_code == 200
        assert httpx.get(f"{srv.url}/v1/models", verify=srv.tls).status_code == 401
        # CORS: a browser preflight (no API key) from the allowed origin, and one from another origin.
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = httpx.options(f"{srv.url}/v1/completions", verify=srv.tls, headers={"Origin": "https://ui.example", **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
        bad = httpx.options(f"{srv.url}/v1/completions", verify=srv.tls, headers={"Origin": "https://evil.example", **preflight})
        assert "access-control-allow-origin" not in bad.headers
        r = http.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
    with pytest.raises(httpx.TransportError):  # plain HTTP is not served
        httpx.get(srv.url.replace("https", "http") + "/health", timeout=5)
    # --disable-log-requests: no access-log line per request (the server does log at info).
    log = srv.log()
    assert "Uvicorn running on https://" in log and "GET /v1/models" not in log and "POST /v1/completions" not in log


def test_version_flag(capsys):
    from octavo.entrypoints.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"octavo {octavo.__version__}"
