"""`GRPOConfig` fields of what a run logs: completions tables and where they go."""

from dataclasses import dataclass, field


@dataclass
class LoggingFields:
    """Completions logged to the console, the trackers and the Hub."""

    log_completions: bool = field(
        default=False,
        metadata={"help": "Log a sample of prompts and completions every logging_steps."},
    )
    log_multimodal: bool = field(
        default=True, metadata={"help": "Include images and videos in logged completions."}
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={"help": "Completions printed to the console. None: all logged ones."},
    )
    log_unique_prompts: bool = field(
        default=False, metadata={"help": "Log each distinct prompt once."}
    )
    log_completions_hub_repo: str | None = field(
        default=None,
        metadata={
            "help": "Hub repository ('user/name' or 'name') to upload logged completions to; "
            "public unless hub_private_repo. Needs log_completions."
        },
    )
