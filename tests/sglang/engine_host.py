"""A real ``sglang.Engine`` in its own process, driven over stdin/stdout, for tests/sglang.

Run with the Python of an environment that has SGLang, weightwire (its ``sglang.srt.plugins``
entry point: the plugin loads the way it does for users) and the CPU shims package
(``tests/support``). The pytest process stays free of SGLang: it starts this host (with the
0.5.23 or the 0.5.17 environment), pushes with ``WeightPusher`` to the workers the plugin started
inside the engine's scheduler processes, and asks this host to generate, pause and resume.

Protocol: argv[1] is a JSON object of engine keyword arguments (``sglang.Engine(**kwargs)``).
Once the engine is up, prints one JSON line ``{"ready": true, "sglang": VERSION}``. Then each
stdin line is a JSON command ``{"op": ..., ...}``, answered by one line ``{"ok": true, "result": ...}``
or ``{"ok": false, "error": "..."}``. EOF or ``{"op": "shutdown"}`` shuts the engine down.

Ops: ``generate`` (``input_ids``, ``max_new_tokens``) -> ``{"output_ids", "weight_version",
"finish_reason"}`` per prompt; ``start_background`` (a long streamed request; answers once its
first tokens came back, so it is really running in the scheduler); ``finish_background`` (waits
for it; its finish reason); ``pause`` (``mode``); ``continue``; ``flush_cache``; ``update_weight_version``
(``version``: what ``POST /update_weight_version`` does, for the copy SGLang reports).
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from typing import Any

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Host:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.background: asyncio.Task[dict[str, Any]] | None = None

    async def handle(self, cmd: dict[str, Any]) -> Any:
        op = cmd["op"]
        tm = self.engine.tokenizer_manager
        if op == "generate":
            out = await self.engine.async_generate(
                input_ids=cmd["input_ids"],
                sampling_params={**GREEDY, "max_new_tokens": cmd["max_new_tokens"]},
            )
            return [summary(o) for o in (out if isinstance(out, list) else [out])]
        if op == "start_background":
            return await self.start_background(cmd["input_ids"], cmd["max_new_tokens"])
        if op == "finish_background":
            if self.background is None:
                raise RuntimeError("no background request")
            task, self.background = self.background, None
            return await asyncio.wait_for(task, timeout=cmd.get("timeout_s", 300))
        if op == "pause":
            from sglang.srt.managers.io_struct import PauseGenerationReqInput

            await tm.pause_generation(PauseGenerationReqInput(mode=cmd.get("mode", "abort")))
            return None
        if op == "continue":
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput

            await tm.continue_generation(ContinueGenerationReqInput())
            return None
        if op == "flush_cache":
            out = await tm.flush_cache()
            return bool(getattr(out, "success", out))
        if op == "update_weight_version":
            # What SGLang's HTTP route does; its Engine has no method for it.
            if hasattr(tm, "update_weight_version"):
                from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

                await tm.update_weight_version(
                    UpdateWeightVersionReqInput(new_version=str(cmd["version"]), abort_all_requests=False)
                )
            else:
                tm.record_config_updates("http.update_weight_version", weight_version=str(cmd["version"]))
            return None
        raise ValueError(f"unknown op {op!r}")

    async def start_background(self, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def run() -> dict[str, Any]:
            last: dict[str, Any] = {}
            try:
                gen = await self.engine.async_generate(
                    input_ids=input_ids,
                    sampling_params={**GREEDY, "max_new_tokens": max_new_tokens},
                    stream=True,
                )
                async for chunk in gen:
                    last = chunk
                    if not started.done() and len(chunk.get("output_ids") or []) >= 2:
                        started.set_result(None)
            except BaseException as e:
                if not started.done():
                    started.set_exception(e)
                raise
            if not started.done():
                started.set_exception(
                    RuntimeError(f"background request ended before it ran: {last.get('meta_info')}")
                )
            return summary(last)

        self.background = asyncio.get_running_loop().create_task(run())
        await asyncio.wait_for(asyncio.shield(started), timeout=300)
        return {"running": True}


def summary(out: dict[str, Any]) -> dict[str, Any]:
    meta = out.get("meta_info") or {}
    finish = meta.get("finish_reason")
    return {
        "output_ids": list(out.get("output_ids") or []),
        "weight_version": meta.get("weight_version"),
        "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
    }


async def serve(host: Host) -> None:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            if not line:
                return
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "shutdown":
            return
        try:
            reply({"ok": True, "result": await host.handle(cmd)})
        except Exception as e:
            reply(
                {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                }
            )


def main() -> None:
    kwargs = json.loads(sys.argv[1])
    import sglang

    engine = sglang.Engine(**kwargs)
    try:
        reply({"ready": True, "sglang": sglang.__version__})
        engine.loop.run_until_complete(serve(Host(engine)))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
