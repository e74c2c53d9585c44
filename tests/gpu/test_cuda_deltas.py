"""Delta updates from CUDA tensors into a worker whose weights are on CUDA (one GPU): the result
checksum is the weighted sum, computed by the trainer from the changed elements on the GPU and
verified by the worker on its GPU, with no copy of a tensor to the host for a CRC. A real gRPC
worker (the demo model in bf16 on ``cuda:0``, in this process: inline bytes need no second
process), fp32 master weights on the GPU with a real AdamW step between pushes, bf16 sent inline (a
CUDA worker takes host bytes only inline or over a transfer group); the trainer's base (what it last sent) on the host (the default) and on the GPU
(``delta_keeper.device_budget_bytes``). After each push the worker holds the trainer's bf16 bits; a norm changed behind the
trainer's back fails the delta with ``DELTA_RESULT_MISMATCH`` and the next push goes FULL.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gpu_procs import needs_gpus

pytestmark = [pytest.mark.gpu, needs_gpus(1)]


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    from helpers import InProcessWorker
    from weightwire.adapters.torch import TorchAdapter
    from weightwire.adapters.torch.demo import DEMO_TP_RULES, DemoConfig, build_demo_model
    from weightwire.core.manifest import ParallelRank
    from weightwire.server import serve

    config = DemoConfig(dtype=torch.bfloat16)
    device = torch.device("cuda", 0)
    adapter = TorchAdapter(
        build_demo_model(config, ParallelRank(), device, 0),
        rank=ParallelRank(),
        device=device,
        own_device=None,
        tp_rules=DEMO_TP_RULES,
        num_layers=config.num_layers,
    )
    running = InProcessWorker(serve(adapter), adapter, ParallelRank(), config)  # type: ignore[arg-type]
    yield running
    running.server.stop(grace=0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("device_budget", [0, 1 << 30], ids=["base-on-host", "base-on-gpu"])
def test_cuda_deltas_are_checked_on_the_gpu_with_the_weighted_sum(worker: Any, device_budget: int) -> None:
    from helpers import delta_algorithms_sent
    from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint
    from weightwire.client import WeightPusher
    from weightwire.core.errors import PushError, Reason
    from weightwire.v1 import weight_transfer_pb2 as pb

    device = torch.device("cuda", 0)
    params = {n: torch.nn.Parameter(t.to(device)) for n, t in full_checkpoint(DemoConfig(), seed=3).items()}
    opt = torch.optim.AdamW(params.values(), lr=2e-6, weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> None:
        opt.zero_grad()
        loss = sum(
            ((p - torch.randn(p.shape, generator=gen, device=device) * 0.02) ** 2).mean()
            for p in params.values()
        )
        loss.backward()  # type: ignore[union-attr]
        opt.step()

    def assert_holds() -> None:
        state = worker.adapter.state()
        for n, p in params.items():
            want = p.detach().to(torch.bfloat16).view(torch.int16)
            assert torch.equal(state[n].view(torch.int16), want), n

    with WeightPusher([worker.address], transport="inline") as pusher:
        (manifest,) = pusher.manifests().values()
        assert manifest.device.kind == pb.DEVICE_KIND_CUDA
        keeper = pusher.delta_keeper
        keeper.device_budget_bytes = device_budget
        v = 10 if device_budget else 0  # the module's one worker only takes newer versions
        seen = delta_algorithms_sent(pusher)
        (r,) = pusher.push(params.items(), version=v + 1, cast_to=torch.bfloat16, delta=True).values()
        assert (r.encoding, r.delta_fallback) == ("FULL", "NO_BASE")
        for version in (v + 2, v + 3, v + 4):
            step()
            (r,) = pusher.push(params.items(), version=version, cast_to=torch.bfloat16, delta=True).values()
            assert r.encoding == "DELTA"
            status = worker.stub().GetStatus(pb.GetStatusRequest())
            assert status.last_result.result_checksums_verified == len(params)
            assert_holds()
        assert seen == [pb.CHECKSUM_ALGORITHM_WEIGHTED_SUM64] * 3
        assert (keeper.memory().device_bytes > 0) == (device_budget > 0)

        with torch.no_grad():
            worker.adapter.state()["model.layers.0.input_layernorm.weight"].view(-1)[0] += 1.0
        step()
        with pytest.raises(PushError) as raised:
            pusher.push(params.items(), version=v + 5, cast_to=torch.bfloat16, delta=True)
        assert any(e.kind is Reason.DELTA_RESULT_MISMATCH for e in raised.value.failures.values())
        assert worker.stub().GetStatus(pb.GetStatusRequest()).weights_version == v + 4
        (r,) = pusher.push(params.items(), version=v + 6, cast_to=torch.bfloat16, delta=True).values()
        assert (r.encoding, r.delta_fallback) == ("FULL", "NO_BASE")
        assert_holds()
