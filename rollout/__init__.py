"""Token-level episodes: rendering, tool-call parsing, generation backends and the async engine.

The public API is re-exported here. The episode core is one stage per module: `types`
(contracts), `backend` (the generator protocol), `template` (rendering to ids: append-only
deltas, pictures' placeholders expanded by a vision-language model's processor),
`template_source` (where a template comes from), `template_sandbox` (every render bounded in
time and size), `images` (processors, and the pixel tensors a forward takes), `tokens` (the
append-only token row), `episode` (one episode's loop), `engine` (concurrency), `record`
(episodes as JSON lines), `demonstrations` (warm-start rows). Three rooms hang off it and the
core imports only the first: `parsers` (tool calls), `backends` (transformers, vLLM, the
scripted double) and `agents` (an agent's own loop through a chat endpoint, handed to the engine
as its `EpisodePlayer`).
"""

from rollout.backend import GenerationBackend
from rollout.backends.scripted import ScriptedBackend
from rollout.backends.transformers import TransformersBackend
from rollout.engine import EpisodePlayer, PlaySetup, RolloutEngine
from rollout.episode import EpisodeConfig, PromptTooLongError
from rollout.parsers import PARSERS, detect_parser, get_parser
from rollout.prompts import prompt_messages
from rollout.record import (
    EpisodeRecord,
    read_records,
    record_from_dict,
    record_line,
    record_to_dict,
)
from rollout.template import ChatRenderer, TemplateDriftError
from rollout.template_sandbox import RenderLimits, TemplateRenderError
from rollout.template_source import BUILTIN_TEMPLATES, ToolTemplateError, load_template
from rollout.tokens import TokenRow
from rollout.types import (
    Compaction,
    Completion,
    Episode,
    EpisodeRow,
    EpisodeStats,
    Finish,
    ParsedTurn,
    Pictures,
    SamplingParams,
    ToolCall,
    ToolCallRecord,
    TurnRecord,
)

__all__ = [
    "BUILTIN_TEMPLATES",
    "PARSERS",
    "ChatRenderer",
    "Compaction",
    "Completion",
    "Episode",
    "EpisodeConfig",
    "EpisodePlayer",
    "EpisodeRecord",
    "EpisodeRow",
    "EpisodeStats",
    "Finish",
    "GenerationBackend",
    "ParsedTurn",
    "Pictures",
    "PlaySetup",
    "PromptTooLongError",
    "RenderLimits",
    "RolloutEngine",
    "SamplingParams",
    "ScriptedBackend",
    "TemplateDriftError",
    "TemplateRenderError",
    "TokenRow",
    "ToolCall",
    "ToolCallRecord",
    "ToolTemplateError",
    "TransformersBackend",
    "TurnRecord",
    "detect_parser",
    "get_parser",
    "load_template",
    "prompt_messages",
    "read_records",
    "record_from_dict",
    "record_line",
    "record_to_dict",
]
