"""Every config key the documentation names exists: each backticked `section.key` (also written
`section.key: value` or `section.key=value`) in README.md and docs/*.md, whose section is one of the
run config's, is a field of that section. A renamed or removed key the docs still teach fails here."""

import glob
import os
import re

import pytest
from test_config_keys import config_fields, sections_of

from rpeg_jax.config.run import RunConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SPAN = re.compile(r"`([^`\n]+)`")
KEY = re.compile(r"^([a-z_]+)\.([a-z_][a-z0-9_]*)(?:\.[a-z0-9_]+)*(?:\s*[:=].*)?$")


def doc_keys(path: str) -> list[tuple[int, str]]:
    sections = set(sections_of(RunConfig))
    out = []
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        for span in SPAN.findall(line):
            for part in span.split():  # `a.b=1 c.d=2` names two keys
                m = KEY.match(part)
                if m and m.group(1) in sections:
                    out.append((n, f"{m.group(1)}.{m.group(2)}"))
    return out


def test_the_docs_name_keys():  # the scan sees what it should (a scan that finds nothing passes trivially)
    assert len([k for p in DOCS for k in doc_keys(p)]) > 50


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_documented_key_exists(path):
    known = set(config_fields(RunConfig))
    bad = [f"{os.path.relpath(path, ROOT)}:{n}: `{k}`" for n, k in doc_keys(path) if k not in known]
    assert not bad, "keys the docs name that the config does not have:\n" + "\n".join(bad)
