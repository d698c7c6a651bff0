"""Sphinx configuration of the shardwise site: ``make docs`` builds it into ``site/``.

Why Sphinx (9.x) with MyST and Furo: Sphinx is maintained and builds offline (no CDN, no network at build
time); its autodoc writes the API reference from the docstrings the code already has; myst-parser reads
the Markdown pages under docs/ as they are written for GitHub, so the same files serve both; Furo is a
maintained theme with a client-side search that needs no server. ``sphinx-build -W --keep-going -n``
turns every warning into a failure: a link to a missing page or a missing heading anchor (MyST's
``myst.xref_missing``), a page in no table of contents, a docstring autodoc cannot parse, an unknown
cross-reference to a shardwise name (nitpicky).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

from docutils import nodes
from docutils.parsers.rst import Directive

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's shardwise, installed or not
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shardwise  # noqa: E402  (after the path above)
from shardwise.strategies.registry import CLASSES  # noqa: E402

project = "shardwise"
author = "the shardwise authors"
copyright = "the shardwise authors"  # noqa: A001  (Sphinx's name)
release = version = shardwise.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# Not pages: the site checker (make docs-check) and Python's caches.
exclude_patterns = ["check_site.py", "**/__pycache__"]

# Heading anchors as GitHub makes them, so that page.md#a-heading links work on GitHub and here alike.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = f"shardwise {release}"
html_static_path = ["_static"]
html_css_files = ["site.css"]  # two files side by side in the migration guides
html_show_sourcelink = False
html_copy_source = False
pygments_style = "friendly"

# API reference (docs/api/): autodoc + napoleon (the code's "Args:" sections). Signatures keep the
# annotations as written; the annotations are not cross-referenced (they name torch and typing, which
# no offline inventory describes), so nitpicky mode checks the references to shardwise's own names.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"exclude-members": "__init__, __new__"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = True
# Docstrings name internal modules and helpers with roles (:mod:`shardwise.data`, :func:`unit_modules`) for
# readers of the code; the site documents the public names only, so those stay plain text. A reference to a
# public name must resolve: a public name missing from docs/api/ fails the build.
PUBLIC_NAMES = sorted({*shardwise._PUBLIC, *CLASSES})
nitpick_ignore_regex = [
    (r"py:mod", r".*"),
    (r"py:.*", r"(?!(shardwise\.)?(" + "|".join(PUBLIC_NAMES) + r")(\..*)?$).*"),
]


# ---------------------------------------------------------------------------------------------------------
# Links out of docs/: a page that links a repository file (../benchmarks/README.md) reaches the site's page
# for it where there is one; other files (../examples/x.py) stay what MyST makes of them: a download.
SITE_PAGES_FOR_FILES = {"../benchmarks/README.md": "/benchmarks.md"}


def _link_site_pages(app, docname: str, source: list[str]) -> None:
    text = source[0]
    for target, page in SITE_PAGES_FOR_FILES.items():
        text = re.sub(r"\]\(" + re.escape(target) + r"(#[^)]*)?\)", lambda m: f"]({page}{m.group(1) or ''})", text)
    source[0] = text


# A file included from outside docs/ (benchmarks/README.md on the Benchmarks page, a page at the top of docs/)
# links relative to its own folder: `results/ddp/run.txt` there is `../benchmarks/results/ddp/run.txt` here.
# Links into docs/ are left to the include's :relative-docs:, pictures to :relative-images:; a link to a
# file that does not exist still fails the build.
_LINK = re.compile(r"(?<!!)(\[[^\]]*\]\()([^)\s#][^)\s]*)\)")


def _links_from_the_included_folder(app, relative_path, parent_docname: str, content: list[str]) -> None:
    folder = pathlib.PurePosixPath(relative_path).parent
    if not str(folder).startswith(".."):
        return

    def rewrite(m: re.Match[str]) -> str:
        target = m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/") or target.startswith("../docs/"):
            return m.group(0)
        return f"{m.group(1)}{os.path.normpath(folder / target)})"

    content[0] = _LINK.sub(rewrite, content[0])


# ---------------------------------------------------------------------------------------------------------
# The command line's reference: ```{cli-help} VERB``` renders `shardwise VERB --help` as the CLI prints it,
# from the parser itself (shardwise.cli.build_parser; no process, no torch import), at a fixed width.
def _cli_help(verb: str) -> str:
    """``shardwise VERB --help`` ("" for ``shardwise --help``; "checkpoint ls" for a verb's verb)."""
    os.environ["COLUMNS"] = "100"  # argparse's width; the text is the same on every machine
    from shardwise import cli

    if verb == "run":  # `shardwise run --help` is ours, not argparse's (torchrun takes every other flag)
        return cli.RUN_HELP
    parser = cli.build_parser()
    for word in verb.split():
        verbs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not verbs or word not in verbs[0].choices:
            raise ValueError(f"cli-help: shardwise has no verb {verb!r}")
        parser = verbs[0].choices[word]
    return parser.format_help()


class CliHelp(Directive):
    optional_arguments = 1
    final_argument_whitespace = True

    def run(self) -> list[nodes.Node]:
        try:
            text = _cli_help(self.arguments[0] if self.arguments else "")
        except ValueError as e:
            return [self.state.document.reporter.error(str(e), line=self.lineno)]
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


# ---------------------------------------------------------------------------------------------------------
# ```{snippet} PAGE NAME``` shows the block marked <!-- snippet: NAME --> (or <!-- snippet: NAME continues PREV -->)
# on docs/PAGE: a block the tests run (tests/docs_snippet.py), so a how-to page shows the tested program of a
# longer page instead of a copy that could drift from it.
def snippet_text(page: str, name: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    m = re.search(rf"^<!-- snippet: {re.escape(name)}(?: continues [\w-]+)? -->\n```python\n(.*?)^```", text,
                  re.M | re.S)
    if m is None:
        raise ValueError(f"snippet: docs/{page} has no block marked {name!r}")
    return m.group(1)


class Snippet(Directive):
    required_arguments = 2

    def run(self) -> list[nodes.Node]:
        page, name = self.arguments
        try:
            text = snippet_text(page, name)
        except (ValueError, OSError) as e:
            return [self.state.document.reporter.error(str(e), line=self.lineno)]
        self.state.document.settings.env.note_dependency(str(ROOT / "docs" / page))
        block = nodes.literal_block(text, text)
        block["language"] = "python"
        return [block]


def setup(app) -> dict:
    app.connect("source-read", _link_site_pages)
    app.connect("include-read", _links_from_the_included_folder)
    app.add_directive("cli-help", CliHelp)
    app.add_directive("snippet", Snippet)
    return {"parallel_read_safe": True}
