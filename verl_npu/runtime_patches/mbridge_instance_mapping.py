"""Give each mbridge bridge its own HF name table, so tying one model's embeddings does not tie another's.

Changes: wraps mbridge's ``Bridge.__init__`` to copy the class's ``_DIRECT_MAPPING`` onto the instance before
the original runs, so that ``_adjust_mapping_for_shared_weights`` (called from ``__init__``) writes into the copy.
Why: mbridge 0.15.1's Qwen2, Qwen2.5-VL, Gemma3 and InternVL3 bridges tie a ``tie_word_embeddings`` model's output
layer to its embedding by writing into the class's table. Every later bridge of that class in the process then loads
and exports its output layer as the embedding: a critic or reward model beside a tied actor, or the next model of a
test process, gets a wrong ``lm_head`` with no error (tests_npu/patching/test_runtime_patches.py shows it).
Upstream: mbridge 0.15.1 mbridge/core/bridge.py (Bridge.__init__), mbridge/models/qwen2.py
(Qwen2Bridge._adjust_mapping_for_shared_weights).
Remove when: mbridge's bridges keep the tied table on the instance.
"""

from __future__ import annotations

import functools

from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import EVERY_PLATFORM


def _build(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        table = getattr(type(self), "_DIRECT_MAPPING", None)
        if isinstance(table, dict) and "_DIRECT_MAPPING" not in self.__dict__:
            self._DIRECT_MAPPING = dict(table)
        original(self, *args, **kwargs)

    return __init__


PATCH = Patch(
    id="mbridge-instance-name-table",
    target="mbridge.core.bridge:Bridge.__init__",
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires={"mbridge": "==0.15.1"},
    source_sha256="be018566687eee363a1d61bd0f904e7b59ee9e792acaa774579ec2cfd472acff",
    reason="a tied bridge writes its output-layer mapping into the class's table, mis-mapping every later bridge",
    upstream="mbridge 0.15.1 core/bridge.py::Bridge.__init__, models/qwen2.py::_adjust_mapping_for_shared_weights",
    remove_when="mbridge's bridges keep the tied name table on the instance",
    build=_build,
)
PATCHES = (PATCH,)
