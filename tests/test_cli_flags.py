"""``pytrio-worker serve``: every flag declared in server_mock/config.py, its default shown in --help, grouped; the
flag names of earlier releases still accepted; Tinker's bounds are flags, checked like PyTRIO's."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import fields
from types import SimpleNamespace

import pytest

from server_mock.api.tinker.state import TinkerState
from server_mock.cli import SERVE_OPTIONS, build_parser
from server_mock.config import Limits, TinkerOptions
from server_mock.flags import GROUPS, from_args, shown_default
from server_mock.errors import WorkerError

# the serve flags of the release before the settings were all declared in config.py: each must keep parsing
EARLIER_FLAGS = [
    "--activation-checkpointing", "--admin-key-file", "--allow-adapter-dir", "--allowed-host", "--api-key",
    "--api-key-file", "--autocast", "--batch-across-tenants", "--checkpoint-sweep-seconds", "--cpus-per-replica",
    "--decode-graphs", "--decode-slice-seconds", "--device", "--download-url-seconds", "--dtype", "--durability",
    "--gpus-per-replica", "--host", "--insecure", "--lazy-model-allow", "--lazy-models", "--log-level",
    "--lora-vision-tower", "--max-adapter-bytes", "--max-adapter-bytes-total", "--max-adapters",
    "--max-archive-builds", "--max-body-bytes", "--max-connections", "--max-connections-per-peer",
    "--max-image-bytes", "--max-image-pixels", "--max-images-per-request", "--max-json-body-bytes",
    "--max-json-values", "--max-lora-rank", "--max-num-samples", "--max-parsing-bytes", "--max-queued-requests",
    "--max-recorded-sequences", "--max-recorded-tokens", "--max-result-bytes", "--max-sample-request-tokens",
    "--max-sample-tokens", "--max-samplers", "--max-seq-len", "--max-snapshots", "--max-stop-string-bytes",
    "--max-stop-strings", "--max-stop-token-ids", "--max-storage-bytes-per-tenant", "--max-target-cells",
    "--max-target-k", "--max-tokens-per-request", "--max-training-runs", "--max-zstd-ratio", "--merge-lora-bytes",
    "--micro-batch-tokens", "--model", "--no-float32-head", "--port", "--port-file", "--prefix-share-min-tokens",
    "--pytrio-ack-wait", "--pytrio-event-answer-bytes", "--pytrio-event-ttl", "--pytrio-events-per-run",
    "--pytrio-max-batch-size", "--pytrio-max-sampling-runs", "--pytrio-max-sessions",
    "--pytrio-max-tokens-per-request", "--pytrio-run-idle-ttl", "--pytrio-sample-keepalive",
    "--pytrio-sampling-run-ttl", "--pytrio-session-ttl", "--pytrio-token-ttl", "--ray", "--recorded-sequence-ttl",
    "--request-timeout", "--result-ttl", "--sampler-replicas", "--storage", "--threads", "--tokenizer-id",
    "--tokens-per-minute", "--train-replicas", "--trainer-groups",
]
FLAG_LINE = re.compile(r"^  (--[a-z0-9-]+)(?:, --[a-z0-9-]+)*( [^ ].*?)?(?:  +(.*))?$")


def serve_help() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    return out.getvalue()


def help_entries(text: str) -> dict[str, tuple[bool, str, str]]:
    """``--flag`` -> (takes a value, its help text, the section it is listed in), read from the --help text."""
    entries, section, current = {}, "", None
    for line in text.splitlines():
        if line and not line.startswith(" "):
            section, current = line.rstrip(":"), None
            continue
        match = FLAG_LINE.match(line)
        if match:
            current = match[1]
            entries[current] = [bool(match[2]), match[3] or "", section]
        elif current and line.startswith(" " * 10):
            entries[current][1] += " " + line.strip()
    return {flag: (takes, " ".join(text.split()), where) for flag, (takes, text, where) in entries.items()}


def test_every_flag_with_a_value_shows_its_default():
    entries = help_entries(serve_help())
    valued = {flag: text for flag, (takes, text, _) in entries.items() if takes}
    assert len(valued) >= 80, f"parsed only {len(valued)} flags that take a value from --help"
    shown = [flag for flag, text in valued.items() if "(default: " in text]
    assert len(shown) >= 0.95 * len(valued), sorted(set(valued) - set(shown))
    assert "(default: 64 MiB)" in valued["--max-body-bytes"]
    assert "(default: 1 GiB)" in valued["--max-result-bytes"]
    assert "(default: 1800 s)" in valued["--tinker-session-ttl"]
    assert "(default: full)" in valued["--durability"]
    assert "(default: 127.0.0.1)" in valued["--host"]


def test_every_flag_is_declared_in_config_and_listed_in_a_group():
    entries = help_entries(serve_help())
    declared = {"--" + f.name.replace("_", "-") if not f.metadata.get("flag") else f.metadata["flag"]
                for options in SERVE_OPTIONS for f in fields(options)}
    assert set(entries) - {"--help"} == declared  # nothing written by hand in cli.py
    titles = set(GROUPS.values())
    for flag, (_, text, section) in entries.items():
        assert flag == "--help" or section in titles, (flag, section)
        assert flag == "--help" or text, f"{flag} has no help"
    sizes: dict[str, int] = {}
    for _, _, section in entries.values():
        sizes[section] = sizes.get(section, 0) + 1
    for key in ("bodies", "sampling", "training", "tenants", "storage", "tinker", "pytrio"):
        assert sizes.get(GROUPS[key]), f"group {GROUPS[key]!r} is empty"
    assert max(sizes[GROUPS[k]] for k in ("bodies", "sampling", "training", "tenants", "storage")) <= 12, sizes


def test_earlier_flag_names_still_parse():
    parser = build_parser()
    known = {o for action in parser._subparsers._group_actions[0].choices["serve"]._actions
             for o in action.option_strings}
    assert not set(EARLIER_FLAGS) - known
    args = parser.parse_args(["serve", "--model", "tiny=/m", "--result-ttl", "5", "--host", "0.0.0.0",
                              "--ray", "auto", "--sampler-replicas", "2", "--log-level", "debug",
                              "--pytrio-max-sessions", "3", "--no-float32-head", "--autocast", "bf16"])
    assert args.model == [("tiny", "/m")] and args.result_ttl == 5.0 and args.host == "0.0.0.0"
    assert (args.ray, args.sampler_replicas, args.log_level, args.pytrio_max_sessions) == ("auto", 2, "debug", 3)
    assert args.float32_head is False and args.autocast_bf16 == "bf16"


def test_defaults_are_formatted_by_unit():
    by_name = {f.name: f for f in fields(Limits)}
    assert shown_default(by_name["max_json_body_bytes"]) == "4 MiB"
    assert shown_default(by_name["max_stop_string_bytes"]) == "256 bytes"
    assert shown_default(by_name["decode_slice_seconds"]) == "0.5 s"
    assert shown_default(by_name["max_num_samples"]) == "256"
    assert shown_default(by_name["batch_across_tenants"]) == "off"


@pytest.mark.parametrize("flag, limit, below", [("--tinker-session-ttl", "60", "59.9"),
                                               ("--tinker-max-sessions", "1", "0"),
                                               ("--tinker-max-seq-ahead", "1", "0"),
                                               ("--result-ttl", "0.001", "0"),
                                               ("--port", "65535", "65536")])
def test_bounds_are_checked_at_the_limit_and_one_past(flag, limit, below):
    parser = build_parser()
    for options in SERVE_OPTIONS:
        from_args(options, parser.parse_args(["serve", flag, limit]))
    with pytest.raises(ValueError, match=re.escape(flag)):
        for options in SERVE_OPTIONS:
            from_args(options, parser.parse_args(["serve", flag, below]))


def test_tinker_session_cap_is_the_flag():
    options = from_args(TinkerOptions, build_parser().parse_args(["serve", "--tinker-max-sessions", "2"]))
    service = SimpleNamespace(limits=Limits(), requests=SimpleNamespace(result_ttl=60.0), samplers=None, journal=None)
    state = TinkerState(service, options)
    state.new_session("s1", "A")
    state.new_session("s2", "A")
    state.new_session("s3", "B")  # another key has its own cap
    with pytest.raises(WorkerError) as refused:
        state.new_session("s4", "A")
    assert refused.value.status == 429 and "--tinker-max-sessions" in refused.value.message
    assert sorted(state.sessions) == ["s1", "s2", "s3"]  # the refused one changed nothing


def test_a_renamed_flag_keeps_its_old_name_as_an_alias():
    import argparse
    from dataclasses import dataclass

    from server_mock.flags import add_flags, setting

    @dataclass
    class Renamed:
        GROUP = "tenants"

        client_session_ttl: float = setting(60.0, "seconds", aliases=("--old-session-ttl",), minimum=1)

    parser = argparse.ArgumentParser()
    add_flags(parser, Renamed)
    assert from_args(Renamed, parser.parse_args(["--old-session-ttl", "5"])).client_session_ttl == 5.0
    assert from_args(Renamed, parser.parse_args(["--client-session-ttl", "7"])).client_session_ttl == 7.0
    assert "--old-session-ttl" in parser.format_help() and "(default: 60 s)" in parser.format_help()
