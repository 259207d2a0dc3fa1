"""Token-level episodes: rendering, tool-call parsing, generation backends and the async engine.

The public API is re-exported here; the modules behind it are one stage each:
`types` (contracts), `template` (chat templates, append-only deltas), `parsers` (tool calls),
`tokens` (the append-only token row), `episode` (one episode's loop), `engine` (concurrency),
`record` (episodes as JSON lines), `transformers_backend` and `scripted` (generators).
"""

from rollout.backend import GenerationBackend
from rollout.engine import RolloutEngine
from rollout.episode import EpisodeConfig, PromptTooLongError, prompt_messages
from rollout.parsers import PARSERS, detect_parser, get_parser
from rollout.record import (
    EpisodeRecord,
    read_records,
    record_from_dict,
    record_line,
    record_to_dict,
)
from rollout.scripted import ScriptedBackend
from rollout.template import (
    BUILTIN_TEMPLATES,
    ChatRenderer,
    TemplateDriftError,
    ToolTemplateError,
    load_template,
)
from rollout.tokens import TokenRow
from rollout.transformers_backend import TransformersBackend
from rollout.types import (
    Completion,
    Episode,
    EpisodeRow,
    EpisodeStats,
    Finish,
    ParsedTurn,
    SamplingParams,
    ToolCall,
    ToolCallRecord,
)

__all__ = [
    "BUILTIN_TEMPLATES",
    "PARSERS",
    "ChatRenderer",
    "Completion",
    "Episode",
    "EpisodeConfig",
    "EpisodeRecord",
    "EpisodeRow",
    "EpisodeStats",
    "Finish",
    "GenerationBackend",
    "ParsedTurn",
    "PromptTooLongError",
    "RolloutEngine",
    "SamplingParams",
    "ScriptedBackend",
    "TemplateDriftError",
    "TokenRow",
    "ToolCall",
    "ToolCallRecord",
    "ToolTemplateError",
    "TransformersBackend",
    "detect_parser",
    "get_parser",
    "load_template",
    "prompt_messages",
    "read_records",
    "record_from_dict",
    "record_line",
    "record_to_dict",
]
