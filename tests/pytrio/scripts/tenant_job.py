"""A small training job of one PyTRIO user: three steps, a save, the user's checkpoint listing and a sample."""

import json
import sys
from pathlib import Path

import pytrio as trio
from pytrio import types as T

plan = json.loads(Path(sys.argv[1]).read_text())
svc = trio.ServiceClient()
tc = svc.create_lora_training_client(plan["model"], rank=8, seed=5)
data = [T.Datum(model_input=T.ModelInput.from_ints(r["tokens"]), loss_fn_inputs={"target_tokens": r["target_tokens"]})
        for r in plan["rows"]]
losses = []
for _ in range(3):
    fb = tc.forward_backward(data)
    step = tc.optim_step(T.AdamParams(learning_rate=1e-2))
    losses.append(fb.result().metrics["loss_sum"])
    step.result()
state = tc.save_state(plan["name"]).result().path
sampler = tc.save_weights_and_get_sampling_client()
sample = sampler.sample(T.ModelInput.from_ints(plan["rows"][0]["tokens"]), 2,
                        T.SamplingParams(max_tokens=5, seed=1, stop=[])).result()
listed = [c.path for c in svc.create_rest_client().list_user_checkpoints().result().checkpoints]
Path(sys.argv[2]).write_text(json.dumps({"losses": losses, "state": state, "listed": listed,
                                         "sample": [s.tokens for s in sample.sequences]}))
