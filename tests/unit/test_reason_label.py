"""The ``reason`` label of the worker's (and the trainer's) metrics takes a bounded set of values."""

from __future__ import annotations

from google.rpc import code_pb2
from weightwire.core.errors import GRPC_CODES, Reason, reason_label


def test_the_grpc_code_names_spelled_in_core_are_google_rpc_codes() -> None:
    assert set(code_pb2.Code.keys()) == GRPC_CODES


def test_known_reasons_and_codes_pass_and_anything_else_is_other() -> None:
    assert reason_label(Reason.SHAPE_MISMATCH.name) == "SHAPE_MISMATCH"
    assert reason_label("RESOURCE_EXHAUSTED") == "RESOURCE_EXHAUSTED"
    assert reason_label("") == ""
    assert reason_label("ENGINE_SPECIFIC_" + "x" * 500) == "OTHER"
