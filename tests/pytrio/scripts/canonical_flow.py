"""The canonical PyTRIO flow, written as a PyTRIO user writes it: only ``import pytrio``, configured by the
PYTRIO_BASE_URL and PYTRIO_API_KEY environment variables. Run by tests/pytrio/test_pytrio_sdk.py, which gives it
the data (token ids) in a JSON file and checks what it writes to another."""

import json
import sys
from pathlib import Path

import numpy as np
import pytrio as trio
import torch
from pytrio import types as T

plan = json.loads(Path(sys.argv[1]).read_text())
out_path = Path(sys.argv[2])
report: dict = {}


def datum(row: dict) -> T.Datum:
    inputs = {k: v for k, v in row.items() if k != "tokens"}
    return T.Datum(model_input=T.ModelInput.from_ints(row["tokens"]), loss_fn_inputs=inputs)


def lists(output) -> list:
    return [np.asarray(o["logprobs"].data, dtype=np.float64).tolist() for o in output.loss_fn_outputs]


svc = trio.ServiceClient()
caps = svc.get_server_capabilities()
report["capabilities"] = [m.model_name for m in caps.supported_models]
report["supported_models"] = svc.get_supported_models()
tc = svc.create_lora_training_client(plan["model"], rank=8, seed=7)
report["model_id"] = tc.model_id
report["training_run"] = tc.training_run_cuid
tok = tc.get_tokenizer()
report["tokenizer_encodes"] = tok.encode(plan["text"])

# forward_backward with all five losses (gradients accumulate; weights do not move until optim_step)
report["fb"] = {}
for loss, rows, config in plan["losses"]:
    result = tc.forward_backward([datum(r) for r in rows], loss, config).result()
    report["fb"][loss] = {"metrics": result.metrics, "logprobs": lists(result),
                          "shapes": [list(o["logprobs"].shape) for o in result.loss_fn_outputs]}
# a failure the worker reports as a failed event: the call raises, the client goes on
try:
    tc.forward_backward([datum(r) for r in plan["losses"][2][1]], "ppo", {"clip_epsilon": 0.2}).result()
    report["refused"] = None
except Exception as error:  # noqa: BLE001 - EventFailedError, reported by its code
    report["refused"] = [type(error).__name__, getattr(error, "code", ""), str(error)]
step = tc.optim_step(T.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)).result()
report["optim"] = step.metrics
probe = [datum(plan["probe"])]
report["after_step"] = lists(tc.forward(probe, "cross_entropy").result())

# sampling from the trained weights
sampler = tc.save_weights_and_get_sampling_client()
prompt = T.ModelInput.from_ints(plan["prompt"])
params = T.SamplingParams(max_tokens=6, seed=11, temperature=1.0, stop=[])  # no stop, not even EOS
group = sampler.sample(prompt, num_samples=4, sampling_params=params, include_prompt_logprobs=True,
                       topk_prompt_logprobs=2).result()
again = sampler.sample(prompt, num_samples=4, sampling_params=params).result()
report["sample"] = {"tokens": [s.tokens for s in group.sequences], "logprobs": [s.logprobs for s in group.sequences],
                    "stop_reasons": [s.stop_reason for s in group.sequences],
                    "again": [s.tokens for s in again.sequences], "prompt_logprobs": group.prompt_logprobs,
                    "topk_prompt_logprobs": group.topk_prompt_logprobs}
first = group.sequences[0].tokens
stop_id = first[2]
by_id = sampler.sample(prompt, 1, T.SamplingParams(max_tokens=6, seed=11, stop=[stop_id])).result().sequences[0]
report["stop_token"] = {"id": stop_id, "tokens": by_id.tokens, "stop_reason": by_id.stop_reason}
text = tok.decode(first[2:4])
by_text = sampler.sample(prompt, 1, T.SamplingParams(max_tokens=6, seed=11, stop=[text])).result().sequences[0]
report["stop_string"] = {"text": text, "tokens": by_text.tokens, "stop_reason": by_text.stop_reason}
report["compute_logprobs"] = sampler.compute_logprobs(T.ModelInput.from_ints(plan["probe"]["tokens"])).result()

# save_state, then an uninterrupted run and a resumed one take the same next step
state = tc.save_state("canonical-state").result()
report["state_path"] = state.path
next_batch = [datum(r) for r in plan["next_batch"]]
adam = T.AdamParams(learning_rate=1e-2)
tc.forward_backward(next_batch).result()
tc.optim_step(adam).result()
report["uninterrupted"] = tc.save_state("uninterrupted").result().path
resumed = svc.create_training_client_from_state_with_optimizer(state.path)
resumed.forward_backward(next_batch).result()
resumed.optim_step(adam).result()
report["resumed"] = resumed.save_state("resumed").result().path
report["resumed_run"] = resumed.training_run_cuid
loaded = svc.create_lora_training_client(plan["model"], rank=8, seed=99)
loaded.load_state(state.path).result()
report["load_state_probe"] = lists(loaded.forward(probe, "cross_entropy").result())
weights = tc.save_weights_for_sampler("canonical weights").result()
report["weights_path"] = weights.path
report["from_weights_probe"] = svc.create_sampling_client(
    plan["model"], model_path=weights.path).compute_logprobs(T.ModelInput.from_ints(plan["probe"]["tokens"])).result()
report["trainer_probe_now"] = lists(tc.forward(probe, "cross_entropy").result())

# the REST client: listings, download (full, resumed, already complete) and delete
rest = svc.create_rest_client()
mine = rest.list_checkpoints(tc.training_run_cuid).result()
report["run_checkpoints"] = [(c.checkpoint_id, c.checkpoint_type, c.path, c.size_bytes) for c in mine.checkpoints]
report["user_checkpoints"] = [c.path for c in rest.list_user_checkpoints().result().checkpoints]
run_info = rest.get_training_run(tc.training_run_cuid).result()
report["run_info"] = {"base_model": run_info.base_model, "lora_rank": run_info.lora_rank}
report["training_runs"] = [r.training_run_id for r in rest.list_training_runs().result().training_runs]
report["sampler_info"] = rest.get_sampler(sampler.sampling_run_cuid).result().model_dump(mode="json")
sessions = rest.list_sessions().result().sessions
report["sessions"] = sessions
report["session"] = rest.get_session(sessions[-1]).result().model_dump(mode="json")
target = next(c for c in mine.checkpoints if c.path == state.path)
destination = out_path.parent / "state.tar"
full = rest.download_checkpoint(target.checkpoint_id, destination).result()
whole = destination.read_bytes()
destination.write_bytes(whole[:100])
resume = rest.download_checkpoint(target.checkpoint_id, destination).result()
complete = rest.download_checkpoint(target.checkpoint_id, destination).result()
report["download"] = {"full": full.model_dump(mode="json"), "resume": resume.model_dump(mode="json"),
                      "complete": complete.model_dump(mode="json"), "path": str(destination),
                      "same_after_resume": destination.read_bytes() == whole}
weights_id = next(c.checkpoint_id for c in mine.checkpoints if c.path == weights.path)
rest.delete_checkpoint(tc.training_run_cuid, weights_id).result()
report["after_delete"] = [c.path for c in rest.list_checkpoints(tc.training_run_cuid).result().checkpoints]

# forward_backward_custom: a loss of the logprobs written in torch
coefficients = plan["custom_coefficients"]


def custom_loss(data, logprobs):
    total = torch.zeros(())
    for lp, c in zip(logprobs, coefficients):
        total = total - (lp * torch.tensor(c, dtype=torch.float32)).sum()
    return total, {"custom_metric": float(total.detach())}


custom_run = svc.create_training_client_from_state(state.path)
custom = custom_run.forward_backward_custom([datum(r) for r in plan["custom"]], custom_loss).result()
report["custom"] = {"metrics": custom.metrics, "logprobs": lists(custom),
                    "optim": custom_run.optim_step(T.AdamParams(learning_rate=1e-3)).result().metrics}
out_path.write_text(json.dumps(report))
