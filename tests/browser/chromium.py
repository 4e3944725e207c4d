"""Drive headless Chromium over the Chrome DevTools Protocol through a pipe (no websocket, no extra package).

`--remote-debugging-pipe` makes Chromium read commands from file descriptor 3 and write replies and events
to descriptor 4, each message one JSON object ended by a NUL byte (the transport Playwright and Puppeteer
use). A pipe needs no free port and no client library, and it closes with the browser.

Flags are the ones verified on Debian's chromium (see the notes on the machine): headless as root needs
--no-sandbox; the --disable-* set stops background fetches, so a report that needed the network would
show its requests as failures instead of having them served.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless browser with one page; events are kept so that tests can inspect them."""

    def __init__(self, binary: Path = CHROMIUM, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.events: list[dict[str, Any]] = []
        self._profile = tempfile.mkdtemp(prefix="sdzero-chromium-")  # a fresh --user-data-dir
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_fds() -> None:
            # Runs in the child between fork and exec. Move both ends above 10 first so that neither
            # dup2 overwrites the other's source; dup2 leaves 3 and 4 inheritable, every other
            # descriptor Python opened is closed at exec (PEP 446).
            reads, writes = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser_r, from_browser_w))
            os.dup2(reads, 3)
            os.dup2(writes, 4)
            os.close(reads)
            os.close(writes)

        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [str(binary), *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            close_fds=False,  # pass_fds would need 3 and 4 open in this process; see wire_fds
            preexec_fn=wire_fds,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.session = self._attach()

    # -------------------------------------------------------------------------------- transport

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(
                    f"no reply from Chromium within {self.timeout_s:.0f} s{self._stderr_tail()}"
                )
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium closed the pipe{self._stderr_tail()}")
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def send(self, method: str, params: dict[str, Any] | None = None, session: bool = True) -> dict[str, Any]:
        """Send one command and wait for its reply; events that arrive meanwhile are recorded."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, after: int = 0) -> dict[str, Any]:
        """The first event `method` recorded at index >= `after`, reading more until it comes."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            for event in self.events[after:]:
                if event.get("method") == method:
                    return event
            self.events.append(self._read_message(deadline))

    def _attach(self) -> str:
        targets = self.send("Target.getTargets", session=False)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        return self.send(
            "Target.attachToTarget", {"targetId": page["targetId"], "flatten": True}, session=False
        )["sessionId"]

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-5:]
        return (": " + " | ".join(tail)) if tail else ""

    # ------------------------------------------------------------------------------------ pages

    def open(self, url: str, width: int = 1366, height: int = 768, dark: bool = False) -> None:
        """Load `url` in a laptop-sized viewport, in light or dark colour scheme, and wait for `load`."""
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        scheme = "dark" if dark else "light"
        self.send(
            "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": scheme}]}
        )
        mark = len(self.events)
        self.send("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired", after=mark)

    def evaluate(self, expression: str) -> Any:
        result = self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page, not only the viewport."""
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console.error calls and browser log errors (failed loads, CSP violations)."""
        errors = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                thrown = details.get("exception", {}).get("description", "")
                errors.append(f"{details.get('text', 'exception')} {thrown}".strip())
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append(
                    " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                )
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                errors.append(f"{entry.get('source')}: {entry.get('text')} ({entry.get('url', '')})")
        return errors

    def requested_urls(self) -> list[str]:
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e.get("method") == "Network.requestWillBeSent"
        ]

    def dialogs(self) -> list[str]:
        """Messages of alert/confirm/prompt dialogs the page tried to open (a script ran)."""
        return [
            e["params"].get("message", "")
            for e in self.events
            if e.get("method") == "Page.javascriptDialogOpening"
        ]

    # ---------------------------------------------------------------------------------- shutdown

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                with contextlib.suppress(BrowserError, OSError):
                    self.send("Browser.close", session=False)
                try:
                    self.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=15)
        finally:
            for fd in (self._to_browser, self._from_browser):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._stderr.close()
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
