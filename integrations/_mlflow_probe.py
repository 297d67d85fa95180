"""Whether an MLflow tracking server accepts connections, asked before each request to it: by the
:class:`~tensorlens.integrations.mlflow.MLflowBackend` and by a sync opening or ending a run
(:mod:`tensorlens.integrations._mlflow_replay`)."""

from __future__ import annotations

import socket
import urllib.parse
import urllib.request

#: a TCP connect to a live server takes far less; a dead host's connect would otherwise take minutes
PROBE_TIMEOUT_S = 5.0


def probe(uri: str | None, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise ``ConnectionError`` when an ``http(s)`` tracking server does not accept connections.

    MLflow retries a refused connection with exponential backoff for about four minutes per call
    (``MLFLOW_HTTP_REQUEST_MAX_RETRIES=7``); one TCP connect tells a server that is down apart
    within ``timeout`` seconds, so a dead tracker costs training nothing and close() next to
    nothing (a server that dies during a request is bounded by the dispatcher's stall timeout).
    Skipped for other URIs and when a proxy is configured for the host (the proxy decides then).
    """
    if not uri:
        return
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    if urllib.request.getproxies().get(parsed.scheme) and not urllib.request.proxy_bypass(parsed.hostname):
        return
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            pass
    except (OSError, ValueError) as err:  # ValueError: a port out of range in the URI
        raise ConnectionError(f"the MLflow tracking server at {uri} is unreachable: {err}") from err
