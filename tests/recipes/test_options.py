"""Options whose defaults depend on --dataset: the upstream GSM8K ones, or the CPU arithmetic demo's."""

import pytest

from recipes.grpo_lib import DATASET_DEFAULTS, build_arg_parser


@pytest.mark.parametrize("dataset", ["gsm8k", "arithmetic"])
def test_unset_options_take_the_datasets_defaults(dataset):
    args = build_arg_parser("t").parse_args(["--dataset", dataset])
    for key, value in DATASET_DEFAULTS[dataset].items():
        assert getattr(args, key) == value, key


def test_gsm8k_keeps_the_upstream_defaults():
    args = build_arg_parser("t").parse_args([])
    assert (args.dataset, args.base_model, args.lora_rank, args.learning_rate, args.group_size,
            args.max_tokens, args.beta2, args.adam_eps, args.train_unembed) == (
        "gsm8k", "Qwen/Qwen3.5-4B", 32, 4e-5, 4, 1024, 0.95, 1e-12, True)


def test_help_shows_each_datasets_default_and_an_empty_one_as_none():
    parser = build_arg_parser("t")
    helps: dict[str, str] = {}
    for action in parser._actions:  # --train-unembed and --no-train-unembed share a dest: the first says the default
        helps.setdefault(action.dest, action.help or "")
    for key in DATASET_DEFAULTS["gsm8k"]:
        text = helps[key]
        for name, values in DATASET_DEFAULTS.items():
            shown = "none" if values[key] == "" else str(values[key])
            assert f"{shown} ({name})" in text, (key, name, text)
        assert "default  (" not in text and "/  (" not in text and "default (" not in text, text
    assert "" in {values["worker_args"] for values in DATASET_DEFAULTS.values()}  # the case above is exercised


def test_given_options_win_over_dataset_defaults():
    args = build_arg_parser("t").parse_args(["--dataset", "arithmetic", "--lora-rank", "8", "--beta2", "0.9",
                                             "--train-unembed", "--eval-every", "0"])
    assert (args.lora_rank, args.beta2, args.train_unembed, args.eval_every) == (8, 0.9, True, 0)
    args = build_arg_parser("t").parse_args(["--no-train-unembed"])
    assert args.train_unembed is False


def test_worker_args_reach_only_the_embedded_worker(monkeypatch):
    import pytrio_compat as trio
    from pytrio_compat.config import _CONFIG
    from recipes.grpo_options import make_service_client

    made = []
    monkeypatch.setattr(trio, "ServiceClient", lambda **kwargs: made.append(kwargs) or "client")
    monkeypatch.setattr(_CONFIG, "embedded_worker_args", ())
    args = build_arg_parser("t").parse_args(["--dataset", "arithmetic"])
    assert args.worker_args == "--autocast bf16"  # the CPU demo's worker trains under bf16 autocast
    assert make_service_client(args) == "client"
    assert _CONFIG.embedded_worker_args == ("--autocast", "bf16") and made == [{}]
    monkeypatch.setattr(_CONFIG, "embedded_worker_args", ())
    make_service_client(build_arg_parser("t").parse_args(["--dataset", "arithmetic", "--worker-args", ""]))
    assert _CONFIG.embedded_worker_args == ()  # given empty: the worker's own defaults
    make_service_client(build_arg_parser("t").parse_args(["--worker-args", "--dtype float32 --autocast off"]))
    assert _CONFIG.embedded_worker_args == ("--dtype", "float32", "--autocast", "off")
    assert build_arg_parser("t").parse_args([]).worker_args == ""  # gsm8k: nothing added
