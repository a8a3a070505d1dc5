"""The Vision GRPO calls of the PyTRIO course through the official SDK (only ``import pytrio``): a group sampled
from an image + text ``ModelInput``, forward on image + text datums built from it (the sampler's logprobs against
the trainer's), forward_backward and optim_step. Run by tests/e2e/test_vlm_images.py with the prompt's pieces in a
JSON file; writes what it saw to another."""

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytrio as trio
from pytrio import types as T

plan = json.loads(Path(sys.argv[1]).read_text())
out_path = Path(sys.argv[2])
report: dict = {}

svc = trio.ServiceClient()
tc = svc.create_lora_training_client(plan["model"], rank=4, seed=3)
image = T.ImageChunk(data=base64.b64decode(plan["image"]), format="png", expected_tokens=plan["expected_tokens"])
chunks = [T.EncodedTextChunk(tokens=plan["before"]), image, T.EncodedTextChunk(tokens=plan["after"])]
prompt = T.ModelInput(chunks=chunks)
sampler = tc.save_weights_and_get_sampling_client()
group = sampler.sample(prompt, num_samples=4, sampling_params=T.SamplingParams(max_tokens=6, seed=5, stop=[])).result()
report["input_tokens"] = getattr(group, "input_tokens", None)
report["sequences"] = [{"tokens": list(s.tokens), "logprobs": list(s.logprobs)} for s in group.sequences]
n_prompt = prompt.length
data = []
for s in group.sequences:
    full = T.ModelInput(chunks=chunks + [T.EncodedTextChunk(tokens=list(s.tokens[:-1]))])
    targets = [0] * (n_prompt - 1) + list(s.tokens)
    weights = [0.0] * (n_prompt - 1) + [1.0] * len(s.tokens)
    data.append(T.Datum(model_input=full, loss_fn_inputs={"target_tokens": targets, "weights": weights}))
out = tc.forward(data, "cross_entropy").result()
report["trainer"] = [np.asarray(o["logprobs"].data, dtype=np.float64)[n_prompt - 1:].tolist()
                     for o in out.loss_fn_outputs]
tc.forward_backward(data, "cross_entropy").result()
tc.optim_step(T.AdamParams(learning_rate=5e-3)).result()
after = tc.forward(data[:1], "cross_entropy").result()
report["after"] = np.asarray(after.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)[n_prompt - 1:].tolist()
wrong = T.ImageChunk(data=image.data, format="png", expected_tokens=plan["expected_tokens"] + 1)
try:
    sampler.sample(T.ModelInput(chunks=[chunks[0], wrong, chunks[2]]), num_samples=1,
                   sampling_params=T.SamplingParams(max_tokens=2)).result()
    report["mismatch"] = None
except Exception as error:  # noqa: BLE001 - reported by its text
    report["mismatch"] = str(error)
out_path.write_text(json.dumps(report))
