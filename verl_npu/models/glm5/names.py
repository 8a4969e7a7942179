"""How a model is named as GLM-5 or GLM-5.2: in a model path (a search) or as a whole ``--model-config`` value."""

from __future__ import annotations

import re

GLM5_NAME = re.compile(r"glm-?5", re.IGNORECASE)
GLM5_2_NAME = re.compile(r"glm-?5(?:[._-]?2)(?!\d)", re.IGNORECASE)  # GLM-5.2, glm5_2, GLM-5-2, glm52
GLM5, GLM5_2 = "glm5", "glm5.2"


def named_in(text: str) -> str | None:
    """GLM5_2 or GLM5 where ``text`` (a model path) names one, else None."""
    if GLM5_2_NAME.search(text):
        return GLM5_2
    return GLM5 if GLM5_NAME.search(text) else None


def named_as(text: str) -> str | None:
    """GLM5_2 or GLM5 where the whole of ``text`` (a ``--model-config`` value) is such a name, else None."""
    if GLM5_2_NAME.fullmatch(text):
        return GLM5_2
    return GLM5 if GLM5_NAME.fullmatch(text) else None
