"""tests/trainers: flashwatch on torchtitan's and OLMo-core's own models. They run in
.venv-trainers, not in the main suite's .venv: ai2-olmo-core 3.0.0 needs cached-path,
which holds huggingface_hub below 2, and transformers 5 needs 2.4 or later (the
Makefile). Without the two packages this folder fails at collection, never skips."""

import importlib.util

import pytest
import torch.distributed as dist

RUN = ("make install-trainers && "
       ".venv-trainers/bin/python -m pytest -q tests/trainers")

_missing = [name for name in ("torchtitan", "olmo_core")
            if importlib.util.find_spec(name) is None]
if _missing:
    raise ImportError(
        f"tests/trainers need {' and '.join(_missing)} (torchtitan 0.3.0, ai2-olmo-core "
        f"3.0.0), which live in .venv-trainers; `make test` runs this folder there. Run: "
        f"{RUN}   (the main suite: pytest --ignore=tests/trainers)")


@pytest.fixture
def torchtitan_on_cpu():
    """torchtitan's device_type "cpu" for the test (_trainers.torchtitan_on_cpu)."""
    from _trainers import torchtitan_on_cpu

    with torchtitan_on_cpu():
        yield


@pytest.fixture
def gloo_world(tmp_path):
    """A default process group of this process alone (gloo, rank 0 of 1)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def titan(torchtitan_on_cpu, gloo_world, monkeypatch):
    """torchtitan on CPU in a process group of one (its init_distributed keeps it), as
    torchrun would launch it."""
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
