"""The checkout's folders as tests reach them, whatever folder of tests_npu/ a test sits in.

Tests live one folder deep (tests_npu/<room>/) or at tests_npu/ itself; counting ``parent`` from a test's own
``__file__`` breaks each time a file moves, so every test takes its paths from here.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SUPPORT = TESTS / "support"
DATA = TESTS / "data"
