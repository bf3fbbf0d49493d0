"""Headless Chromium driven through the Chrome DevTools Protocol (the ``websockets`` package's sync client), for
tests that open a page and check what a person would see: console errors, exceptions, failed or outside
requests, images, headings, and a screenshot; and that use it as a person would: the mouse moved or clicked at a
point, then what went wrong since (``settle``), with the clipboard open to the page.

Chromium is Debian's package (``scripts/install_browser.sh``); nothing else is downloaded.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from websockets.sync.client import connect

# what the page reports back after it loaded: every image, the section headings, the page's size
PAGE_FACTS = """(async () => {
  const imgs = Array.from(document.images);
  await Promise.all(imgs.map(img => img.decode().catch(() => null)));
  return {
    images: imgs.map(img => ({alt: img.alt, complete: img.complete, naturalWidth: img.naturalWidth,
                              naturalHeight: img.naturalHeight, src: img.src.slice(0, 64)})),
    h1: Array.from(document.querySelectorAll("h1")).map(h => h.textContent.trim()),
    h2: Array.from(document.querySelectorAll("h2")).map(h => h.textContent.trim()),
    h3: Array.from(document.querySelectorAll("h3")).map(h => h.textContent.trim()),
    links: Array.from(document.querySelectorAll("a[href]")).map(a => a.getAttribute("href")),
    scripts: document.scripts.length,
    script_srcs: Array.from(document.scripts).filter(s => s.src).map(s => s.src),
    width: document.documentElement.scrollWidth,
    height: document.documentElement.scrollHeight,
  };
})()"""


@dataclass
class PageLoad:
    facts: dict
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, log errors
    requests: list[str] = field(default_factory=list)  # every URL the page asked for, data: URIs left out


class Browser:
    """One headless Chromium process; ``open`` loads a page in its tab. Use as a context manager."""

    def __init__(self, executable: str, width: int = 1280, height: int = 900):
        self.profile = Path(tempfile.mkdtemp(prefix="chromium-profile-"))
        self.proc = subprocess.Popen(
            [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
             f"--window-size={width},{height}", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.width, self.next_id, self.events = width, 0, []
        self.opened = ExitStack()
        try:
            self.ws = self.opened.enter_context(connect(self._page_socket(), max_size=None, open_timeout=30))
        except BaseException:
            self.close()
            raise

    def _page_socket(self, timeout: float = 60) -> str:
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.time() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited ({self.proc.returncode}): {self.proc.stderr.read().decode()[-2000:]}")
            if time.time() > deadline:
                raise TimeoutError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
                pages = [t for t in json.load(reply) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            if time.time() > deadline:
                raise TimeoutError("chromium opened no page")
            time.sleep(0.1)

    def call(self, method: str, timeout: float = 60, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        deadline = time.time() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(deadline - time.time(), 0.01)))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, event: str, timeout: float = 60) -> dict:
        deadline = time.time() + timeout
        while True:
            for i, message in enumerate(self.events):
                if message.get("method") == event:
                    return self.events.pop(i)
            self.events.append(json.loads(self.ws.recv(timeout=max(deadline - time.time(), 0.01))))

    def open(self, page: Path) -> PageLoad:
        """Load ``page`` (a file) and collect what went wrong while it loaded and rendered."""
        self.events = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        # what a copy button writes can be read back (``navigator.clipboard.readText``)
        self.call("Browser.grantPermissions", permissions=["clipboardReadWrite", "clipboardSanitizedWrite"])
        self.call("Page.navigate", url=Path(page).resolve().as_uri())
        self.wait_for("Page.loadEventFired")
        return self.settle(PageLoad(self.evaluate(PAGE_FACTS)))

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page, a promise's awaited."""
        reply = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression[:80]}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def mouse(self, x: float, y: float, click: bool = False) -> None:
        """Move the mouse to (x, y) in the viewport (CSS pixels); with ``click``, press and release its left button
        there."""
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        if click:
            for kind in ("mousePressed", "mouseReleased"):
                self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def settle(self, load: PageLoad | None = None) -> PageLoad:
        """What went wrong, and what was requested, since the page opened or the last ``settle``: into ``load``
        (default: a new one with no facts)."""
        load = load if load is not None else PageLoad({})
        self.call("Runtime.evaluate", expression="0")  # let late events arrive before they are read
        for message in self.events:
            method, params = message.get("method"), message.get("params", {})
            if method == "Runtime.exceptionThrown":
                load.errors.append(f"exception: {params['exceptionDetails'].get('text')} "
                                   f"{params['exceptionDetails'].get('exception', {}).get('description', '')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                load.errors.append(f"console.{params['type']}: " + " ".join(
                    str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                load.errors.append(f"log ({params['entry'].get('source')}): {params['entry'].get('text')}")
            elif method == "Network.loadingFailed":
                load.errors.append(f"request failed: {params.get('errorText')} {params.get('blockedReason', '')}")
            elif method == "Network.requestWillBeSent" and not params["request"]["url"].startswith("data:"):
                load.requests.append(params["request"]["url"])
        self.events = []
        return load

    def screenshot(self, path: Path, max_height: int = 20000) -> Path:
        """The whole page (up to ``max_height`` CSS pixels) as a PNG."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": self.width, "height": min(size["height"], max_height), "scale": 1}
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        try:
            self.opened.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
