"""``RankGroup.exchange`` between real trainer ranks (3 processes of a gloo world): every rank gets
every rank's bytes, in one collective when every record fits the slot and in two when one does not,
with sizes that differ per rank, empty records and a record of exactly the slot's room."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from weightwire.client.ranks.rank_agreement import EXCHANGE_SLOT_BYTES

WORLD = 3
ROOM = EXCHANGE_SLOT_BYTES - 8

# Per case, the size of each rank's record.
CASES: dict[str, list[int]] = {
    "small": [120, 7, 300],
    "empty": [0, 0, 0],
    "some empty": [0, 50, 0],
    "exactly the room": [ROOM, ROOM, 1],
    "one over the room": [10, ROOM + 1, 0],
    "large": [100_000, 3, 65_536],
}


def record(case: str, rank: int, size: int) -> bytes:
    seed = f"{case}:{rank}:".encode()
    return (seed * (size // len(seed) + 1))[:size]


def main() -> None:
    import torch.distributed as dist
    from weightwire.client.ranks.rank_agreement import RankGroup

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = RankGroup(dist.group.WORLD, timeout_s=60)
    gathers = 0
    inner = group._all_gather

    def counted(t, what):  # type: ignore[no-untyped-def]
        nonlocal gathers
        gathers += 1
        return inner(t, what)

    group._all_gather = counted  # type: ignore[method-assign]
    out = {}
    for case, sizes in CASES.items():
        gathers = 0
        got = group.exchange(record(case, rank, sizes[rank]), case)
        ok = got == [record(case, r, n) for r, n in enumerate(sizes)]
        out[case] = {"ok": ok, "collectives": gathers}
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def test_every_rank_gets_every_record_in_one_collective_when_they_fit() -> None:
    # Here, not at the top: each rank runs this file as a script, without the tests' helpers.
    from group_fleet import QUIET_ENV
    from helpers import rank_env
    from ports import free_port

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **QUIET_ENV, **rank_env(r, WORLD, port)},
        )
        for r in range(WORLD)
    ]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for rank, res in enumerate(results):
        for case, sizes in CASES.items():
            assert res[case]["ok"], (rank, case)
            expected = 1 if max(sizes) <= ROOM else 2
            assert res[case]["collectives"] == expected, (rank, case, res[case])


if __name__ == "__main__":
    main()
