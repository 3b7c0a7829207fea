"""Open every page of the built site in headless Chromium, as a reader would (issue 30).

    python docs/_tools/docs_check.py [--site site] [--require-browser] [--netns]
        [--screenshots DIR]

The site is served on 127.0.0.1; every other request is refused by the browser (no host
resolves, and a request to any other origin is aborted and counted), so this is the site
with the network off. With ``--netns`` (root; CI) the check runs in a network namespace of
its own that holds only loopback, so nothing could reach the network anyway. A page fails
when

* a formula stays raw: an ``arithmatex`` element that MathJax did not typeset, a TeX error
  (``mjx-merror``), or TeX left in the visible text outside code (``\\[``, ``\\(``, ``$$``,
  ``\\frac``-like commands, the reST ``:math:`` and ``.. math::`` of a docstring);
* an image does not load (``naturalWidth`` 0 after decoding);
* any request fails, gets an HTTP error, or leaves the site.

Before the site, the check runs on two planted pages, one broken in each way and one clean,
and stops if it does not see exactly the planted faults: a check that cannot fail is no check.

The browser is Debian's Chromium (``/usr/bin/chromium``; ``CHROMIUM`` overrides), driven by
Playwright from PyPI (the docs extra), never a browser download. Without one, the check
prints why and exits 0, or 1 with ``--require-browser`` (CI installs Chromium and passes it).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The flags this machine's Chromium needs (docs: no background traffic, no sandbox as root)
#: and the closed network: no host name resolves but the site's.
CHROMIUM_ARGS = [
    "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
PLANTED = "/__docs_check__/"

#: Runs in the page after ``load``: waits for MathJax, then reports what a reader would miss.
INSPECT = r"""async () => {
  const report = {formulas: 0, raw: [], errors: [], images: 0, broken: []};
  const marked = [...document.querySelectorAll('.arithmatex')];
  report.formulas = marked.length;
  if (marked.length) {
    if (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) {
      report.raw.push('MathJax is not loaded');
    } else {
      // a renderer that hangs leaves the formulas raw, and they are reported as such
      await Promise.race([MathJax.startup.promise, new Promise((r) => setTimeout(r, 30000))]);
    }
  }
  // MathJax loads its fonts once it has typeset
  await Promise.race([document.fonts.ready, new Promise((r) => setTimeout(r, 10000))]);
  for (const el of marked) {
    const text = el.textContent.trim().replace(/\s+/g, ' ').slice(0, 80);
    if (!el.querySelector('mjx-container')) report.raw.push(text);
  }
  for (const el of document.querySelectorAll('mjx-merror')) {
    report.errors.push((el.getAttribute('data-mjx-error') || el.textContent).slice(0, 80));
  }
  const tex = new RegExp([String.raw`\\[\[(]`, String.raw`\$\$`, ':math:`', String.raw`\.\. math::`,
                         String.raw`\\(?:frac|mathrm|sqrt|sum|left|right|cdot|le|ge)\b`].join('|'));
  const skip = 'code, pre, script, style, textarea, mjx-container, .arithmatex';
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const parent = node.parentElement;
    if (!parent || parent.closest(skip)) continue;
    const match = node.textContent.match(tex);
    if (match) {
      const at = Math.max(0, match.index - 30);
      report.raw.push('text: ' + node.textContent.slice(at, at + 80).trim());
    }
  }
  const images = [...document.images];
  report.images = images.length;
  for (const img of images) {
    img.loading = 'eager';  // a lazy image below the fold would never load
    const timeout = new Promise((resolve) => setTimeout(resolve, 10000));
    try { await Promise.race([img.decode(), timeout]); } catch (e) {}
    if (!(img.complete && img.naturalWidth > 0)) report.broken.push(img.getAttribute('src'));
  }
  return report;
}"""

GOOD_PAGE = """<!doctype html><html><head><meta charset="utf-8">
<script src="/javascripts/mathjax.js"></script><script src="/assets/mathjax/tex-chtml.js">
</script></head><body><p>inline <span class="arithmatex">\\(x^2\\)</span></p>
<div class="arithmatex">\\[\\frac{a}{b}\\]</div><pre><code>\\[raw in code is fine\\]</code></pre>
<img src="/assets/images/favicon.png" alt="loads"></body></html>"""
BAD_PAGE = GOOD_PAGE.replace("</body>", """<p>left raw: \\[ y = x \\]</p>
<span class="arithmatex">\\(x^1^2\\)</span>
<img src="/__docs_check__/missing.png" alt="404"><img src="https://example.com/x.png" alt="off">
</body>""")


class Handler(SimpleHTTPRequestHandler):
    """Serves the site and the two planted pages; quiet."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        planted = {f"{PLANTED}good.html": GOOD_PAGE, f"{PLANTED}bad.html": BAD_PAGE}
        if self.path in planted:
            body = planted[self.path].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


def rerun_in_own_network(argv: list[str]) -> int:
    """Run this check again in a new network namespace (``unshare --net``, util-linux)."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        print("docs-check: --netns needs root and unshare (util-linux)")
        return 1
    env = {**os.environ, "DOCS_CHECK_NETNS": "1"}
    return subprocess.call([unshare, "--net", sys.executable, __file__, *argv], env=env)


def loopback_up() -> list[str]:
    """Bring ``lo`` up in this (new) namespace; return its interfaces (only ``lo``)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))
    return [name for _, name in socket.if_nameindex()]


def find_chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def pages(site: Path) -> list[str]:
    """Site-relative URLs of every HTML page (a folder's index.html as the folder)."""
    urls = []
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site).as_posix()
        if rel.startswith("assets/"):
            continue
        urls.append("/" + (rel[: -len("index.html")] if rel.endswith("index.html") else rel))
    return urls


def check_page(page, base: str, url: str, shots: Path | None) -> tuple[list[str], dict]:
    """Load ``url``; return its problems and the in-page report."""
    problems: list[str] = []
    offsite: list[str] = []

    def route(r):
        if r.request.url.startswith(base + "/") or r.request.url.startswith("data:"):
            r.continue_()
        else:
            offsite.append(r.request.url)
            r.abort()

    def failed(request):
        if request.url not in offsite:
            problems.append(f"request failed: {request.url} ({request.failure})")

    def response(resp):
        if resp.status >= 400:
            problems.append(f"HTTP {resp.status}: {resp.url}")

    page.route("**/*", route)
    page.on("requestfailed", failed)
    page.on("response", response)
    try:
        page.goto(base + url, wait_until="load", timeout=60_000)
        report = page.evaluate(INSPECT)
        if shots is not None:
            name = url.strip("/").replace("/", "_") or "index"
            page.screenshot(path=str(shots / f"{name}.png"), full_page=False)
    finally:
        page.unroute("**/*")
        page.remove_listener("requestfailed", failed)
        page.remove_listener("response", response)
    problems += [f"left the site: {u}" for u in offsite]
    problems += [f"raw formula: {t}" for t in report["raw"]]
    problems += [f"TeX error: {t}" for t in report["errors"]]
    problems += [f"image not loaded: {s}" for s in report["broken"]]
    return problems, report


def self_test(page, base: str) -> list[str]:
    """The planted pages: the clean one passes, the broken one shows each planted fault.

    Returns what went wrong (nothing when the check works)."""
    good, report = check_page(page, base, f"{PLANTED}good.html", None)
    wrong = [f"the clean planted page fails: {p}" for p in good]
    if (report["formulas"], report["images"]) != (2, 1):
        wrong.append(f"the clean planted page: saw {report}, not 2 formulas and 1 image")
    bad, _ = check_page(page, base, f"{PLANTED}bad.html", None)
    expect = ["raw formula: text: left raw", "TeX error", "HTTP 404",
              "image not loaded: /__docs_check__/missing.png",
              "left the site: https://example.com/x.png",
              "image not loaded: https://example.com/x.png"]
    missed = [e for e in expect if not any(p.startswith(e) for p in bad)]
    if missed:
        wrong.append(f"the broken planted page: the check missed {missed} (it saw {bad})")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site")
    parser.add_argument("--require-browser", action="store_true",
                        help="fail, instead of skipping, when no Chromium or Playwright")
    parser.add_argument("--netns", action="store_true",
                        help="run in a network namespace of its own, only loopback (root)")
    parser.add_argument("--screenshots", type=Path, help="save a screenshot of every page")
    args = parser.parse_args(argv)
    network = "other origins refused by the browser"
    if args.netns:
        if os.environ.get("DOCS_CHECK_NETNS") != "1":
            return rerun_in_own_network(sys.argv[1:] if argv is None else argv)
        interfaces = loopback_up()
        if interfaces != ["lo"]:
            print(f"docs-check: the namespace has interfaces {interfaces}, not only lo")
            return 1
        network += ", in a network namespace holding only lo"
    site = args.site.resolve()
    if not (site / "index.html").is_file():
        print(f"docs-check: no built site at {site} (run `make docs` first)")
        return 1
    chromium = find_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium is None or sync_playwright is None:
        why = ("no Chromium (apt-get install chromium, or set CHROMIUM)" if chromium is None
               else "no Playwright (the docs extra)")
        print(f"docs-check: SKIPPED, {why}")
        return 1 if args.require_browser else 0
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    start = time.perf_counter()
    failures: dict[str, list[str]] = {}
    formulas = images = 0
    urls = pages(site)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page()
            if wrong := self_test(page, base):
                failures[PLANTED] = wrong
            for url in urls:
                problems, report = check_page(page, base, url, args.screenshots)
                formulas += report["formulas"]
                images += report["images"]
                if problems:
                    failures[url] = problems
            browser.close()
    finally:
        server.shutdown()
    for url, problems in failures.items():
        print(f"docs-check: {url}")
        for problem in problems:
            print(f"    {problem}")
    print(f"docs-check: {len(urls)} pages, {formulas} formulas, {images} images, "
          f"{len(failures)} failed ({time.perf_counter() - start:.1f} s; {chromium}; network: "
          f"{network})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
