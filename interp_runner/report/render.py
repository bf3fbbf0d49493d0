"""Turning report contexts into one self-contained HTML file: the Jinja environment (autoescaped, strict), images
as data URIs, cell formatting, and an atomic write.

Nothing a report shows is fetched when it opens: styles are inline, images are ``data:`` URIs or inline SVG, and
the page's Content-Security-Policy refuses every other source. A page may carry one script, inline: ``SCRIPT``
(``templates/report.js``), which the policy admits by its sha256 and which fetches nothing.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

TEMPLATES = Path(__file__).resolve().parent / "templates"
SCRIPT = TEMPLATES / "report.js"

# image formats a browser shows, by their first bytes
IMAGE_MAGIC = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF87a": "image/gif",
               b"GIF89a": "image/gif"}

_env: Environment | None = None


def environment() -> Environment:
    global _env
    if _env is None:
        _env = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True, undefined=StrictUndefined,
                           trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        _env.filters["cell"] = cell
    return _env


def render(template: str, **context) -> str:
    return environment().get_template(template).render(**context)


def page_script() -> dict:
    """What a page with the report's script needs: the script's text and its Content-Security-Policy source."""
    text = SCRIPT.read_text(encoding="utf-8")
    digest = base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")
    return {"text": Markup(text), "csp": f"'sha256-{digest}'"}


def write_html(path: Path, html: str) -> Path:
    """Write ``html`` to ``path`` whole or not at all (a reader never sees half a page)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(path)
    return path


def image_data_uri(data: bytes) -> str | None:
    """``data:`` URI of an image a browser shows (PNG, JPEG, GIF), else None."""
    for magic, mime in IMAGE_MAGIC.items():
        if data.startswith(magic):
            return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    return None


def figure_entry(path: Path, anchor: str) -> dict:
    """What the templates need to show one figure file: its name, and its data URI or why it has none."""
    path = Path(path)
    entry = {"name": path.name, "anchor": anchor, "uri": None, "problem": None}
    try:
        entry["uri"] = image_data_uri(path.read_bytes())
        if entry["uri"] is None:
            entry["problem"] = "not a PNG, JPEG or GIF image: not shown"
    except OSError as err:
        entry["problem"] = f"cannot be read ({err.strerror or err})"
    return entry


def cell(value) -> str:
    """A table cell: floats to 4 significant digits, NaN and None as a dash, sequences comma-joined."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "—" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value) if value else "—"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {cell(v)}" for k, v in value.items()) if value else "—"
    return str(value)


def flatten(value, prefix: str = "") -> list[tuple[str, object]]:
    """Nested mappings as (dotted key, leaf) rows; lists of mappings indexed (``phases[0].name``)."""
    if isinstance(value, Mapping):
        if not value:
            return [(prefix, "—")] if prefix else []
        rows = []
        for key, item in value.items():
            rows += flatten(item, f"{prefix}.{key}" if prefix else str(key))
        return rows
    if isinstance(value, (list, tuple)) and any(isinstance(v, Mapping) for v in value):
        rows = []
        for i, item in enumerate(value):
            rows += flatten(item, f"{prefix}[{i}]")
        return rows
    return [(prefix, value)]
