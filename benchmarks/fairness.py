"""Cost-fair turns between tenants: two backlogged keys, one sending requests 8x the size of the other's, on one
model in one worker (this process): "before", the queue as it was (tenants strictly in turn by job, a
forward_backward in one go); "fair, token prices", the fair share (engine/fairness.py) priced by tokens alone, with
forward_backward in slices; "after", the same with each request's fixed price too (``--request-tokens``, by default
engine/fairness.py's REQUEST_TOKENS; ``--also-request-tokens N`` adds a phase at another).

Each key keeps ``--in-flight`` requests queued at all times (a closed loop). Over the measured window (after a
warm-up) the benchmark reads the queue's books: the cost served to each key at the documented prices, their ratio
(1.0 is fair; with the fixed prices at ``--request-tokens``, and of the token costs alone), the throughput (cost
served a second, each phase over "before", overall and round by round), and how long requests waited in the queue:
the two keys' (each waits behind its own backlog too) and a third key's, the probe, which sends a small sample
now and then and is idle in between (target: within one decode slice, ``--slice`` seconds). Throughput is the cost
served a second, both keys together, fixed prices included: when those are right, cost is model time and the
figure does not move with the mix of small and large requests. The phases alternate, ``--rounds`` times, so that
the load of a shared machine hits them alike.

    python benchmarks/fairness.py [--scenario train|sample|both|none] [--seconds 20] [--prices]
                                  [--model smollm2-shape|PATH]

``--prices`` first measures the per-token model time of a trained token (forward_backward), a prefill token
(a forward op's datums) and a decoded token (sample rows), relative to a prefill token, and a request's fixed time
(the intercept of its time against its tokens): the numbers behind the prices in engine/fairness.py
(docs/operations.md).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import save  # noqa: E402
from pytrio_compat.wire import CreateSampler, CreateTrainingRun, LoraSpec, SampleRequest  # noqa: E402
from pytrio_compat.wire import WireSamplingParams  # noqa: E402
from server_mock.config import Limits, StorageOptions, TrainOptions  # noqa: E402
from server_mock.engine.fairness import REQUEST_TOKENS, FairShare, Prices, RoundRobin  # noqa: E402
from server_mock.engine.jobs import job_result  # noqa: E402
from server_mock.service.ops import ForwardBatch  # noqa: E402
from server_mock.service.worker import WorkerService  # noqa: E402


def _datums(vocab: int, n: int, length: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(10, vocab - 1, length + 1)
        out.append({"tokens": ids[:-1].astype(np.int64), "target_tokens": ids[1:].astype(np.int64)})
    return out


class Tenant:
    """One key's closed loop: ``in_flight`` requests queued at all times, each from ``submit()``."""

    def __init__(self, name: str, submit, pause: float = 0.0) -> None:
        self.name, self.submit, self.pause = name, submit, pause
        self.jobs: list = []

    async def loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.pause:  # an occasional request (the probe): the key is idle in between
                await asyncio.sleep(self.pause)
            job = await self.submit()
            self.jobs.append(job)
            try:
                await job_result(job)
            except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not stop
                print(f"{self.name}: {exc}", file=sys.stderr)


async def _phase(service: WorkerService, tenants: list[Tenant], policy, sliced: bool, warmup: float,
                 seconds: float, in_flight: int, kind: str) -> dict:
    """One measured window: the cost served to each key over it, and the queue waits of its requests."""
    queue = service.models.queue("m")
    queue.policy, queue.slice_jobs = policy, sliced
    for tenant in tenants:
        tenant.jobs = []
    stop = asyncio.Event()
    loops = [asyncio.create_task(t.loop(stop)) for t in tenants for _ in range(1 if t.pause else in_flight)]
    await asyncio.sleep(warmup)
    first, t0 = queue.fairness(), time.monotonic()
    await asyncio.sleep(seconds)
    last, t1 = queue.fairness(), time.monotonic()
    stop.set()
    await asyncio.gather(*loops)
    def delta(name: str, what: str) -> float:
        return last.get(name, {}).get(what, 0.0) - first.get(name, {}).get(what, 0.0)

    # the token cost alone: what the books served less the requests' fixed prices this phase's policy charged
    fixed = policy.prices.of_request(kind)
    tokens = {t.name: delta(t.name, "served_cost") - fixed * delta(t.name, "requests") for t in tenants}
    requests = {t.name: delta(t.name, "requests") if fixed else
                sum(1 for j in t.jobs if j.started is not None and t0 <= j.started <= t1) for t in tenants}
    waits = {t.name: [j.started - j.created for j in t.jobs if j.started is not None and t0 <= j.created <= t1]
             for t in tenants}
    return {"window_s": t1 - t0, "token_cost": tokens, "requests": requests, "waits": waits}


def _summary(parts: list[dict], fixed: float) -> dict:
    """A phase over its rounds: the cost served to the two keys, with each request's fixed price (``fixed``, the
    same for every phase, whatever its policy charged) and without, their ratios, throughput and queue waits."""
    window = sum(p["window_s"] for p in parts)
    names = [name for name in parts[0]["token_cost"] if name != "probe"]
    tokens = {name: sum(p["token_cost"][name] for p in parts) for name in names}
    requests = {name: sum(p["requests"][name] for p in parts) for name in names}
    served = {name: tokens[name] + fixed * requests[name] for name in names}
    waits = {}
    for name in parts[0]["waits"]:
        w = [x for p in parts for x in p["waits"][name]]
        waits[name] = {"p50_s": statistics.median(w) if w else None,
                       "p90_s": float(np.percentile(w, 90)) if w else None,
                       "max_s": max(w) if w else None, "requests": len(w)}
    out = {"window_s": window, "served_cost": served, "token_cost": tokens, "requests": requests,
           "cost_per_s": sum(served.values()) / window, "token_cost_per_s": sum(tokens.values()) / window,
           "queue_wait": waits}
    if len(served) == 2:
        out["ratio_heavy_over_light"] = served["heavy"] / served["light"] if served["light"] else None
        out["token_ratio_heavy_over_light"] = tokens["heavy"] / tokens["light"] if tokens["light"] else None
    return out


async def _scenario(service: WorkerService, kind: str, args) -> dict:
    host = service.models.loaded("m")
    vocab = host.vocab_size
    if kind == "train":
        runs = {}
        for name in ("heavy", "light"):
            runs[name] = await service.runs.create(CreateTrainingRun(base_model="m", lora=LoraSpec(rank=8)), name)
        sizes = {"heavy": 8 * args.datums, "light": args.datums}

        def submitter(name: str):
            data = _datums(vocab, sizes[name], args.datum_tokens, seed=len(name))

            async def submit():
                prepared = await asyncio.to_thread(service.runs.prepare, runs[name],
                                                   ForwardBatch("cross_entropy", data, True))
                return service.runs.submit(runs[name].run_id, prepared, name, seq_id=None).job
            return submit
        shape = {"datum_tokens": args.datum_tokens, "datums": sizes, "micro_batch_tokens": args.micro_batch_tokens}
    else:
        samplers = {name: (await service.samplers.create(CreateSampler(base_model="m"), name)).sampler_id
                    for name in ("heavy", "light")}
        sizes = {"heavy": 8 * args.sample_tokens, "light": args.sample_tokens}

        def submitter(name: str):
            body = SampleRequest(prompt_tokens=list(range(5, 5 + args.prompt_tokens)), num_samples=args.rows,
                                 sampling_params=WireSamplingParams(max_tokens=sizes[name], temperature=1.0, seed=1,
                                                                    stop=[]))

            async def submit():
                return service.samplers.submit(samplers[name], body, name)
            return submit
        shape = {"prompt_tokens": args.prompt_tokens, "rows": args.rows, "max_tokens": sizes}
    heavy, light = Tenant("heavy", submitter("heavy")), Tenant("light", submitter("light"))
    # a third key's small sample now and then (one at a time, idle in between): how long a request of a key
    # that is not backlogged waits behind the two that are (target: one decode slice)
    probe_sampler = (await service.samplers.create(CreateSampler(base_model="m"), "probe")).sampler_id
    probe_body = SampleRequest(prompt_tokens=list(range(5, 13)), num_samples=1,
                               sampling_params=WireSamplingParams(max_tokens=4, temperature=1.0, seed=1, stop=[]))

    async def probe_submit():
        return service.samplers.submit(probe_sampler, probe_body, "probe")
    probe = Tenant("probe", probe_submit, pause=args.probe_every)
    # the phases interleaved round by round, so that the load of a shared machine hits them alike: the queue as it
    # was (tenants in turn by job, forward ops in one go), the fair share priced by tokens alone, and the fair share
    # with each request's fixed price too (both with forward ops in slices)
    prices = Prices(request_tokens=args.request_tokens)
    job_kind = "forward_backward" if kind == "train" else "sample"
    phases = {"before": (RoundRobin(prices), False),
              "fair, token prices": (FairShare(replace(prices, request_tokens=0.0)), True),
              "after": (FairShare(prices), True)}
    if args.unsliced_too:  # the fair share with forward ops in one go: what the slicing itself costs
        phases["after, unsliced"] = (FairShare(prices), False)
    for other in args.also_request_tokens:  # the fair share at another fixed price (served cost still read at ours)
        phases[f"after, request_tokens={other:g}"] = (FairShare(replace(prices, request_tokens=other)), True)
    parts: dict[str, list[dict]] = {label: [] for label in phases}
    for _ in range(args.rounds):
        for label, (policy, sliced) in phases.items():
            parts[label].append(await _phase(service, [heavy, light, probe], policy.copy(), sliced, args.warmup,
                                             args.seconds / args.rounds, args.in_flight, job_kind))
    fixed = prices.of_request(job_kind)
    out = {"scenario": kind, "shape": shape, "request_price": fixed}
    for label in phases:
        out[label] = _summary(parts[label], fixed)
    before = out["before"]
    out["over_before"] = {label: {"cost_per_s": out[label]["cost_per_s"] / before["cost_per_s"],
                                  "token_cost_per_s": out[label]["token_cost_per_s"] / before["token_cost_per_s"],
                                  "per_round": [sum(p["token_cost"][n] + fixed * p["requests"][n]
                                                    for n in ("heavy", "light")) / p["window_s"]
                                                / (sum(b["token_cost"][n] + fixed * b["requests"][n]
                                                       for n in ("heavy", "light")) / b["window_s"])
                                                for p, b in zip(parts[label], parts["before"])]}
                          for label in phases if label != "before"}
    return out


async def _prices(service: WorkerService, args) -> dict:
    """Seconds per token: trained (forward_backward), prefill (forward op), decoded (sample rows at --rows); and
    the fixed seconds of a request, whatever its tokens: the intercept of a request's time against its tokens (a
    forward op of one datum of --tiny-tokens against one of --datums x --datum-tokens; a sample of 4 tokens against
    its per-token decode and prefill time), on the model thread (``time/run``) and end to end (``wall``: checking
    the datums, queueing, running, encoding, waking the client)."""
    host = service.models.loaded("m")
    run = await service.runs.create(CreateTrainingRun(base_model="m", lora=LoraSpec(rank=8)), "prices")
    sampler = (await service.samplers.create(CreateSampler(base_model="m"), "prices")).sampler_id
    data = _datums(host.vocab_size, args.datums, args.datum_tokens, seed=9)
    tiny = _datums(host.vocab_size, 1, args.tiny_tokens, seed=10)
    tokens = sum(len(d["tokens"]) for d in data)
    times = {"train": [], "prefill": [], "decode": []}
    fixed = {"train_run": [], "train_wall": [], "prefill_run": [], "prefill_wall": [], "sample_wall": []}

    async def forward(backward: bool, datums: list[dict] = data) -> tuple[float, float]:
        started = time.perf_counter()
        prepared = await asyncio.to_thread(service.runs.prepare, run, ForwardBatch("cross_entropy", datums, backward))
        result = await job_result(service.runs.submit(run.run_id, prepared, "prices", seq_id=None).job)
        return result["metrics"]["time/run"], time.perf_counter() - started

    async def sample(max_tokens: int) -> float:
        body = SampleRequest(prompt_tokens=list(range(5, 5 + args.prompt_tokens)), num_samples=args.rows,
                             sampling_params=WireSamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1,
                                                                stop=[]))
        started = time.perf_counter()
        await job_result(service.samplers.submit(sampler, body, "prices"))
        return time.perf_counter() - started

    def intercept(big: tuple[float, float], small: tuple[float, float], which: int) -> float:
        """The fixed seconds of a request: t = fixed + n x per-token, from a request of ``tokens`` and one of
        --tiny-tokens."""
        slope = (big[which] - small[which]) / (tokens - args.tiny_tokens)
        return small[which] - slope * args.tiny_tokens

    await forward(True)
    await forward(True, tiny)
    await sample(4)
    for _ in range(args.price_rounds):  # interleaved, so that load changes hit all three alike
        train, train_tiny = await forward(True), await forward(True, tiny)
        prefill, prefill_tiny = await forward(False), await forward(False, tiny)
        times["train"].append(train[0] / tokens)
        times["prefill"].append(prefill[0] / tokens)
        fixed["train_run"].append(intercept(train, train_tiny, 0))
        fixed["train_wall"].append(intercept(train, train_tiny, 1))
        fixed["prefill_run"].append(intercept(prefill, prefill_tiny, 0))
        fixed["prefill_wall"].append(intercept(prefill, prefill_tiny, 1))
        long, short = await sample(4 + args.sample_tokens), await sample(4)  # the difference: decode steps only
        step = max(long - short, 1e-9) / args.sample_tokens
        times["decode"].append(step / args.rows)
        fixed["sample_wall"].append(short - 4 * step - args.rows * args.prompt_tokens * times["prefill"][-1])
    per_token = {k: statistics.median(v) for k, v in times.items()}
    per_request = {k: statistics.median(v) for k, v in fixed.items()}
    return {"seconds_per_token": per_token,
            "relative_to_prefill": {k: v / per_token["prefill"] for k, v in per_token.items()},
            "fixed_seconds_per_request": per_request,
            "fixed_per_request_in_prefill_tokens": {k: v / per_token["prefill"] for k, v in per_request.items()},
            "shape": {"datums": args.datums, "datum_tokens": args.datum_tokens, "rows": args.rows,
                      "decode_tokens": args.sample_tokens, "tiny_tokens": args.tiny_tokens,
                      "rounds": args.price_rounds}}


def smollm2_shaped(directory: Path) -> Path:
    """A random-weight model of SmolLM2-135M's shape (Llama, hidden 576, MLP 1536, 30 layers, 9/3 heads, tied
    head), with the tiny tokenizer (so its vocabulary, and its head, are small): the per-token costs of a real
    model's body, on a machine that cannot download one."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from server_mock.engine.tiny_model import EOS_TOKEN_ID, IM_START_TOKEN_ID, PAD_TOKEN_ID, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=IM_START_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
                         pad_token_id=PAD_TOKEN_ID)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS_TOKEN_ID, PAD_TOKEN_ID
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


async def main_async(args) -> dict:
    model = args.model
    if model == "smollm2-shape":
        model = str(smollm2_shaped(Path(tempfile.mkdtemp()) / "smollm2-shape"))
    elif model is None:
        from server_mock.engine.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    # closed loops of forward_backward with no optim_step: more pending forward ops than a worker allows by default
    limits = Limits(decode_slice_seconds=args.slice, max_pending_forward_ops=1_000_000)
    service = WorkerService({"m": model}, tempfile.mkdtemp(), "cpu", torch.float32, limits=limits,
                            train_options=TrainOptions(micro_batch_tokens=args.micro_batch_tokens),
                            storage_options=StorageOptions(durability=args.durability))
    out = {"model": args.model or "tiny (random weights)", "slice_s": args.slice, "durability": args.durability}
    try:
        await service.models.host("m")
        if args.prices:
            out["prices"] = await _prices(service, args)
        kinds = {"both": ["train", "sample"], "none": []}.get(args.scenario, [args.scenario])
        out["scenarios"] = [await _scenario(service, kind, args) for kind in kinds]
    finally:
        service.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=["train", "sample", "both", "none"], default="both")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per phase (over all rounds)")
    parser.add_argument("--rounds", type=int, default=2, help="the two phases alternate, this many times each")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each window")
    parser.add_argument("--in-flight", type=int, default=4, help="requests each key keeps queued")
    parser.add_argument("--datums", type=int, default=4, help="the light key's datums (the heavy key sends 8x)")
    parser.add_argument("--datum-tokens", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=256)
    parser.add_argument("--sample-tokens", type=int, default=16, help="the light key's max_tokens (heavy: 8x)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4, help="num_samples per sample request")
    parser.add_argument("--slice", type=float, default=0.5, help="decode slice seconds")
    parser.add_argument("--probe-every", type=float, default=0.3, help="seconds between the probe key's requests")
    parser.add_argument("--prices", action="store_true", help="measure the per-token prices first")
    parser.add_argument("--request-tokens", type=float, default=REQUEST_TOKENS,
                        help="a request's fixed price, in tokens of its kind (engine/fairness.py REQUEST_TOKENS)")
    parser.add_argument("--also-request-tokens", type=float, action="append", default=[],
                        help="also a phase of the fair share at this fixed price (repeatable)")
    parser.add_argument("--unsliced-too", action="store_true",
                        help="also the fair share with forward ops in one go (what slicing costs)")
    parser.add_argument("--price-rounds", type=int, default=5)
    parser.add_argument("--tiny-tokens", type=int, default=4,
                        help="--prices: the tokens of the one-datum request whose time is mostly fixed cost")
    parser.add_argument("--model", help="a model folder, or smollm2-shape (SmolLM2-135M's shape, random weights; "
                                        "default: the tiny random model)")
    parser.add_argument("--out", default="fairness", help="results/<OUT>.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--durability", choices=["full", "checkpoint-only"], default="full",
                        help="the worker's --durability (full: every op journaled, as served by default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = asyncio.run(main_async(args))
    save(args.out, out)


if __name__ == "__main__":
    main()
