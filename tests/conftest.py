"""Shared fixtures: the real SmolLM2 tokenizer and models built without a model hub."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgrpo.cli import main
from agentgrpo.models.default_model import default_model_path
from rollout import Episode
from tests.support.episodes import COUNTER_TURNS, scripted_episode
from tests.support.made_once import folder_made_once
from tests.support.packages import Site
from tests.support.teach import teach
from tests.support.tiny_model import tiny_llama

# process_marker: the `process` marker, kept true; pytester: tests of that plugin.
pytest_plugins = ["tests.support.process_marker", "pytester"]


def pytest_configure(config) -> None:
    """Let Ctrl-C interrupt the tests' processes, even where the suite began with it ignored.

    A shell without job control starts a background command (`make test &` in a script) with
    SIGINT ignored, which every process a test starts would inherit: the tests of Ctrl-C would
    then wait for an interrupt that never comes.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items) -> None:
    """Skip the tests marked `gpu` where CUDA has no GPU (they state what else they need)."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one process, destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct as a safetensors folder (converted once, then cached)."""
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    """SmolLM2's real tokenizer (ChatML, vocab 49152)."""
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return tiny_llama(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """The tiny Llama and SmolLM2's tokenizer, saved as a model folder (for subprocesses)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def counter_episode(tokenizer) -> Episode:
    """A two-round Counter episode (increment 3, increment 4, 'Done.') as the engine records it."""
    return scripted_episode(tokenizer, COUNTER_TURNS)


@pytest.fixture(scope="session")
def tool_calling_tiny_model(tokenizer, counter_episode, tmp_path_factory):
    """The tiny Llama, taught to play `counter_episode` (about 10-20 s on 2 cores, once a run)."""

    def taught(folder: Path) -> None:
        model = tiny_llama(tokenizer, seed=1)
        teach(model, [counter_episode], lr=1e-2, steps=400, until_learned=True)
        model.save_pretrained(folder)

    folder = folder_made_once(tmp_path_factory, "tool-calling-tiny-llama", taught)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="session")
def tool_calling_smollm2(smollm2_path, counter_episode):
    """The real SmolLM2-135M-Instruct, taught the same episode (it never calls tools zero-shot)."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    teach(model, [counter_episode], lr=3e-5, steps=40, until_learned=True)
    return model


@pytest.fixture
def user_error(capsys, monkeypatch, tmp_path):
    """Run a command in-process from tmp_path; assert status 2 and one `error:` line; return it."""
    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> str:
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        errors = [line for line in err.split("\n") if line.startswith("error:")]
        assert len(errors) == 1, err
        return errors[0]

    return run


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site-packages folder of its own, where a test installs environment packages."""
    installed = Site(tmp_path / "site", monkeypatch)
    yield installed
    installed.forget()
