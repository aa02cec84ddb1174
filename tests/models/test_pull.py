"""`pull` against a fake Hub on loopback: fit check first, progress, resume after an interrupted
download, checksum mismatch is an error, HF_TOKEN sent, include patterns, unknown repos."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_llm.cli import main
from homelab_llm.models.scan import find_models
from fake_hub import FakeHub, FakeRepo
from model_trees import dense_hf, llama_config, moe_hf, quantized_hf, write_gguf

pytestmark = pytest.mark.timeout(60)


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        files = folder_files(dense_hf(tmp_path / "src" / "tiny-llama"))
        fake.repos["acme/tiny-llama"] = FakeRepo(files, lfs={"model.safetensors"})
        moe, _, _ = moe_hf(tmp_path / "src" / "tiny-mixtral")
        fake.repos["acme/tiny-mixtral"] = FakeRepo(folder_files(moe), lfs={"model.safetensors"})
        ggufs = tmp_path / "src" / "ggufs"
        ggufs.mkdir()
        write_gguf(ggufs / "tiny-llama.F32.gguf")
        write_gguf(ggufs / "tiny-gemma.F32.gguf", arch="gemma3")
        fake.repos["acme/tiny-gguf"] = FakeRepo(folder_files(ggufs), lfs=set(folder_files(ggufs)))
        fake.cache = cache  # type: ignore[attr-defined]
        yield fake


def test_pull_checks_fit_first_shows_progress_and_verifies(hub: FakeHub, capsys) -> None:
    assert main(["pull", "acme/tiny-llama", "--gpu-memory", "1GiB"]) == 0
    out, err = capsys.readouterr()
    snapshot = Path(out.strip())
    repo = hub.repos["acme/tiny-llama"]
    assert snapshot.name == repo.commit and snapshot.is_relative_to(hub.cache)
    assert folder_files(snapshot) == repo.files
    fit_at = err.index("fit: fits 1 x 1.0 GiB")
    weights_line = next(line for line in err.splitlines() if "model.safetensors" in line and "100.0%" in line)
    assert fit_at < err.index(weights_line)  # the verdict comes before the weights
    size_mb = f"{len(repo.files['model.safetensors']) / 1e6:,.1f}"
    assert f"{size_mb} / {size_mb} MB" in weights_line and "MB/s" in weights_line
    # config.json (for the fit) came down before the weights were asked for
    gets = [r.path.rsplit("/", 1)[-1] for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert gets[0] == "config.json" and "model.safetensors" in gets
    assert all(r.auth == "Bearer hf_test_token" for r in hub.requests)  # HF_TOKEN honoured
    assert [m.name for m in find_models([hub.cache])] == ["acme/tiny-llama"]


def test_pull_resumes_after_an_interrupted_download(hub: FakeHub, capsys) -> None:
    size = len(hub.repos["acme/tiny-llama"].files["model.safetensors"])
    hub.drop_after["model.safetensors"] = 4096
    assert main(["pull", "acme/tiny-llama", "--gpu-memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors: download interrupted" in err and "run pull again to resume" in err
    assert err.strip().splitlines()[-1].startswith("homelab-llm pull: error:")
    partial = list(hub.cache.rglob("*.incomplete"))
    assert len(partial) == 1 and partial[0].stat().st_size == 4096

    hub.down = False
    first_run = len(hub.gets("model.safetensors"))
    assert main(["pull", "acme/tiny-llama", "--gpu-memory", "1GiB"]) == 0
    out, err = capsys.readouterr()
    resumed = hub.gets("model.safetensors")[first_run:]
    assert [r.range for r in resumed] == ["bytes=4096-"]  # only the missing tail was fetched
    assert "(resumed at 0.0 MB)" in err  # 4096 bytes were kept from the first run
    assert folder_files(Path(out.strip())) == hub.repos["acme/tiny-llama"].files
    assert size > 4096 and not list(hub.cache.rglob("*.incomplete"))


def test_checksum_mismatch_is_an_error_and_removes_the_file(hub: FakeHub, capsys) -> None:
    hub.repos["acme/tiny-llama"].advertised_sha256["model.safetensors"] = "0" * 64
    assert main(["pull", "acme/tiny-llama", "--gpu-memory", "1GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model.safetensors: checksum mismatch" in err and "run pull again" in err
    assert not [p for p in hub.cache.rglob("model.safetensors") if p.exists()]


def test_include_picks_files_and_a_gguf_is_fitted_after_download(hub: FakeHub, capsys) -> None:
    assert main(["pull", "acme/tiny-gguf"]) == 2  # several quantizations: pick one
    assert "holds 2 GGUF files (tiny-gemma.F32.gguf, tiny-llama.F32.gguf); pick one with --include" \
        in capsys.readouterr().err
    assert main(["pull", "acme/tiny-gguf", "--include", "*llama*", "--gpu-memory", "1GiB"]) == 0
    out, err = capsys.readouterr()
    assert [p.name for p in Path(out.strip()).iterdir()] == ["tiny-llama.F32.gguf"]
    assert "checked after download" in err and "fit: fits 1 x 1.0 GiB" in err
    assert main(["pull", "acme/tiny-gguf", "--include", "*.bin"]) == 2
    assert "no files match --include *.bin" in capsys.readouterr().err


def test_unsupported_model_is_refused_before_the_weights(hub: FakeHub, capsys) -> None:
    assert main(["pull", "acme/tiny-mixtral", "--gpu-memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "not downloaded: the engine cannot run this model" in err and "--force" in err
    assert not hub.gets("model.safetensors")
    assert main(["pull", "acme/tiny-mixtral", "--force", "--gpu-memory", "1GiB"]) == 0
    assert hub.gets("model.safetensors")


def test_unknown_repo_and_revision_are_one_line_errors(hub: FakeHub, capsys) -> None:
    assert main(["pull", "acme/nope"]) == 2
    assert "acme/nope: no such repo (or it is private: set HF_TOKEN)" in capsys.readouterr().err
    assert main(["pull", "acme/tiny-llama", "--revision", "v9"]) == 2
    assert "no revision 'v9'" in capsys.readouterr().err


def test_fit_check_reads_the_quantizers_side_file(hub: FakeHub, tmp_path: Path) -> None:
    from homelab_llm.engine.model.config import config_from_hf
    from homelab_llm.models.fit import Machine, fit_model
    from homelab_llm.models.hub import PullError
    from homelab_llm.models.pull import pull

    files = folder_files(quantized_hf(tmp_path / "gptq"))
    files["config.json"] = json.dumps(llama_config()).encode()  # no quantization_config here...
    side = {"bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    files["quantize_config.json"] = json.dumps(side).encode()  # ...but AutoGPTQ's side file
    hub.repos["acme/old-gptq"] = FakeRepo(files, lfs={"model.safetensors"})
    machine = Machine(1 << 30, 1)
    result = pull("acme/old-gptq", machine=machine)
    expected = fit_model(config_from_hf(llama_config(quantization_config={**side, "quant_method": "gptq"})),
                         machine)
    assert result.fit.fit == expected  # planned as W4A16, not as bf16
    files["quantize_config.json"] = json.dumps({**side, "bits": 8}).encode()
    hub.repos["acme/gptq-8bit"] = FakeRepo(files, lfs={"model.safetensors"})
    weights_before = len(hub.gets("model.safetensors"))
    with pytest.raises(PullError, match="8-bit weights are not supported"):
        pull("acme/gptq-8bit", machine=machine)
    assert len(hub.gets("model.safetensors")) == weights_before  # refused before the weights
