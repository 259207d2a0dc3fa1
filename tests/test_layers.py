"""The import direction of DESIGN.md: tools <- environments <- rollout <- agentgrpo."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["tools", "environments", "rollout", "agentgrpo"]


def imported_packages(path: Path) -> set[str]:
    """Top-level names a module imports (absolute imports only; relative ones stay inside)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_to_its_left(layer):
    forbidden = set(LAYERS[LAYERS.index(layer) + 1 :])
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & forbidden)
        for path in (ROOT / layer).rglob("*.py")
    }
    assert {p: names for p, names in offenders.items() if names} == {}


def imported_modules(path: Path) -> set[str]:
    """Full dotted names a module imports (absolute imports only), in functions too.

    `from a import b` counts as `a` and `a.b`: b may be a module (`from rollout import backends`).
    """
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


# transformers' cache types: the shared-prompt forward hands the model caches of its own kind
# (`agentgrpo/learner/prefix_cache.py`); nothing else of transformers. `rollout.images` (torch
# only): how a VLM's forward takes its images, shared with the sampler.
LEARNER_MAY_IMPORT = (
    "torch",
    "rollout.types",
    "rollout.images",
    "agentgrpo.learner",
    "transformers.cache_utils",
    "transformers.masking_utils",
)


def test_the_learner_imports_only_torch_the_episode_types_and_the_standard_library():
    def allowed(name: str) -> bool:
        top = name.split(".")[0]
        return (
            top in sys.stdlib_module_names
            or top == "__future__"
            or any(name == prefix or name.startswith(prefix + ".") for prefix in LEARNER_MAY_IMPORT)
        )

    offenders = {
        str(path.relative_to(ROOT)): sorted(n for n in imported_modules(path) if not allowed(n))
        for path in (ROOT / "agentgrpo" / "learner").rglob("*.py")
    }
    assert offenders and {p: names for p, names in offenders.items() if names} == {}


# rollout's rooms: the episode core (the modules directly in rollout/) plays episodes against
# the generator protocol and a parser; backends, parsers and agents plug into it, never the
# reverse. rollout/__init__.py is left out: it re-exports the public API of every room.
ROOM_MAY_NOT_IMPORT = {
    "core": ("rollout.backends", "rollout.agents"),
    "parsers": ("rollout.backends", "rollout.agents"),
    "backends": ("rollout.parsers", "rollout.agents"),
}


def room_modules(room: str) -> list[Path]:
    if room == "core":
        return [p for p in (ROOT / "rollout").glob("*.py") if p.name != "__init__.py"]
    return sorted((ROOT / "rollout" / room).rglob("*.py"))


def forbidden_imports(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """Each module of `paths` and what it imports of `forbidden` (or below it): [] when none."""
    return {
        str(path.relative_to(ROOT)): sorted(
            n
            for n in imported_modules(path)
            if any(n == f or n.startswith(f + ".") for f in forbidden)
        )
        for path in paths
    }


@pytest.mark.parametrize("room", ROOM_MAY_NOT_IMPORT)
def test_a_rollout_room_imports_no_room_it_must_not(room):
    offenders = forbidden_imports(room_modules(room), ROOM_MAY_NOT_IMPORT[room])
    assert offenders and {p: names for p, names in offenders.items() if names} == {}


def test_only_the_vllm_backend_modules_import_vllm():
    importers = {
        str(path.relative_to(ROOT))
        for layer in LAYERS
        for path in (ROOT / layer).rglob("*.py")
        if "vllm" in imported_packages(path)
    }
    assert importers and all(p.startswith("rollout/backends/vllm_") for p in importers), importers


def test_every_layer_is_a_real_package():
    assert all((ROOT / layer / "__init__.py").is_file() for layer in LAYERS)


@pytest.mark.parametrize("package", LAYERS)
@pytest.mark.process
def test_importing_a_layer_never_imports_vllm(package):
    code = f"import sys, {package}; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("layer", LAYERS)
def test_the_library_never_imports_trl(layer):
    """trl is a test and benchmark dependency only (its templates, the side-by-side benchmarks)."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / layer).rglob("*.py")
        if "trl" in imported_packages(path)
    ]
    assert offenders == []


# agentgrpo's rooms: a round is played and batched without knowing which generator plays it or
# whether a producer thread does (the generation and async rooms plug into the round).
AGENTGRPO_ROOM_MAY_NOT_IMPORT = {
    "rounds": ("agentgrpo.generation", "agentgrpo.asynchronous", "agentgrpo.training"),
    "models": ("agentgrpo.generation", "agentgrpo.asynchronous", "agentgrpo.training"),
    "generation": ("agentgrpo.asynchronous", "agentgrpo.training"),
    "asynchronous": ("agentgrpo.training",),
    "learner": ("agentgrpo.rounds", "agentgrpo.generation", "agentgrpo.asynchronous"),
}


@pytest.mark.parametrize("room", AGENTGRPO_ROOM_MAY_NOT_IMPORT)
def test_an_agentgrpo_room_imports_no_room_it_must_not(room):
    paths = sorted((ROOT / "agentgrpo" / room).rglob("*.py"))
    offenders = forbidden_imports(paths, AGENTGRPO_ROOM_MAY_NOT_IMPORT[room])
    assert offenders and {p: names for p, names in offenders.items() if names} == {}


# Backends are built in one room, agentgrpo/generation/: the trainer's generator, and the
# backend and stop ids of `agentgrpo eval` and `doctor` (`generation.evaluation`). Every other
# room is handed a `rollout.GenerationBackend`.
def test_only_the_generation_room_imports_rollouts_backends():
    generation = ROOT / "agentgrpo" / "generation"
    paths = [p for p in (ROOT / "agentgrpo").rglob("*.py") if not p.is_relative_to(generation)]
    offenders = forbidden_imports(paths, ("rollout.backends",))
    assert offenders and {p: names for p, names in offenders.items() if names} == {}


# What accelerate says of the launch (engine, ZeRO stage, FSDP version and state dicts) is read
# in one place, `agentgrpo/placement.py`; everything else is handed its `Placement`.
LAUNCH_STATE = {
    "deepspeed_plugin",
    "fsdp_plugin",
    "is_fsdp2",
    "distributed_type",
    "is_deepspeed_enabled",
    "is_fsdp_enabled",
}


def reads_of_launch_state(path: Path) -> list[str]:
    """`x.state`, the attributes in LAUNCH_STATE, and `getattr(x, "<one of them>")` in `path`."""
    reads = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        attribute = isinstance(node, ast.Attribute) and (
            node.attr in LAUNCH_STATE
            or (node.attr == "state" and ast.unparse(node.value).endswith("accelerator"))
        )
        named = (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "getattr"
            and any(isinstance(a, ast.Constant) and a.value in LAUNCH_STATE for a in node.args)
        )
        if attribute or named:
            reads.append(f"{node.lineno}: {ast.unparse(node)}")
    return reads


def test_only_the_placement_reads_accelerates_launch_state():
    readers = {
        str(path.relative_to(ROOT)): reads
        for path in (ROOT / "agentgrpo").rglob("*.py")
        if (reads := reads_of_launch_state(path))
    }
    assert set(readers) == {"agentgrpo/placement.py"}, readers
