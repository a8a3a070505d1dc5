"""A PyTRIO user's training and sampling, only ``import pytrio`` and PYTRIO_BASE_URL / PYTRIO_API_KEY, against a worker
whose token budget it passes (tests/operator_view/test_rate_limits.py drives the budget's clock): every call must end
with its result, never an error."""

import json
import sys
from pathlib import Path

import pytrio as trio
from pytrio import types as T

plan = json.loads(Path(sys.argv[1]).read_text())
report: dict = {}


def datum(first: int, n: int) -> T.Datum:
    ids = list(range(first, first + n + 1))
    return T.Datum(model_input=T.ModelInput.from_ints(ids[:-1]),
                   loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * n})


svc = trio.ServiceClient()
tc = svc.create_lora_training_client(plan["model"], rank=4, seed=1)
report["at_budget"] = tc.forward_backward([datum(10, n) for n in plan["first"]], "cross_entropy").result().metrics
report["past_budget"] = tc.forward_backward([datum(5, plan["second"])], "cross_entropy").result().metrics
sampler = tc.save_weights_and_get_sampling_client()
params = T.SamplingParams(max_tokens=plan["max_tokens"], seed=3, temperature=1.0, stop=[])
report["samples"] = []
for _ in range(2):
    result = sampler.sample(T.ModelInput.from_ints(plan["prompt"]), num_samples=2, sampling_params=params).result()
    report["samples"].append([list(s.tokens) for s in result.sequences])
Path(sys.argv[2]).write_text(json.dumps(report))
