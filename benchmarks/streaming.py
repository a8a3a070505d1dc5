"""Streamed chat completions: when the text arrives. Time to the first content chunk as a fraction of the whole
request (target <= 30%), and how many content chunks come and how they spread over the request (target >= 16,
spread over generation), for a temperature-0 chat completion of ``--tokens`` tokens through the official
``openai`` client's streaming API, against an in-process worker (real HTTP on a loopback port).

Each figure is a ratio within one request, so it holds under a loaded machine. To compare with another tree (the
code before streaming as decoded), run this file with that tree first on the path and ``--out`` elsewhere:

    python benchmarks/streaming.py [--model HuggingFaceTB/SmolLM2-135M-Instruct|PATH] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import SMOLLM2, machine, serve_app  # noqa: E402
from server_mock.app import create_app  # noqa: E402
from server_mock.service.worker import WorkerService  # noqa: E402

KEY = "benchmark-key"
QUESTION = "Tell me a short story about a robot who learns to paint."


def worker_app(model: str, storage: Path):
    service = WorkerService({"model": model}, storage, "cpu", torch.float32, storage_options=None)
    return create_app(service, [KEY])


def streamed(client: openai.OpenAI, tokens: int) -> dict:
    """One streamed request: when each content chunk arrived (seconds from the request), and the whole time."""
    started = time.perf_counter()
    arrivals, text, usage = [], "", None
    stream = client.chat.completions.create(model="model", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                arrivals.append(time.perf_counter() - started)
                text += c.delta.content
    total = time.perf_counter() - started
    first = arrivals[0] if arrivals else total
    return {"total_s": total, "first_content_s": first, "first_fraction": first / total, "chunks": len(arrivals),
            # the share of chunks that arrived in the first half of the request: ~0.5 when spread over generation
            "chunks_in_first_half": sum(1 for a in arrivals if a < total / 2) / max(1, len(arrivals)),
            "completion_tokens": usage.completion_tokens if usage else None, "text": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="streamed as decoded", help="what code ran, for the results")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "streaming.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with serve_app(worker_app(args.model, Path(tmp))) as base_url:
            with openai.OpenAI(base_url=f"{base_url}/api/openai/v1", api_key=KEY, max_retries=0,
                               timeout=600) as client:
                streamed(client, 4)  # the model loaded, the first steps run once
                runs = [streamed(client, args.tokens) for _ in range(args.repeats)]
                started = time.perf_counter()
                plain = client.chat.completions.create(model="model", max_tokens=args.tokens, temperature=0,
                                                       messages=[{"role": "user", "content": QUESTION}])
                plain_s = time.perf_counter() - started
    same = all(r["text"] == plain.choices[0].message.content for r in runs)
    summary = {key: statistics.median(r[key] for r in runs)
               for key in ("total_s", "first_content_s", "first_fraction", "chunks", "chunks_in_first_half")}
    payload = {"model": args.model, "tokens": args.tokens, "label": args.label,
               "median": summary, "runs": [{k: v for k, v in r.items() if k != "text"} for r in runs],
               "unstreamed_s": plain_s, "streamed_text_equals_unstreamed": same, "machine": machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(json.dumps({k: v for k, v in payload.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
