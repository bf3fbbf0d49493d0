"""vLLM creates its expert-parallel group only where the first engine of a process serves a MoE model (the
process's parallel groups are made once). An engine in this process serving a MoE model after a dense one would
find no such group when its MoE blocks are built: ``ensure_expert_group`` makes the one-rank group then."""

from __future__ import annotations


def ensure_expert_group() -> None:
    from vllm.distributed import parallel_state

    if parallel_state._EP is not None or not parallel_state.model_parallel_is_initialized():
        return
    world = parallel_state.get_world_group()
    if world.world_size != 1:
        raise RuntimeError("interp: a MoE model after a dense one in the same process needs one rank; start it in a "
                           "fresh process")
    import torch.distributed

    backend = getattr(world, "backend", None) or torch.distributed.get_backend(world.device_group)
    parallel_state._EP = parallel_state.init_model_parallel_group([[0]], world.local_rank, backend, group_name="ep")
