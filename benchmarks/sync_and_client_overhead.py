"""Weight sync latency and client overhead.

* sync: ``save_weights_and_get_sampling_client()`` (an in-memory snapshot of the LoRA tensors) vs
  ``save_weights_for_sampler(name)`` (written to disk as safetensors) for a rank-32 adapter.
* client: the cost of validating and encoding a 4 x 4 x 1024-token batch (16 datums of 1024 tokens, the
  four per-token inputs) into the wire form, sending it and decoding the outputs; MB/s of the binary
  tensor encoding against the JSON number lists it replaces.

    python benchmarks/sync_and_client_overhead.py [--model HuggingFaceTB/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import SMOLLM2, median, save, timer  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import pytrio_compat as trio
    from pytrio_compat.training_client import _to_fb_output
    from pytrio_compat.validation import validate_batch
    from pytrio_compat.wire import ForwardOp, ForwardResult, WireTensor

    service = trio.ServiceClient()
    tc = service.create_lora_training_client(args.model, rank=32, seed=0)
    snapshot_t, disk_t = [], []
    for i in range(args.repeats):
        with timer(snapshot_t):
            tc.save_weights_and_get_sampling_client()
        with timer(disk_t):
            tc.save_weights_for_sampler(f"bench-{i}").result()
    service.close()

    rng = np.random.default_rng(0)
    n, length, vocab = 16, 1024, 49152
    data = [trio.Datum(model_input=trio.ModelInput.from_ints(rng.integers(0, vocab, length).tolist()),
                       loss_fn_inputs={"target_tokens": rng.integers(0, vocab, length),
                                       "logprobs": -rng.uniform(0, 5, length).astype(np.float32),
                                       "advantages": rng.normal(size=length).astype(np.float32)})
            for _ in range(n)]
    encode_t, decode_t = [], []
    for _ in range(args.repeats):
        with timer(encode_t):
            name, wire = validate_batch(data, "importance_sampling", vocab)
            body = ForwardOp(op="forward_backward", loss_fn=name, data=wire).model_dump_json()
    outputs = [{"logprobs": WireTensor.from_array(-rng.uniform(0, 5, length).astype(np.float32)).model_dump(),
                "elementwise_loss": WireTensor.from_array(rng.normal(size=length).astype(np.float32)).model_dump()}
               for _ in range(n)]
    response = json.dumps({"loss_fn_outputs": outputs, "metrics": {"loss_sum": 1.0}})
    for _ in range(args.repeats):
        with timer(decode_t):
            _to_fb_output(ForwardResult.model_validate_json(response).model_dump())
    as_lists = json.dumps([{k: v.data for k, v in d.loss_fn_inputs.items()} | {"t": d.model_input.to_ints()}
                           for d in data])
    t0 = time.perf_counter()
    json.loads(as_lists)
    list_parse = time.perf_counter() - t0
    payload_mb = len(body) / 2**20
    result = {
        "sync_in_memory_snapshot_s": median(snapshot_t), "sync_save_to_disk_s": median(disk_t),
        "batch": f"{n} datums x {length} tokens", "request_mb_binary": payload_mb,
        "request_mb_json_lists": len(as_lists) / 2**20,
        "client_encode_s": median(encode_t), "client_decode_s": median(decode_t),
        "encode_mb_per_s": payload_mb / median(encode_t), "json_list_parse_s": list_parse,
    }
    save("sync_and_client_overhead", result)
    return result


if __name__ == "__main__":
    main()
