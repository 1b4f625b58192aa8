"""Text helpers for titles and identifiers."""

import re


def words(text):
    return re.findall(r"[A-Za-z0-9]+", text)


def title_case(text):
    return " ".join(w.capitalize() for w in words(text))
