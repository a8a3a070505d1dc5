"""A script written for PyTRIO, not edited: tests/client/test_pytrio_run.py runs it with `pytrio-compat run`.

Usage: pytrio_script.py OUT.json BASE_MODEL (the worker comes from PYTRIO_BASE_URL).
"""

import importlib.metadata
import json
import sys

import pytrio as trio
import pytrio.types
from pytrio import types
from pytrio.errors.base import ValidationError


def main() -> None:
    out_path, base_model = sys.argv[1], sys.argv[2]
    service = trio.ServiceClient()
    models = [m.model_name for m in service.get_server_capabilities().supported_models]
    trainer = service.create_lora_training_client(base_model=base_model, rank=4)
    tokens = [5, 6, 7, 8, 9, 10]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:]})
    before = trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    after = trainer.forward([datum], "cross_entropy").result()
    sampler = trainer.save_weights_and_get_sampling_client()
    sample = sampler.sample(prompt=trio.ModelInput.from_ints([5, 6]), num_samples=2,
                            sampling_params=trio.SamplingParams(max_tokens=3, seed=1)).result()
    try:
        trainer.forward_backward([], "cross_entropy")
        caught = None
    except ValidationError as exc:
        caught = exc.code
    json.dump({
        "module": trio.__name__, "types_module": pytrio.types.__name__, "version": importlib.metadata.version("pytrio"),
        "argv": sys.argv, "models": models, "loss_before": before.metrics["loss_sum"],
        "loss_after": after.metrics["loss_sum"], "sequences": [s.tokens for s in sample.sequences], "caught": caught,
    }, open(out_path, "w"))


if __name__ == "__main__":
    main()
