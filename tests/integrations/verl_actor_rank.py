"""One verl actor rank of a gloo world (RANK / WORLD_SIZE / MASTER_* in the environment, as verl's
actor workers have them): builds the ``weightwire`` checkpoint engine through verl's registry, joins
the topology it is given and sends each step's full checkpoint; prints one JSON line per step.

``verl_actor_rank.py KWARGS_JSON`` with ``{"engine": {...}, "topology": {...}, "steps": [...]}``.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch.distributed as dist
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs
from weightwire.adapters.torch.demo import DemoConfig, full_checkpoint


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    import_external_libs("weightwire.integrations.verl")
    engine = CheckpointEngineRegistry.new("weightwire", bucket_size=1 << 20, **spec["engine"])
    engine.init_process_group(**spec["topology"])
    for step in spec["steps"]:
        weights = full_checkpoint(DemoConfig(), seed=step)
        metrics = asyncio.run(engine.send_weights(iter(weights.items()), global_steps=step))
        print(json.dumps({"step": step, **metrics}), flush=True)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
