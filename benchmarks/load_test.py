"""Load test: N concurrent clients, each training its own LoRA adapter, against one worker.

Each client runs a fixed number of RL-style iterations on its own adapter:
``save_weights_and_get_sampling_client`` -> ``sample`` (2 completions, seeded) -> ``forward_backward``
(importance_sampling on what it sampled) -> ``optim_step``. Then every client's sequence is replayed alone,
one client at a time, and the two runs must agree bit for bit: the same sampled tokens and the same
``save_state`` files (adapter weights and Adam state). Any difference would mean requests leaked into
each other's adapters (cross-talk). The worker it starts runs with ``--batch-invariant``: by default the
clients' samples share mixed-adapter decode batches, whose logprobs agree with a solo run within 1e-4 but not
to the bit, and importance_sampling trains on those logprobs; in the invariant mode they are bit-identical.

Bounded and local: it starts its own worker on a tiny random model (or takes ``--base-url`` on
loopback), runs a fixed count, stops the worker and exits; non-zero exit on any error or cross-talk.

    python benchmarks/load_test.py --clients 8 --iterations 10
    python benchmarks/load_test.py --base-url http://127.0.0.1:8000 --model tiny --storage ./storage

Reports per call type the client-side latency (p50/p99/max) and, from the worker's request status,
how long requests waited in the model's queue and how long they ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytrio_compat as trio

CALLS = ("save_weights_and_get_sampling_client", "sample", "forward_backward", "optim_step")


class StatusRecorder(httpx.AsyncBaseTransport):
    """Passes every request through and keeps the worker's final status of each polled request."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.statuses: list[dict] = []
        self.max_queue_position = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not request.url.path.startswith("/v1/requests/"):
            return response
        body = await response.aread()
        if response.status_code == 200:
            status = json.loads(body)
            if status.get("queue_position") is not None:
                self.max_queue_position = max(self.max_queue_position, status["queue_position"])
            if status.get("status") in ("succeeded", "failed"):
                self.statuses.append({k: status.get(k) for k in ("kind", "queue_seconds", "run_seconds")})
        return httpx.Response(response.status_code, headers=response.headers, content=body,
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


def prompt_for(client: int, iteration: int) -> list[int]:
    rng = np.random.default_rng(client * 1000 + iteration)
    return rng.integers(10, 400, size=12).tolist()


def run_client(base_url: str, api_key: str, model: str, index: int, iterations: int, tag: str,
               latencies: dict[str, list[float]] | None, recorder: StatusRecorder | None) -> dict:
    """One client's whole sequence; returns what it sampled and where its final state was saved."""
    client = trio.ServiceClient(base_url=base_url, api_key=api_key, _transport=recorder)
    sampled = []
    try:
        tc = client.create_lora_training_client(model, rank=8, seed=1000 + index)

        def timed(name: str, fn, *args):
            start = time.perf_counter()
            value = fn(*args)
            if latencies is not None:
                latencies[name].append(time.perf_counter() - start)
            return value

        for it in range(iterations):
            prompt = prompt_for(index, it)
            sampler = timed("save_weights_and_get_sampling_client", tc.save_weights_and_get_sampling_client)
            params = trio.SamplingParams(max_tokens=8, temperature=1.0, seed=index * 1000 + it, stop=[])
            response = timed("sample", lambda s, p, sp: s.sample(trio.ModelInput.from_ints(p), num_samples=2,
                                                                 sampling_params=sp).result(), sampler, prompt, params)
            seqs = [(list(s.tokens), list(s.logprobs)) for s in response.sequences]
            sampled.append([tokens for tokens, _ in seqs])
            rewards = [float(np.mean([t % 2 == 0 for t in tokens])) for tokens, _ in seqs]
            baseline = float(np.mean(rewards))
            data = []
            for (tokens, logprobs), reward in zip(seqs, rewards):
                full = prompt + tokens
                skip = len(prompt) - 1
                data.append(trio.Datum(
                    model_input=trio.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:],
                                    "logprobs": [0.0] * skip + logprobs,
                                    "advantages": [0.0] * skip + [reward - baseline] * len(tokens)}))
            timed("forward_backward", lambda d: tc.forward_backward(d, "importance_sampling").result(), data)
            timed("optim_step", lambda: tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result())
        path = tc.save_state(f"load-{tag}-{index}").result().path
        return {"sampled": sampled, "state": path, "run": tc.training_run_id}
    finally:
        client.close()


def state_bytes(storage: Path, path: str) -> dict[str, bytes]:
    from server_mock.storage.checkpoints import CheckpointStore, parse_path

    return CheckpointStore(storage).fingerprint(parse_path(path))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(values: list[float]) -> dict:
    return {"count": len(values), "p50_ms": round(percentile(values, 50) * 1e3, 1),
            "p99_ms": round(percentile(values, 99) * 1e3, 1), "max_ms": round(max(values) * 1e3, 1) if values else None}


class LocalWorker:
    def __init__(self, threads: int, extra: tuple[str, ...] = ()) -> None:
        from server_mock.engine.tiny_model import make_tiny_model

        self.dir = Path(tempfile.mkdtemp(prefix="pytrio-load-"))
        model = make_tiny_model(self.dir / "tiny")
        self.storage = self.dir / "storage"
        port_file = self.dir / "port"
        cmd = [sys.executable, "-m", "server_mock", "serve", "--model", f"tiny={model}", "--host", "127.0.0.1",
               "--port", "0", "--port-file", str(port_file), "--storage", str(self.storage),
               "--log-level", "WARNING", *extra] + (["--threads", str(threads)] if threads else [])
        self.log = open(self.dir / "worker.log", "wb")  # noqa: SIM115 - held open for the worker's lifetime
        self.process = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("worker did not start:\n" + (self.dir / "worker.log").read_text()[-3000:])
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def run(clients: int = 8, iterations: int = 5, base_url: str | None = None, api_key: str = "",
        model: str = "tiny", storage: str | None = None, threads: int = 0, timeout: float = 900) -> dict:
    """Run the load test; returns the report (``report["ok"]`` is the verdict)."""
    if base_url and urlparse(base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("--base-url must be a loopback address: this test only talks to a local worker")
    worker = None if base_url else LocalWorker(threads, ("--batch-invariant",))  # bit for bit: see the top
    watchdog = threading.Timer(timeout, lambda: (print(f"load test: over {timeout:.0f}s, giving up", file=sys.stderr),
                                                 worker.stop() if worker else None, os._exit(3)))
    watchdog.daemon = True
    watchdog.start()
    try:
        url = base_url or worker.base_url
        store = Path(storage) if storage else (worker.storage if worker else None)
        latencies: dict[str, list[float]] = {name: [] for name in CALLS}
        recorders = [StatusRecorder() for _ in range(clients)]
        results: list[dict | None] = [None] * clients
        errors: list[str] = []

        def body(i: int) -> None:
            try:
                results[i] = run_client(url, api_key, model, i, iterations, "together", latencies, recorders[i])
            except Exception:  # noqa: BLE001 - counted and reported
                errors.append(f"client {i}: {traceback.format_exc()}")

        started = time.perf_counter()
        threads_ = [threading.Thread(target=body, args=(i,)) for i in range(clients)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        concurrent_seconds = time.perf_counter() - started

        solo_started = time.perf_counter()
        solo = []
        solo_latencies: dict[str, list[float]] = {name: [] for name in CALLS}
        for i in range(clients):  # the same sequences, one client at a time
            try:
                solo.append(run_client(url, api_key, model, i, iterations, "alone", solo_latencies, None))
            except Exception:  # noqa: BLE001
                errors.append(f"solo client {i}: {traceback.format_exc()}")
                solo.append(None)
        solo_seconds = time.perf_counter() - solo_started

        crosstalk = []
        for i, (together, alone) in enumerate(zip(results, solo)):
            if together is None or alone is None:
                continue
            if together["sampled"] != alone["sampled"]:
                crosstalk.append(f"client {i}: sampled tokens differ from its solo run")
            if store is not None:
                a, b = state_bytes(store, together["state"]), state_bytes(store, alone["state"])
                if a != b:
                    differing = [k for k in a if a.get(k) != b.get(k)]
                    crosstalk.append(f"client {i}: {len(differing)} saved tensors differ from its solo run, "
                                     f"e.g. {differing[:2]}")
        statuses = [s for r in recorders for s in r.statuses]
        queue = {}
        for kind in sorted({s["kind"] for s in statuses if s["kind"]}):
            rows = [s for s in statuses if s["kind"] == kind]
            queue[kind] = {"count": len(rows),
                           "queue_wait": summarize([s["queue_seconds"] or 0.0 for s in rows]),
                           "run": summarize([s["run_seconds"] or 0.0 for s in rows])}
        calls = clients * iterations * len(CALLS)
        report = {
            "ok": not errors and not crosstalk,
            "clients": clients, "iterations": iterations, "calls": calls,
            "errors": errors, "crosstalk": crosstalk,
            "compared_saved_state_files": store is not None,
            "concurrent_seconds": round(concurrent_seconds, 2), "solo_seconds": round(solo_seconds, 2),
            "calls_per_second_concurrent": round(calls / concurrent_seconds, 1),
            "client_latency": {name: summarize(values) for name, values in latencies.items()},
            "solo_latency": {name: summarize(values) for name, values in solo_latencies.items()},
            "worker_queue": queue,
            "max_queue_position_seen": max(r.max_queue_position for r in recorders),
            "machine": {"cpu_cores": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
        }
        return report
    finally:
        watchdog.cancel()
        if worker:
            worker.stop()


def print_report(report: dict) -> None:
    print(f"\n{report['clients']} clients x {report['iterations']} iterations = {report['calls']} calls "
          f"in {report['concurrent_seconds']} s concurrently ({report['calls_per_second_concurrent']} calls/s); "
          f"solo replay {report['solo_seconds']} s")
    print(f"{'call (client-side latency)':40s} {'n':>5s} {'p50 ms':>9s} {'p99 ms':>9s} {'max ms':>9s}"
          f" {'solo p50':>9s} {'solo p99':>9s}")
    for name, s in report["client_latency"].items():
        alone = report["solo_latency"][name]
        print(f"{name:40s} {s['count']:5d} {s['p50_ms']:9.1f} {s['p99_ms']:9.1f} {s['max_ms'] or 0:9.1f}"
              f" {alone['p50_ms']:9.1f} {alone['p99_ms']:9.1f}")
    print(f"\n{'worker request kind':28s} {'n':>5s} {'queue p50':>10s} {'queue p99':>10s} {'run p50':>9s} "
          f"{'run p99':>9s}  (ms)")
    for kind, q in report["worker_queue"].items():
        print(f"{kind:28s} {q['count']:5d} {q['queue_wait']['p50_ms']:10.1f} {q['queue_wait']['p99_ms']:10.1f} "
              f"{q['run']['p50_ms']:9.1f} {q['run']['p99_ms']:9.1f}")
    print(f"\nerrors: {len(report['errors'])}   cross-talk: {len(report['crosstalk'])} "
          f"(saved state files compared: {report['compared_saved_state_files']})   verdict: "
          f"{'OK' if report['ok'] else 'FAILED'}")
    for line in report["errors"][:3] + report["crosstalk"][:5]:
        print("  " + line.strip().splitlines()[-1] if line.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--base-url", help="a running worker on loopback (default: start one on a tiny model)")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--model", default="tiny", help="base model name on that worker")
    parser.add_argument("--storage", help="that worker's --storage folder, to compare saved state files")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the started worker")
    parser.add_argument("--timeout", type=float, default=900, help="give up (exit 3) after this many seconds")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    report = run(args.clients, args.iterations, args.base_url, args.api_key, args.model, args.storage,
                 args.threads, args.timeout)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
