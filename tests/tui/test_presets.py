"""Presets: built-ins, user overrides, validation per field, save/delete, the presets command."""

from __future__ import annotations

from pathlib import Path

import pytest

from homelab_llm.cli import main
from homelab_llm.presets import (Preset, PresetError, delete_preset, dump_preset, list_presets,
                                 load_preset, parse_preset, save_preset, scan_presets)
from homelab_llm.tui.launch import launch_command

REQUIRED = {"smollm2-cpu", "dual-7900xtx-27b-128k", "agent-long-context", "throughput-8way"}


def test_builtins_are_valid_and_cover_every_backend() -> None:
    scan = scan_presets()
    assert scan.broken == {}
    names = {p.name for p in scan.presets}
    assert REQUIRED <= names
    assert {p.backend for p in scan.presets} >= {"builtin", "vllm", "sglang", "llama.cpp"}
    assert all(p.builtin for p in scan.presets)


def test_dual_7900xtx_preset_has_the_issue_settings() -> None:
    preset = load_preset("dual-7900xtx-27b-128k")
    assert preset.args == {"device": "cuda", "tensor_parallel_size": 2, "kv_cache_dtype": "int8",
                           "max_model_len": 131072, "max_num_seqs": 8,
                           "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.95,
                           "enable_prefix_caching": True}


def test_to_cli_args_puts_model_first_in_vllm_spelling() -> None:
    preset = Preset(name="t", model="/m.gguf", args={"tensor_parallel_size": 2,
                                                     "enable_prefix_caching": False, "x_y": "z"})
    assert preset.to_cli_args() == ["/m.gguf", "--tensor-parallel-size", "2",
                                    "--no-enable-prefix-caching", "--x-y", "z"]


def test_default_model_resolves_to_the_embedded_gguf(smollm2_path: Path) -> None:
    assert load_preset("smollm2-cpu").to_cli_args()[0] == str(smollm2_path)


def test_launch_commands_per_backend() -> None:
    by_name = {p.name: p for p in list_presets()}
    assert launch_command(by_name["smollm2-cpu"], 9000, resolve_model=False)[1:5] == [
        "-m", "homelab_llm", "serve", "@default"]
    assert launch_command(by_name["vllm-qwen3-32b-awq-tp2"], 9000)[:2] == ["vllm", "serve"]
    assert launch_command(by_name["sglang-qwen3-32b-awq-tp2"], 9000)[1:3] == [
        "-m", "sglang.launch_server"]
    llama = launch_command(by_name["llamacpp-qwen3-32b-q4km"], 9000)
    assert llama[0] == "llama-server" and llama[-2:] == ["--port", "9000"]
    cmd = Preset(name="c", backend="command", command=("{python}", "-c", "x", "{port}"))
    assert launch_command(cmd, 1234)[-1] == "1234"


def test_user_preset_overrides_builtin_and_delete_restores_it(user_presets: Path) -> None:
    builtin = load_preset("smollm2-cpu")
    path = save_preset(builtin.with_changes(port=8123, description="mine"))
    assert path.parent == user_presets
    mine = load_preset("smollm2-cpu")
    assert (mine.port, mine.builtin) == (8123, False)
    assert [p.port for p in list_presets() if p.name == "smollm2-cpu"] == [8123]
    delete_preset("smollm2-cpu")
    assert load_preset("smollm2-cpu").port == builtin.port


def test_builtin_cannot_be_deleted() -> None:
    with pytest.raises(PresetError, match="cannot be deleted"):
        delete_preset("smollm2-cpu")


@pytest.mark.parametrize(("changes", "field"), [
    ({"port": 70000}, "port"),
    ({"port": True}, "port"),
    ({"name": "Bad Name"}, "name"),
    ({"backend": "ollama"}, "backend"),
    ({"model": ""}, "model"),
    ({"health_path": "health"}, "health_path"),
    ({"startup_timeout": -1}, "startup_timeout"),
    ({"args": {"max_num_seqs": 0}}, "args.max_num_seqs"),
    ({"args": {"max_num_seqs": "eight"}}, "args.max_num_seqs"),
    ({"args": {"gpu_memory_utilization": 1.5}}, "args.gpu_memory_utilization"),
    ({"args": {"kv_cache_dtype": "fp4"}}, "args.kv_cache_dtype"),
    ({"args": {"no_such_flag": 1}}, "args.no_such_flag"),
    ({"args": {"max_state_snapshots": "16"}}, "args.max_state_snapshots"),
    ({"args": {"max_state_snapshots": -1}}, "args.max_state_snapshots"),
    ({"args": {"state_snapshot_memory_bytes": "lots"}}, "args.state_snapshot_memory_bytes"),
    ({"args": {"max_state_snapshots": 4, "state_snapshot_memory_bytes": "1GiB"}},
     "args.max_state_snapshots"),
])
def test_invalid_values_are_reported_on_their_field_and_never_saved(
        changes: dict[str, object], field: str, user_presets: Path) -> None:
    preset = load_preset("smollm2-cpu").with_changes(**changes)
    issues = preset.validate()
    assert field in [i.field for i in issues], issues
    with pytest.raises(PresetError):
        save_preset(preset)
    assert not any(user_presets.glob("*.toml")) if user_presets.exists() else True


def test_command_backend_needs_a_command() -> None:
    fields = [i.field for i in Preset(name="c", backend="command").validate()]
    assert fields == ["command"]


def test_dump_then_parse_round_trips() -> None:
    import tomllib

    for preset in list_presets():
        again, issues = parse_preset(tomllib.loads(dump_preset(preset)), name=preset.name)
        assert issues == [] and again == preset


def test_broken_user_file_is_reported_and_hides_nothing(user_presets: Path) -> None:
    user_presets.mkdir(parents=True)
    (user_presets / "typo.toml").write_text('name = "typo"\nport = "eighty"\nmodel = "m"\n')
    (user_presets / "bad-toml.toml").write_text("name = \n")
    scan = scan_presets()
    assert REQUIRED <= {p.name for p in scan.presets}
    assert {p.name for p in scan.broken} == {"typo.toml", "bad-toml.toml"}
    assert "port" in scan.broken[user_presets / "typo.toml"]
    with pytest.raises(PresetError, match="not valid TOML"):
        load_preset("bad-toml")


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(PresetError, match="smollm2-cpu"):
        load_preset("nope")


def test_presets_command(capsys: pytest.CaptureFixture[str], user_presets: Path) -> None:
    assert main(["presets", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in REQUIRED)
    assert main(["presets", "show", "dual-7900xtx-27b-128k"]) == 0
    out = capsys.readouterr().out
    assert "kv_cache_dtype = \"int8\"" in out and "--tensor-parallel-size 2" in out
    assert main(["presets", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(user_presets)
    assert main(["presets", "show", "nope"]) == 2
    assert "no preset named 'nope'" in capsys.readouterr().err


def test_snapshot_pool_args_are_valid_preset_args() -> None:
    preset = load_preset("dual-7900xtx-27b-128k")
    for extra in ({"max_state_snapshots": 0}, {"state_snapshot_memory_bytes": "2GiB"}):
        assert preset.with_changes(args={**preset.args, **extra}).validate() == []
