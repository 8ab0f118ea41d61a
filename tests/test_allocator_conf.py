"""How ddptrain reads the CUDA caching allocator's settings (``ddptrain/runtime/allocator.py``): the cases mutmut's
mutants of that file survived (docs/mutation.md): a setting of several options, one without
``expandable_segments``, and what ``use_expandable_segments`` answers when it sets the variable itself."""

from __future__ import annotations

import pytest

from ddptrain.runtime.allocator import EXPANDABLE, expandable_segments, use_expandable_segments


@pytest.mark.parametrize(("conf", "on"), [
    ("max_split_size_mb:128,expandable_segments:True", True),  # several options: each read, split at the commas
    ("expandable_segments:True, garbage_collection_threshold:0.6", True),
    ("garbage_collection_threshold:0.6,expandable_segments:False", False),
    ("max_split_size_mb:128", False),  # set, without the option: off (False, not merely falsy)
])
def test_expandable_segments_reads_every_option_of_the_setting(conf: str, on: bool) -> None:
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": conf}) is on


def test_use_expandable_segments_says_it_set_the_variable_only_when_it_did() -> None:
    environ: dict[str, str] = {}
    assert use_expandable_segments(environ) is True and environ == {"PYTORCH_ALLOC_CONF": EXPANDABLE}
    assert use_expandable_segments(environ) is False  # now set: it stands
