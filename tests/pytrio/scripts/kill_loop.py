"""A GRPO-shaped loop written as a PyTRIO user writes it (only ``import pytrio``, configured by PYTRIO_BASE_URL and
PYTRIO_API_KEY): weights for a sampler, seeded samples, forward_backward and optim_step sent together, then
save_state. Run by tests/pytrio/test_pytrio_kill_restart.py against a worker that is killed and restarted meanwhile;
it writes the sampled tokens, the metrics and the final checkpoint's path."""

import json
import sys
from pathlib import Path

import pytrio as trio
from pytrio import types as T

plan = json.loads(Path(sys.argv[1]).read_text())
out_path = Path(sys.argv[2])


def datum(tokens: list[int]) -> T.Datum:
    return T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


svc = trio.ServiceClient()
tc = svc.create_lora_training_client(plan["model"], rank=4, seed=5)
report: dict = {"tokens": [], "metrics": [], "optim": []}
for step, (prompt, batch) in enumerate(zip(plan["prompts"], plan["batches"])):
    sampler = tc.save_weights_and_get_sampling_client()
    params = T.SamplingParams(max_tokens=4, seed=11 + step, temperature=1.0, stop=[])
    group = sampler.sample(T.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    report["tokens"] += [list(s.tokens) for s in group.sequences]
    fwd = tc.forward_backward([datum(row) for row in batch], "cross_entropy")
    opt = tc.optim_step(T.AdamParams(learning_rate=1e-2))
    report["metrics"].append(fwd.result().metrics)
    report["optim"].append(opt.result().metrics)
report["path"] = tc.save_state("final").result().path
out_path.write_text(json.dumps(report))
