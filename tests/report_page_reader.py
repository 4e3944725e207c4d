"""Reading a rendered report in tests: its tags, text, CSS and embedded SVG figures, and the ids each page must have."""

from __future__ import annotations

import base64
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

TRAINING_FIGURES = {"loss", "throughput", "loss-scale", "memory"}
TRAINING_TABLES = {"phases", "checkpoints", "run-options", "environment"}
TRAINING_CODE = {"ds-config"}
ADVISE_FIGURES = {"scaling", "efficiency", "breakdown", "validation", "trial-memory", "bandwidth"}
ADVISE_TABLES = {"recommendation", "recommendation-details", "validation-errors", "trials", "alpha-beta"}
ADVISE_TABLES |= {"comm-meta", "environment"}
ADVISE_CODE = {"launch", "recommended-ds-config"}
SVG_NS = "{http://www.w3.org/2000/svg}"
# Elements and attributes that could fetch or run something; a report has none of them.
ACTIVE_TAGS = {"script", "link", "iframe", "object", "embed", "base", "form", "audio", "video", "source"}


class Page(HTMLParser):
    """Every tag with its attributes, the text, and the CSS of a rendered report."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.css: list[str] = []
        self._in: list[str] = []
        self.html = html
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))
        self._in.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if self._in and self._in[-1] == tag:
            self._in.pop()

    def handle_data(self, data: str) -> None:
        (self.css if self._in and self._in[-1] == "style" else self.text).append(data)

    def ids(self, prefix: str) -> set[str]:
        return {a["id"][len(prefix) :] for _, a in self.tags if a.get("id", "").startswith(prefix)}

    def images(self) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == "img"]

    def raw_title(self) -> str:
        """The <title> as written in the file (escaped), not as the parser decodes it."""
        match = re.search(r"<title>(.*?)</title>", self.html, re.DOTALL)
        assert match, "no <title>"
        return match.group(1)


def svg_of(img: dict[str, str]) -> ET.Element:
    prefix = "data:image/svg+xml;base64,"
    assert img["src"].startswith(prefix), img["src"][:40]
    return ET.fromstring(base64.b64decode(img["src"][len(prefix) :]))
