"""Values shared by agents, coordinator and partitioner."""

from __future__ import annotations

import pytest

from stratamesh.fleet.sessions import wire_dtype


@pytest.mark.parametrize("sender, receiver, travels", [
    ("float32", "float32", "float32"),
    ("float32", "bfloat16", "bfloat16"),     # cast before sending: half the bytes, the receiver converts nothing
    ("bfloat16", "float32", "bfloat16"),     # the receiver's upcast is exact: send the narrower
    ("float16", "float32", "float16"),
    ("bfloat16", "float16", "float16"),      # neither holds the other: the receiver's
    ("float16", "bfloat16", "bfloat16"),
    ("bfloat16", "bfloat16", "bfloat16"),
    ("bfloat16", "", "bfloat16"),            # a receiver that did not say: the sender's own
    ("", "float16", "float16"),
    ("", "", "float32"),
])
def test_activations_travel_in_the_receivers_dtype_unless_it_is_float32(sender, receiver, travels) -> None:
    assert wire_dtype(sender, receiver) == travels
