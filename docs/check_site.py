"""Look at the built site in a real browser: ``make docs-check`` (after ``make docs``).

Serves site/ on a free loopback port (Python's http.server: the search page's scripts do not run from
file://), opens pages in Debian's headless Chromium and saves screenshots into build/docs-check/: the home
page, the tutorial, an API page, a concept page with its picture and a migration guide. Then it checks:

* the site's search finds "ZeRO": ``search.html?q=ZeRO`` rendered with its JavaScript (a virtual time
  budget lets the search index load and run), and the results list names the ZeRO pages;
* every file the pages asked the server for exists (no 404: a missing stylesheet, script or picture);
* each screenshot is a 1280x900 picture with something on it (not one flat colour).

Exit status 0 when all hold; 1 with the failures listed; 2 when Chromium is missing.

    python docs/check_site.py [--site site] [--out build/docs-check]
"""
from __future__ import annotations

import argparse
import functools
import html
import http.server
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading

ROOT = pathlib.Path(__file__).resolve().parent.parent
# (screenshot name, page): what a reader sees first on each kind of page.
PAGES = [
    ("home", "index.html"),
    ("tutorial", "getting-started/tutorial.html"),
    ("api", "api/shardwise.html"),
    ("concept-zero", "concepts/zero.html"),
    ("migration-lightning", "migrate/lightning.html"),
]
SEARCH = ("search-zero", "search.html?q=ZeRO")
SIZE = (1280, 900)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--force-device-scale-factor=1"]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Server:
    """site/ on 127.0.0.1, a port the OS picks; remembers every path it could not serve."""

    def __init__(self, site: pathlib.Path) -> None:
        self.missing: list[str] = []
        missing = self.missing

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                if code == 404 and not self.path.startswith("/favicon.ico"):
                    missing.append(self.path)
                super().send_error(code, message, explain)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                     functools.partial(Handler, directory=str(site)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def browse(browser: str, url: str, *args: str, budget_ms: int = 3000) -> subprocess.CompletedProcess[str]:
    """One headless Chromium run on ``url`` with a fresh, empty profile."""
    with tempfile.TemporaryDirectory(prefix="docs-check-profile-") as profile:
        cmd = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={SIZE[0]},{SIZE[1]}",
               f"--virtual-time-budget={budget_ms}", *args, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def screenshot(browser: str, url: str, path: pathlib.Path) -> str | None:
    """Save ``url`` as ``path``; the failure in words, or None."""
    path.unlink(missing_ok=True)
    r = browse(browser, url, f"--screenshot={path}")
    if not path.exists():
        return f"{url}: no screenshot (chromium exit {r.returncode}: {r.stderr.strip()[-300:]})"
    return looks_empty(path)


def looks_empty(path: pathlib.Path) -> str | None:
    try:
        from PIL import Image
    except ImportError:  # Pillow comes with matplotlib (the plots extra); without it, the size is checked
        return None if path.stat().st_size > 10_000 else f"{path.name}: {path.stat().st_size} bytes, nearly empty"
    with Image.open(path) as im:
        if im.size != SIZE:
            return f"{path.name}: {im.size[0]}x{im.size[1]}, not {SIZE[0]}x{SIZE[1]}"
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
        if colours is not None and len(colours) < 16:
            return f"{path.name}: {len(colours)} colours: a blank page"
    return None


def search_results(dom: str) -> list[tuple[str, str]]:
    """(href, title) of each result in the search page's rendered results list."""
    m = re.search(r'<ul[^>]*class="search"[^>]*>(.*?)</ul>', dom, re.S)
    if m is None:
        return []
    return [(href, html.unescape(re.sub(r"<[^>]+>", "", title)).strip())
            for href, title in re.findall(r'<li[^>]*>\s*<a href="([^"]+)"[^>]*>(.*?)</a>', m.group(1), re.S)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--site", default=str(ROOT / "site"), help="the built site (make docs)")
    p.add_argument("--out", default=str(ROOT / "build" / "docs-check"), help="where the screenshots go")
    a = p.parse_args(argv)
    site, out = pathlib.Path(a.site), pathlib.Path(a.out)
    if not (site / "index.html").exists():
        print(f"docs-check: no site at {site}: run make docs first", file=sys.stderr)
        return 1
    browser = chromium()
    if browser is None:
        print("docs-check: Chromium is missing: apt-get install -y chromium (Debian's package)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    with Server(site) as server:
        for name, page in PAGES:
            path = out / f"{name}.png"
            failure = screenshot(browser, server.url + page, path)
            failures += [failure] if failure else []
            print(f"docs-check: {page} -> {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        name, page = SEARCH
        dom = browse(browser, server.url + page, "--dump-dom", budget_ms=8000).stdout
        results = search_results(dom)
        zero = [(href, title) for href, title in results if "zero" in href.lower() or "ZeRO" in title]
        print(f"docs-check: search for 'ZeRO': {len(results)} results, {len(zero)} ZeRO pages: "
              + ", ".join(f"{title} ({href})" for href, title in zero[:5]))
        if not zero:
            failures.append(f"search for 'ZeRO' found no ZeRO page ({len(results)} results)")
        failure = screenshot(browser, server.url + page, out / f"{name}.png")
        failures += [failure] if failure else []
        if server.missing:
            failures.append("the server had no file for: " + ", ".join(sorted(set(server.missing))))
    for failure in failures:
        print(f"docs-check: FAILED: {failure}", file=sys.stderr)
    print(f"docs-check: {'ok' if not failures else f'{len(failures)} failures'}; screenshots in {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
