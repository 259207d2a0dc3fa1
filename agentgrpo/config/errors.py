"""The one way a config check fails: a ValueError that says what to change."""


def require(condition: bool, message: str) -> None:
    """Raise `ValueError(message)` unless `condition` holds; `message` says what to change."""
    if not condition:
        raise ValueError(message)
