"""`homelab-llm hwcheck`, `hwcheck build` and `plan` through the CLI front door."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from homelab_llm.cli import main
from homelab_llm.hwcheck import plan_command
from tests.hwcheck.hwcheck_fixtures import FIXTURES

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(autouse=True)
def no_user_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_hwcheck_json_on_a_fixture(capsys) -> None:
    rc, out, _ = run_cli(capsys, "hwcheck", "--json", "--no-vendor-libs", "--sysfs-root",
                         str(FIXTURES / "am5_chipset_x4"))
    data = json.loads(out)
    assert rc == 0 and [g["attached_to"] for g in data["gpus"]] == ["cpu", "chipset", "cpu"]
    assert data["topology"]["connection"][0][1] == "PHB"


def test_hwcheck_text_with_real_vendor_libraries_present_never_crashes(capsys) -> None:
    # nvidia-ml-py is installed here without a driver: NVML init fails and we fall back
    rc, out, err = run_cli(capsys, "hwcheck", "--sysfs-root", str(FIXTURES / "nvidia_pair_am5"))
    assert rc == 0 and "GPU0  0000:01:00.0" in out and "Traceback" not in err


def test_hwcheck_bad_root_is_one_line(capsys) -> None:
    rc, out, err = run_cli(capsys, "hwcheck", "--sysfs-root", "/no/such/dir")
    assert rc == 2 and err.count("\n") == 1 and "is not a directory" in err


BUILD_850 = """
cpu_watts = 170
board = "asus-proart-x670e-creator"
case = "fractal-meshify-2"
psu = { name = "Generic 850 W", watts = 850, connectors = { pcie_8pin = 4, "12v_2x6" = 1 } }
[[gpu]]
ref = "rtx-5090-fe"
slot = "PCIEX16_1"
[[gpu]]
ref = "rtx-4090-fe"
slot = "PCIEX16_2"
"""


def test_hwcheck_build_reports_the_power_failure(tmp_path: Path, capsys) -> None:
    path = tmp_path / "build.toml"
    path.write_text(BUILD_850)
    rc, out, _ = run_cli(capsys, "hwcheck", "build", str(path))
    assert rc == 1 and "overall: fail" in out
    assert "= 1295 W, over the 850 W PSU" in out and "it needs 1684 W" in out
    rc, out, _ = run_cli(capsys, "hwcheck", "build", str(path), "--json")
    data = json.loads(out)
    assert data["overall"] == "fail"
    assert {v["rule"] for v in data["verdicts"]} >= {"physical", "lanes", "power"}


def test_hwcheck_build_missing_file_is_one_line(tmp_path: Path, capsys) -> None:
    rc, _, err = run_cli(capsys, "hwcheck", "build", str(tmp_path / "nope.toml"))
    assert rc == 2 and "cannot read" in err and err.count("\n") == 1


def test_hwcheck_catalog_lists_entries(capsys) -> None:
    rc, out, _ = run_cli(capsys, "hwcheck", "catalog")
    assert rc == 0 and "rtx-5090-fe" in out and "board:" in out


@pytest.fixture
def llama_json(tmp_path: Path) -> Path:
    path = tmp_path / "Llama-3.1-8B.json"
    path.write_text(json.dumps(LLAMA_8B))
    return path


def test_plan_json_llama_8b_tp2(llama_json: Path, capsys) -> None:
    rc, out, _ = run_cli(capsys, "plan", str(llama_json), "--tensor-parallel-size", "2",
                         "--gpu-memory", "24GiB", "--max-model-len", "131072", "--json")
    data = json.loads(out)
    assert rc == 0 and len(data["per_device"]) == 2
    d0 = data["per_device"][0]
    assert {"weights_bytes", "activation_bytes", "graph_bytes", "kv_cache_bytes"} <= set(d0)
    assert d0["weights_bytes"] / 1e9 == pytest.approx(8.03, abs=0.005)
    assert data["kv_bytes_per_token"] == 65536
    assert set(data["max_concurrency"]) == {"8192", "32768", "131072"}
    assert data["tokens_capacity"] == d0["num_pages"] * 16


def test_plan_text_and_int8(llama_json: Path, capsys) -> None:
    rc, out, _ = run_cli(capsys, "plan", str(llama_json), "-tp", "2", "--gpu-memory", "24GiB",
                         "--kv-cache-dtype", "int8", "--max-model-len", "65536")
    assert rc == 0
    assert "KV bytes per token per device: 33,280, 33,280" in out  # 32 x 2 x 4 x (128 + 2)
    assert "64K:" in out and "8K:" in out


@pytest.mark.parametrize("argv, needle", [
    (["plan", "no-such-model", "--gpu-memory", "24GiB"], "neither a file nor a folder"),
    (["plan", "{model}", "--gpu-memory", "24GiB", "-tp", "3"], "not divisible"),
    (["plan", "{model}", "--gpu-memory", "lots"], None),  # argparse: exits 2 with usage
    (["plan", "{model}"], "give --gpu-memory"),
    (["plan", "{model}", "--gpu-memory", "24GiB", "--max-model-len", "0"], "--max-model-len"),
])
def test_plan_bad_input(llama_json: Path, capsys, monkeypatch, argv: list[str], needle) -> None:
    monkeypatch.setattr(plan_command, "detected_gpu_memory", lambda: None)
    argv = [a.replace("{model}", str(llama_json)) for a in argv]
    if needle is None:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        return
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and needle in err and err.count("\n") == 1


@pytest.mark.slow  # ~15 s: torch import plus the engine's GGUF metadata parse
def test_plan_reads_the_real_gguf(smollm2_path: Path, capsys) -> None:
    rc, out, _ = run_cli(capsys, "plan", str(smollm2_path), "--gpu-memory", "8GiB",
                         "--dtype", "bfloat16", "--json")
    data = json.loads(out)
    # 30 layers x (K and V) x 3 KV heads x 64 dims x 2 bytes
    assert rc == 0 and data["kv_bytes_per_token"] == 23040
    assert data["per_device"][0]["weights_bytes"] == 134_515_008 * 2  # tied embeddings


def test_hwcheck_and_plan_do_not_import_torch(llama_json: Path) -> None:
    code = ("import sys; from homelab_llm.cli import main; "
            f"main(['plan', {str(llama_json)!r}, '--gpu-memory', '24GiB', '--json']); "
            f"main(['hwcheck', '--no-vendor-libs', '--sysfs-root', {str(FIXTURES / 'am5_x16')!r}]); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_plan_finds_a_model_configs_name(tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "Llama-3.1-8B.json").write_text(json.dumps(LLAMA_8B))
    monkeypatch.setattr(plan_command, "model_configs_dir", lambda: tmp_path)
    rc, out, _ = run_cli(capsys, "plan", "llama-3.1-8b", "--gpu-memory", "24GiB", "--json")
    assert rc == 0 and json.loads(out)["model"] == "Llama-3.1-8B"
    rc, _, err = run_cli(capsys, "plan", "qwen-404", "--gpu-memory", "24GiB")
    assert rc == 2 and "known names: Llama-3.1-8B" in err


def test_plan_shipped_llama_config_by_name(capsys) -> None:
    if not (plan_command.model_configs_dir() / "Llama-3.1-8B.json").is_file():
        pytest.skip("assets/model_configs/Llama-3.1-8B.json is not shipped")
    rc, out, _ = run_cli(capsys, "plan", "Llama-3.1-8B", "-tp", "2", "--gpu-memory", "24GiB",
                         "--json")
    data = json.loads(out)
    # 8,030,261,248 params: all but the 65 norm vectors split in two, norms on both cards
    assert data["per_device"][0]["weights_bytes"] == (8_030_261_248 - 65 * 4096) + 65 * 4096 * 2
    assert data["kv_bytes_per_token"] == 65536


QWEN36_DEPLOYMENT = ("plan", "Qwen3.6-27B", "-tp", "2", "--kv-cache-dtype", "int8",
                     "--max-model-len", "131072", "--max-num-seqs", "8", "--quantization", "w4a16",
                     "--gpu-memory", "25753026560")  # a 7900 XTX: 23.98 GiB


def test_plan_hybrid_27b_deployment_json(capsys) -> None:
    """Issue 14's deployment: KV only for the 16 full-attention layers, ~77 MB of GDN state per
    sequence per card, for 8 running sequences plus 16 prefix-cache snapshots."""
    rc, out, _ = run_cli(capsys, *QWEN36_DEPLOYMENT, "--json")
    data = json.loads(out)
    assert rc == 0 and data["kv_bytes_per_token"] == 16_512
    assert data["state_bytes_per_sequence"] == 76_972_032
    for d in data["per_device"]:
        assert d["kv_bytes_per_token"] == 16_512 and d["state_bytes_per_sequence"] == 76_972_032
        assert d["state_bytes"] == (8 + 16) * 76_972_032
    rc, out, _ = run_cli(capsys, *QWEN36_DEPLOYMENT, "--max-state-snapshots", "0", "--json")
    assert json.loads(out)["per_device"][0]["state_bytes"] == 8 * 76_972_032


def test_plan_hybrid_text_shows_the_state(capsys) -> None:
    rc, out, _ = run_cli(capsys, *QWEN36_DEPLOYMENT)
    assert rc == 0 and "state" in out.splitlines()[2]
    assert "KV bytes per token per device: 16,512, 16,512" in out
    assert "state per sequence per device: 76,972,032 bytes (77.0 MB)" in out
    assert "16 prefix-cache snapshots: 1.85 GB" in out


def test_plan_snapshot_flags_are_checked(capsys) -> None:
    rc, _, err = run_cli(capsys, *QWEN36_DEPLOYMENT, "--max-state-snapshots", "-2")
    assert rc == 2 and "--max-state-snapshots must be >= 0" in err and err.count("\n") == 1
