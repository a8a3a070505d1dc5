"""The worker's Prometheus metrics (``GET /metrics``, docs/operations.md): one registry per service, never the
library's global one, so that several workers in one process (the tests) keep their own.

Counters and histograms are updated where things happen (service/usage.py for the model queues, the operator's
HTTP middleware for answers); what is a state rather than an event (queue depth, adapters resident, memory) is read
from the service when Prometheus scrapes. Labels stay few: ``tenant`` is the caller's tenant id (``tenant-`` and 16
hex digits of the key's SHA-256, the id ``/v1/whoami`` answers; never the key), one per configured key; ``op`` a
training or sampling op, or ``control`` for the rest (``OPS``; the queue-depth gauge names every job kind);
``protocol`` one of the five front ends; ``code`` an HTTP status or an error code of the worker's.
"""

from __future__ import annotations

import os

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest

PREFIX = "pytrio_worker"
WORKER = "(worker)"  # the tenant label of the worker's own jobs (loading a model's layout)
# few buckets and a fixed set of op labels: a histogram's series are what a scrape spends its time on
SECONDS = (0.01, 0.05, 0.25, 1.0, 2.5, 10.0, 30.0, 120.0)
ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
ADAPTERS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
OPS = ("forward_backward", "forward", "optim_step", "sample", "save_state", "save_weights_for_sampler", "load_state")
OTHER_OP = "control"  # creating and deleting runs, reading a model's layout, exports, restores
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def tenant_label(owner: str) -> str:
    return owner or WORKER


def op_label(kind: str) -> str:
    return kind if kind in OPS else OTHER_OP


class Metrics:
    """The registry and its families. ``watch(service)`` adds the ones read at scrape time."""

    def __init__(self) -> None:
        # no ``*_created`` series beside every counter and histogram (as vLLM does): they double what a scrape
        # renders and Prometheus does not need them. The switch is the library's, for the whole process.
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP answers, by protocol and status code",
                                ["protocol", "code"], registry=r)
        self.op_duration = Histogram(f"{PREFIX}_op_duration_seconds", "seconds an op ran on the model (from being "
                                     "taken off the queue to its result, encoding included)", ["op"],
                                     buckets=SECONDS, registry=r)
        self.queue_wait = Histogram(f"{PREFIX}_queue_wait_seconds", "seconds an op waited in the queue before the "
                                    "model took it", ["op"], buckets=SECONDS, registry=r)
        self.train_tokens = Counter(f"{PREFIX}_train_tokens", "tokens of the datums of forward_backward ops that "
                                    "ran", ["tenant"], registry=r)
        self.prefill_tokens = Counter(f"{PREFIX}_prefill_tokens", "tokens run forward without training: sample "
                                      "prompts (once per request) and forward ops' datums", ["tenant"], registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens returned by sample requests",
                                         ["tenant"], registry=r)
        self.batch_rows = Histogram(f"{PREFIX}_batch_rows", "rows the model ran together: the sample rows of a "
                                    "decode batch, or the datums of a forward op", buckets=ROWS, registry=r)
        self.batch_adapters = Histogram(f"{PREFIX}_batch_adapters", "distinct sets of weights the model ran together "
                                        "in one batch (a decode batch's adapters, the base model counting as one)",
                                        buckets=ADAPTERS, registry=r)
        self.errors = Counter(f"{PREFIX}_errors", "requests refused and ops failed, by tenant and error code "
                              "(rate_limited: over --tokens-per-minute)", ["tenant", "code"], registry=r)
        self.rate_limited = Counter(f"{PREFIX}_rate_limited", "requests over their key's --tokens-per-minute: "
                                    "refused with 429, or (PyTRIO training events) held until the budget allows",
                                    ["tenant"], registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, open fds
        self._watching = False

    def watch(self, service) -> None:
        """Add the families read from ``service`` at each scrape (once)."""
        if not self._watching:
            self.registry.register(_ServiceState(service))
            self._watching = True

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ServiceState:
    """Queue depth, the fair share's books, adapters resident and memory, read from the service when scraped."""

    def __init__(self, service) -> None:
        self.service = service

    def describe(self):
        return []  # families are made at collect time; nothing to check at registration

    def collect(self):
        service = self.service
        depth = GaugeMetricFamily(f"{PREFIX}_queue_depth", "jobs waiting in the model queues, by tenant and op",
                                  labels=["tenant", "op"])
        waiting: dict[tuple[str, str], int] = {}
        for queue in list(service.models.queues.values()):
            for (owner, kind), count in queue.waiting().items():
                key = (tenant_label(owner), kind)
                waiting[key] = waiting.get(key, 0) + count
        for (tenant, op), count in sorted(waiting.items()):
            depth.add_metric([tenant, op], count)
        yield depth
        counter = GaugeMetricFamily(f"{PREFIX}_fair_share_counter", "each tenant's virtual counter in a model "
                                    "queue's fair share: cost served divided by its weight, lifted to the others' "
                                    "least when it comes back (the least goes next; docs/operations.md)",
                                    labels=["queue", "tenant"])
        served = GaugeMetricFamily(f"{PREFIX}_served_cost", "cost a model queue served each tenant: train, "
                                   "prefill and decode tokens at the fair-share prices (docs/operations.md)",
                                   labels=["queue", "tenant"])
        for name, queue in sorted(service.models.queues.items()):
            for owner, books in queue.fairness().items():
                counter.add_metric([name, tenant_label(owner)], books["counter"])
                served.add_metric([name, tenant_label(owner)], books["served_cost"])
        yield counter
        yield served
        adapters = GaugeMetricFamily(f"{PREFIX}_adapters_resident", "LoRA adapters held in memory: training runs' "
                                     "adapters and in-memory sampler snapshots", labels=["kind"])
        adapters.add_metric(["training"], len(service.runs))
        adapters.add_metric(["snapshot"], len(service.checkpoints.snapshots))
        yield adapters
        held = GaugeMetricFamily(f"{PREFIX}_adapter_memory_bytes", "bytes the training runs' adapters hold (weights, "
                                 "gradients, AdamW moments) and the adapter pools' resident sampler adapters: the "
                                 "--max-adapter-bytes-total accounting")
        held.add_metric([], service.adapter_memory.held)
        yield held
        device = GaugeMetricFamily(f"{PREFIX}_device_memory_bytes", "memory of the accelerator the models run on "
                                   "(torch's allocator: allocated, reserved, peak allocated); none on the CPU",
                                   labels=["device", "kind"])
        for name, kind, value in device_memory(service.models.device):
            device.add_metric([name, kind], value)
        yield device


def device_memory(device: str) -> list[tuple[str, str, int]]:
    """(device, kind, bytes) of torch's CUDA allocator for ``device``; [] on the CPU."""
    if not device.startswith("cuda"):
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    index = torch.device(device).index or 0
    name = f"cuda:{index}"
    return [(name, "allocated", int(torch.cuda.memory_allocated(index))),
            (name, "reserved", int(torch.cuda.memory_reserved(index))),
            (name, "peak", int(torch.cuda.max_memory_allocated(index)))]


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
