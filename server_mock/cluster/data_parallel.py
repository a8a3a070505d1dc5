"""Data-parallel training of one run: split a batch by tokens, merge the ranks' results, sum gradients.

Losses are token sums, so the gradient of the whole batch is the sum of the shards' gradients and the
per-datum outputs do not depend on which rank computed them: M ranks give the single-process result.
"""

from __future__ import annotations

import re
import socket
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from server_mock.errors import WorkerError
from server_mock.training.forward_backward import call_metrics


def split_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Datum indices for each of ``parts`` shards, token counts balanced (longest first to the lightest shard).
    Each shard lists its indices in ascending order; a shard may be empty when there are fewer datums."""
    shards: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        lightest = min(range(parts), key=lambda s: (loads[s], s))
        shards[lightest].append(index)
        loads[lightest] += lengths[index]
    return [sorted(shard) for shard in shards]


def merge_results(shards: list[list[int]], results: list[dict], count: int) -> dict:
    """One forward/backward result from the shards' results, datums back in their request order."""
    outputs: list = [None] * count
    loss_sum, tokens = 0.0, 0.0
    sums: dict[str, float] = {}
    for shard, result in zip(shards, results):
        for local, index in enumerate(shard):
            outputs[index] = result["outputs"][local]
        loss_sum += result["metrics"]["loss_sum"]
        tokens += result["metrics"]["token_count"]
        for name in ("kl", "entropy"):  # with kl_coef / return_entropy
            if f"{name}_sum" in result["metrics"]:
                sums[name] = sums.get(name, 0.0) + result["metrics"][f"{name}_sum"]
    return {"outputs": outputs, "metrics": call_metrics(loss_sum, tokens, sums)}


_DATUM_INDEX = re.compile(r"^data\[(\d+)\]")


def global_error(error: WorkerError, shard: list[int]) -> WorkerError:
    """A rank's error with its ``data[i]`` (an index into its shard) rewritten to the request's index."""
    match = _DATUM_INDEX.match(error.message)
    if match is None or int(match[1]) >= len(shard):
        return error
    message = f"data[{shard[int(match[1])]}]" + error.message[match.end():]
    return WorkerError(error.status, error.code, message, error.field)


def free_address() -> str:
    """tcp://IP:PORT on this node for the ranks' rendezvous (rank 0 calls this)."""
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


def join_group(init_method: str, rank: int, world: int, device: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))


def sum_gradients(params: dict[str, torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the ranks, in place, in one all-reduce.

    A parameter with no gradient on any rank keeps none (AdamW then skips it, as in one process); one
    with a gradient on some rank gets the sum, the other ranks contributing zeros."""
    if not params:
        return
    values = list(params.values())
    device = values[0].device
    has = torch.tensor([p.grad is not None for p in values], dtype=torch.int32, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    chosen = [p for p, flag in zip(values, has.tolist()) if flag]
    if not chosen:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in chosen])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in chosen:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone()
        offset += n


def shard_data(data: list[dict[str, np.ndarray]], shard: list[int]) -> list[dict[str, np.ndarray]]:
    return [data[i] for i in shard]
