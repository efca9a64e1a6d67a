"""The /metrics server of `kiln serve`: HTTPS with the server's certificate, the bearer token
when asked, a handshake that never completes holding only its own connection, and a busy
port refused with a message."""
from __future__ import annotations

import socket
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest

from kiln.runtime.server.errors import ServeError
from kiln.runtime.server.metrics import Metrics

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def cert_and_key(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"),
                    "-subj", "/CN=localhost"], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def scrape(url: str, token: str | None = None, ca=None) -> str:
    context = None
    if ca is not None:
        context = ssl.create_default_context(cafile=str(ca))
        context.check_hostname = False     # the certificate names localhost, not the IP
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    return urllib.request.urlopen(req, timeout=10, context=context).read().decode()


def test_https_with_a_token_and_a_client_that_never_says_hello(cert_and_key):
    cert, key = cert_and_key
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = Metrics().bind("127.0.0.1", 0, "tok", tls)
    server.start()
    port = server.server_address[1]
    silent = socket.create_connection(("127.0.0.1", port))   # connects, sends nothing
    try:
        url = f"https://127.0.0.1:{port}/metrics"
        assert "kiln_requests_in_flight" in scrape(url, "tok", cert)
        with pytest.raises(urllib.error.HTTPError) as e:
            scrape(url, "wrong", cert)
        assert e.value.code == 401
        with pytest.raises(OSError):       # plain HTTP gets no answer
            scrape(f"http://127.0.0.1:{port}/metrics", "tok")
    finally:
        silent.close()
        server.close()


def test_a_busy_port_is_a_serve_error_and_an_unstarted_server_closes():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{port} for metrics"):
            Metrics().bind("127.0.0.1", port)
    server = Metrics().bind("127.0.0.1", 0)
    server.close()                          # never started: returns, and frees the port
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(server.server_address)
