"""For each case: two forward_backward calls and one optim_step on a new LoRA client of the unmodified SDK, whose run
limits (from the worker) make it split each call into one event per datum; reports the metrics it aggregated and
how many events it sent."""

import json
import sys
from pathlib import Path

import numpy as np
import pytrio as trio
from pytrio import types as T

plan = json.loads(Path(sys.argv[1]).read_text())


def datum(row: dict) -> T.Datum:
    return T.Datum(model_input=T.ModelInput.from_ints(row["tokens"]),
                   loss_fn_inputs={k: v for k, v in row.items() if k != "tokens"})


svc = trio.ServiceClient()
reports = []
for case in plan["cases"]:
    tc = svc.create_lora_training_client(plan["model"], rank=8, seed=7)
    report = {"limits": [tc._limits.max_batch_size, tc._limits.max_tokens_per_request], "calls": []}
    for rows in case["calls"]:
        result = tc.forward_backward([datum(r) for r in rows], case["loss"]).result()
        coordinator = tc._actor_binding.coordinator  # read only: how many events the SDK has sent so far
        report["calls"].append({"metrics": result.metrics, "next_index": coordinator.index,
                                "logprobs": [np.asarray(o["logprobs"].data).tolist() for o in result.loss_fn_outputs]})
    report["optim"] = tc.optim_step(T.AdamParams(learning_rate=1e-2)).result().metrics
    probe = tc.forward([datum(plan["probe"])], "cross_entropy").result()
    report["probe"] = np.asarray(probe.loss_fn_outputs[0]["logprobs"].data).tolist()
    reports.append(report)
Path(sys.argv[2]).write_text(json.dumps(reports))
