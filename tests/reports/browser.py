"""A headless Chromium driven over the DevTools protocol (websocket-client), for the page tests.

Collects console messages, exceptions and every network request of a page, evaluates scripts
(awaiting promises) and takes screenshots. Chromium runs with its own temporary profile, no
background networking, listening on 127.0.0.1 only, and is killed (its process group) on close.

    with Browser() as browser:
        page = browser.open("file:///abs/report.html")
        page.evaluate("window.tensorlens.renderVisible()")
        png = page.screenshot()
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

import pytest

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    explicit = os.environ.get("TENSORLENS_CHROMIUM")
    if explicit:
        return explicit
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Page:
    """One tab: a websocket to its DevTools target."""

    def __init__(self, ws_url: str) -> None:
        import websocket

        self._ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self._id = 0
        self.console: list[dict[str, Any]] = []
        self.exceptions: list[dict[str, Any]] = []
        self.requests: list[str] = []
        self.failed: list[dict[str, Any]] = []
        self.dialogs: list[str] = []
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.call(f"{domain}.enable")
        # enabling replays what the tab's previous page logged: not this page's
        self.console.clear()
        self.exceptions.clear()
        self.requests.clear()
        self.failed.clear()

    def _handle(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        params = message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append({"type": params.get("type"), "text": text})
        elif method == "Runtime.exceptionThrown":
            self.exceptions.append(params.get("exceptionDetails", {}))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.console.append({"type": entry.get("level"), "text": entry.get("text"), "source": entry.get("source")})
        elif method == "Network.requestWillBeSent":
            self.requests.append(params.get("request", {}).get("url", ""))
        elif method == "Network.loadingFailed":
            self.failed.append(params)
        elif method == "Page.javascriptDialogOpening":
            self.dialogs.append(params.get("message", ""))
            self._send("Page.handleJavaScriptDialog", {"accept": True})

    def _send(self, method: str, params: dict[str, Any] | None = None) -> int:
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params or {}}))
        return self._id

    def call(self, method: str, params: dict[str, Any] | None = None, timeout: float = 60) -> dict[str, Any]:
        wanted = self._send(method, params)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = json.loads(self._ws.recv())
            if message.get("id") == wanted:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._handle(message)
        raise TimeoutError(method)

    def pump(self, seconds: float) -> None:
        """Process events for ``seconds`` (console messages arriving after a call)."""
        self._ws.settimeout(0.2)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                try:
                    self._handle(json.loads(self._ws.recv()))
                except Exception as err:  # websocket timeout
                    if "timed out" not in str(err).lower():
                        raise
        finally:
            self._ws.settimeout(60)

    def navigate(self, url: str, wait: float = 60) -> None:
        self.call("Page.navigate", {"url": url})
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.evaluate("document.readyState") == "complete":
                return
            time.sleep(0.1)
        raise TimeoutError(f"{url} did not load")

    def evaluate(self, expression: str, timeout: float = 60) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True},
                           timeout=timeout)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def hover(self, x: float, y: float) -> None:
        """Move the mouse to ``(x, y)`` (CSS pixels in the viewport), as a user's pointer would."""
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})

    def screenshot(self, width: int = 1400, height: int = 1000, full_page: bool = False) -> bytes:
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": min(size[1], 12000), "scale": 1}
            params["captureBeyondViewport"] = True
        return base64.b64decode(self.call("Page.captureScreenshot", params)["data"])

    def close(self) -> None:
        self._ws.close()


class Browser:
    def __init__(self, executable: str | None = None) -> None:
        self.executable = executable or find_chromium()
        if self.executable is None:
            raise FileNotFoundError("no Chromium found (apt-get install chromium, or set TENSORLENS_CHROMIUM)")
        self._profile = tempfile.mkdtemp(prefix="tensorlens-chromium-")
        self.port = _free_port()
        self._process = subprocess.Popen(
            [
                self.executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
                "--disable-extensions", "--mute-audio", "--hide-scrollbars", f"--user-data-dir={self._profile}",
                "--remote-debugging-address=127.0.0.1", f"--remote-debugging-port={self.port}",
                "--remote-allow-origins=*", "--window-size=1400,1000", "about:blank",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/version", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    self.close()
                    raise RuntimeError("Chromium did not start its DevTools endpoint") from None
                time.sleep(0.2)

    def open(self, url: str) -> Page:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=10) as response:
            targets = [t for t in json.load(response) if t.get("type") == "page"]
        page = Page(targets[0]["webSocketDebuggerUrl"])
        page.navigate(url)
        return page

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)  # Chromium's helpers are in its own group
            except ProcessLookupError:
                pass
            self._process.wait(timeout=30)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assert_clean(page: Page, url: str) -> None:
    """No console error, exception, dialog or page error; no request other than the page itself."""
    page.pump(0.5)
    errors = [m for m in page.console if m.get("type") in ("error", "assert")]
    assert errors == [], errors
    assert page.exceptions == [], page.exceptions
    outside = [r for r in page.requests if r != url and not r.startswith("data:")]
    assert outside == [], outside  # nothing leaves the page
    assert page.failed == []
    assert page.dialogs == []  # no alert() from a name
    assert page.evaluate("window.tensorlens.errors") == []


def png_pixels(png: bytes) -> Any:
    """The screenshot as an ``[height, width, channels]`` float array in [0, 1] (matplotlib's PNG reader)."""
    import io

    from matplotlib import image

    return image.imread(io.BytesIO(png), format="png")


#: ``pytestmark = BROWSER_TESTS`` in a module of page tests: skipped, saying why, where Chromium or
#: websocket-client (which drives it) is missing; the ``browser`` fixture (conftest.py) opens one.
BROWSER_TESTS = [
    pytest.mark.skipif(
        find_chromium() is None, reason="Chromium is not installed (apt-get install chromium, or set TENSORLENS_CHROMIUM)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("websocket") is None,
        reason="the browser tests need websocket-client (in the dev extra)",
    ),
]
