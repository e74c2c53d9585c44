"""An explicit dtype conversion on the way (``push(..., cast_to=...)``) in a single-process push: fp32
master weights into a bf16 worker are refused without it, converted with it, and never converted
when the dtypes already fit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from weightwire.adapters.torch import TorchAdapter
from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model, full_checkpoint
from weightwire.client import PlanError, WeightPusher
from weightwire.core.errors import Reason
from weightwire.core.manifest import ParallelRank
from weightwire.server import serve

BF16 = DemoConfig(dtype=torch.bfloat16)


@pytest.fixture
def bf16_worker() -> Iterator[tuple[str, TorchAdapter]]:
    adapter = TorchAdapter(
        build_demo_model(BF16, ParallelRank(), "cpu", 0),
        rank=ParallelRank(),
        device=torch.device("cpu"),
        own_device=None,
        tp_rules=DEMO_TP_RULES,
        num_layers=BF16.num_layers,
    )
    server = serve(adapter)
    yield server.address, adapter
    server.stop(grace=0)


def test_fp32_into_bf16_only_when_asked(bf16_worker: tuple[str, TorchAdapter]) -> None:
    address, adapter = bf16_worker
    fp32 = full_checkpoint(DemoConfig(), seed=3)
    with WeightPusher([address]) as pusher:
        with pytest.raises(PlanError) as refused:
            pusher.push(fp32, version=1)
        assert refused.value.kind is Reason.DTYPE_MISMATCH
        assert (
            "never converted silently" in refused.value.message
            and "cast_to=torch.bfloat16" in refused.value.message
        )
        assert pusher.status()[address].weights_version == 0

        # A generator of pairs, converted while packing.
        results = pusher.push(((n, t) for n, t in fp32.items()), version=1, cast_to=torch.bfloat16)
        assert results[address].version == 1
        state = adapter.state()
        assert all(
            state[n].dtype == torch.bfloat16 and torch.equal(state[n], t.to(torch.bfloat16))
            for n, t in fp32.items()
        )

        # The mapping form converts only the dtypes it names; bf16 tensors pass as they are.
        bf16 = {n: t.to(torch.bfloat16) for n, t in full_checkpoint(DemoConfig(), seed=4).items()}
        mixed = {**bf16, "lm_head.weight": full_checkpoint(DemoConfig(), seed=4)["lm_head.weight"]}
        pusher.push(mixed, version=2, cast_to={torch.float32: torch.bfloat16})
        assert all(torch.equal(adapter.state()[n], t) for n, t in bf16.items())


def test_cast_to_must_name_floating_point_dtypes(bf16_worker: tuple[str, TorchAdapter]) -> None:
    address, _ = bf16_worker
    with WeightPusher([address]) as pusher:
        with pytest.raises(ValueError, match="floating-point"):
            pusher.push({}, version=1, cast_to=torch.int8)
        with pytest.raises(TypeError, match=r"torch\.dtype"):
            pusher.push({}, version=1, cast_to="bfloat16")  # type: ignore[arg-type]
        # FP8 without scales would be read unscaled by the engine's kernels: refused, quantize_for named
        with pytest.raises(ValueError, match="quantize_for"):
            pusher.push({}, version=1, cast_to=torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="quantize_for"):
            pusher.push({}, version=1, cast_to={torch.bfloat16: torch.float8_e4m3fn})
