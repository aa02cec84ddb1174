"""`models`: fixture trees (GGUF files, HF folders incl. GPTQ and MoE, a Hub cache) list the right
families, parameter counts, sizes and support verdicts; the fit numbers are `plan`'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_llm.cli import main
from homelab_llm.engine.memory import plan
from homelab_llm.engine.model.config import config_from_hf
from homelab_llm.models.fit import Machine, fit_model
from homelab_llm.models.scan import find_models
from model_trees import (AUTOROUND, AWQ, DENSE_PARAMS, HIDDEN, INTER, LAYERS, NUM_EXPERTS, TOP_K,
                         dense_hf, hub_cache, llama_config, moe_hf, quantized_hf, write_gguf)

GIB = 1 << 30


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, object]:
    models = tmp_path / "models"
    models.mkdir()
    write_gguf(models / "tiny-llama.gguf")
    write_gguf(models / "tiny-gemma.gguf", arch="gemma3")
    (models / "nested" / "deeper").mkdir(parents=True)
    write_gguf(models / "nested" / "deeper" / "tiny-moe.gguf", arch="qwen3moe", experts=4)
    dense_hf(models / "llama-hf")
    for part in (1, 2):  # a gguf-split pair: listed once, as unsupported, with both sizes
        write_gguf(models / f"split-{part:05d}-of-00002.gguf")
    quantized_hf(models / "llama-gptq")
    quantized_hf(models / "llama-awq", AWQ)
    quantized_hf(models / "llama-autoround", AUTOROUND)
    _, moe_total, moe_active = moe_hf(models / "mixtral-hf")
    hub = tmp_path / "hub"
    hub.mkdir()
    snap = hub_cache(hub, "acme/tiny-chat", dense_hf)
    return {"models": models, "hub": hub, "snap": snap, "moe": (moe_total, moe_active)}


def by_name(models) -> dict:
    return {m.name: m for m in models}


def test_scan_finds_families_params_sizes_and_support(tree) -> None:
    found = by_name(find_models([tree["models"], tree["hub"]]))
    assert set(found) == {"tiny-llama.gguf", "tiny-gemma.gguf", "tiny-moe.gguf", "llama-hf",
                          "llama-gptq", "llama-awq", "llama-autoround", "mixtral-hf", "acme/tiny-chat",
                          "split-00001-of-00002.gguf"}
    split = found["split-00001-of-00002.gguf"]
    assert not split.supported and "llama-gguf-split --merge" in split.reason
    assert split.size_bytes == 2 * (tree["models"] / "split-00002-of-00002.gguf").stat().st_size
    llama = found["tiny-llama.gguf"]
    assert (llama.kind, llama.family, llama.supported, llama.quantization) == ("gguf", "llama", True, "ALL_F32")
    assert llama.params_total == llama.params_active == DENSE_PARAMS
    assert llama.size_bytes == (tree["models"] / "tiny-llama.gguf").stat().st_size
    gemma = found["tiny-gemma.gguf"]
    assert not gemma.supported and "gemma3" in gemma.reason and "not supported" in gemma.reason
    moe = found["tiny-moe.gguf"]
    experts = LAYERS * 3 * HIDDEN * INTER * NUM_EXPERTS
    assert moe.params_total == DENSE_PARAMS - LAYERS * 3 * HIDDEN * INTER + experts
    assert moe.params_active == moe.params_total - experts + experts * TOP_K // NUM_EXPERTS
    assert not moe.supported

    hf = found["llama-hf"]
    assert (hf.kind, hf.family, hf.supported, hf.quantization) == ("hf", "llama", True, "bfloat16")
    assert hf.params_total == DENSE_PARAMS
    folder = tree["models"] / "llama-hf"
    assert hf.size_bytes == sum(f.stat().st_size for f in folder.iterdir())
    gptq = found["llama-gptq"]
    assert gptq.supported and gptq.quantization == "gptq 4-bit g128"
    assert gptq.params_total == DENSE_PARAMS  # packed int32 values counted as 8 weights each
    for name, label in (("llama-awq", "awq 4-bit g128"), ("llama-autoround", "auto-round 4-bit g128")):
        m = found[name]
        assert (m.supported, m.quantization, m.params_total) == (True, label, DENSE_PARAMS), m
    mixtral = found["mixtral-hf"]
    assert not mixtral.supported and "mixtral" in mixtral.reason
    assert (mixtral.params_total, mixtral.params_active) == tree["moe"]

    cached = found["acme/tiny-chat"]
    assert cached.supported and cached.path == str(tree["snap"])
    assert cached.size_bytes == sum(f.stat().st_size for f in tree["snap"].iterdir())  # via symlinks


def test_fit_numbers_equal_plan(tree) -> None:
    machine = Machine(1 * GIB, 1)
    hf = by_name(find_models([tree["models"]]))["llama-hf"]
    fit = fit_model(hf.config, machine)
    expected = plan(config_from_hf(llama_config()), gpu_memory_bytes=GIB, kv_cache_dtype="int8",
                    max_model_len=4096)
    assert fit.fits
    assert fit.max_context == min(expected.tokens_capacity, 4096)
    assert fit.concurrency_32k == expected.max_concurrency["32768"]
    assert fit.weights_bytes == expected.per_device[0].weights_bytes
    # too little memory: not a fit, and the plan's warning says why
    tiny = fit_model(hf.config, Machine(400 << 20, 1))
    assert not tiny.fits and "do not fit" in tiny.reason
    # a TP size the shapes refuse is a verdict, not a crash
    odd = fit_model(hf.config, Machine(GIB, 3))
    assert not odd.fits and "tensor-parallel-size 3" in odd.reason


def test_models_cli_json_matches_plan_cli(tree, capsys) -> None:
    assert main(["models", "--only-dirs", "--dir", str(tree["models"]), "--json",
                 "--gpu-memory", "2GiB", "-tp", "2"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["mixtral-hf"]["fit"] is None and rows["mixtral-hf"]["supported"] is False
    folder = tree["models"] / "llama-hf"
    assert main(["plan", str(folder), "--json", "--gpu-memory", "2GiB", "-tp", "2",
                 "--kv-cache-dtype", "int8"]) == 0
    planned = json.loads(capsys.readouterr().out)
    fit = rows["llama-hf"]["fit"]
    assert fit["max_context"] == min(planned["tokens_capacity"], planned["max_model_len"])
    assert fit["concurrency_32k"] == planned["max_concurrency"]["32768"]


def test_models_cli_table_and_errors(tree, capsys) -> None:
    assert main(["models", "--only-dirs", "--dir", str(tree["models"]), "--gpu-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama.gguf" in out and "unsupported" in out and "1 x 1.0 GiB" in out
    assert "mixtral-hf: " in out  # the reason is printed under the table
    assert main(["models", "--only-dirs", "--dir", str(tree["models"]), "-tp", "0",
                 "--gpu-memory", "1GiB"]) == 2
    assert "--tensor-parallel-size must be >= 1" in capsys.readouterr().err
    assert main(["models", "--dir", str(tree["models"] / "nope")]) == 2
    assert "--dir " in (err := capsys.readouterr().err) and "nope: no such file or folder" in err


def test_settings_folders_are_scanned(tree, tmp_path, monkeypatch, capsys) -> None:
    settings = tmp_path / "config.toml"
    settings.write_text(f'models_dirs = ["{tree["models"] / "llama-hf"}"]\n')
    monkeypatch.setenv("HOMELAB_LLM_CONFIG", str(settings))
    monkeypatch.setenv("HF_HUB_CACHE", str(tree["hub"]))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert main(["models", "--json", "--gpu-memory", "1GiB"]) == 0
    names = {r["name"] for r in json.loads(capsys.readouterr().out)}
    assert names == {"acme/tiny-chat", "llama-hf"}
    settings.write_text("router_port = 'x'\n")
    assert main(["models"]) == 2
    assert "router_port must be an integer" in capsys.readouterr().err
