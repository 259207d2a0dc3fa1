r"""Built-in reward functions: answer accuracy, think format, soft overlong punishment.

Each is a plain reward function with the calling convention of `agentgrpo.rewards.calls` (TRL's):
called once per batch with keyword arguments, returning one float (or None, "not applicable") per
completion.

- `accuracy_reward`: does the completion's final answer equal the gold `solution`? Verified as
  strings after normalisation, then by math-verify (the library TRL's uses), numerically or
  symbolically.
- `think_format_reward`: does the completion open with exactly one ``<think>...</think>`` block?
- `get_soft_overlong_punishment`: DAPO's length penalty, a factory for a reward function.

A completion is a string, or (conversational) a list of messages; then the text scored is the
content of the last assistant message.

How an answer is read (the same for completions and gold solutions), first match wins:

1. the content of the last ``\boxed{...}`` (or ``\fbox{...}``) with balanced braces;
2. the content of the last ``<answer>...</answer>``;
3. the whole text, when it is a bare answer (one short line of math: no words but one-letter
   names and known function names);
4. whichever ends later in the text: the last bare ``$...$`` / ``\(...\)`` span, or the last
   number (``-3``, ``1,000``, ``2.5``, ``3/4``). The math span is there so that a gold solution
   ending in ``$\frac{1}{2}$`` reads as 1/2, not 2.

math-verify runs in a process of its own, started on first use (`math_check`): importing this
module stays fast, no text is ever evaluated with ``eval``, and no answer can hang the trainer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from agentgrpo.rewards.math_check import MathChecker

MAX_SYMPY_CHARS = 200  # longer answers are compared as strings only
_TAIL_CHARS = 2000  # math spans and numbers are looked for in this many final characters
_MAX_BOXED_CHARS = 2000  # a \boxed{ whose braces do not close within this many is skipped
_FUNCTION_NAMES = {"sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp"}
_CONSTANT_NAMES = {"pi", "infty", "inf", "oo"}


# --- the reward functions -----------------------------------------------------------------


def accuracy_reward(
    completions: Sequence[Any], solution: Sequence[Any], **kwargs: Any
) -> list[float | None]:
    r"""1.0 where the completion's final answer equals the gold solution's, else 0.0.

    Both answers are read as the module docstring describes. They are equal when their
    normalised strings match (``$``, ``\left``/``\right``, spacing commands, spaces, thousands
    separators, a trailing ``.`` and units such as ``\%``, ``^\circ`` or ``\text{cm}`` are
    dropped; ``\dfrac``/``\tfrac`` read as ``\frac``), or when math-verify finds them the
    same number, expression, equation, tuple, interval or set (`answers_match`): ``x = 5``
    equals ``5``, ``(x+1)^2`` equals ``x^2 + 2x + 1``, ``\frac{1}{3}`` does not equal ``0.33``.

    Args:
        completions: One completion per sample: text, or a list of messages.
        solution: The gold answer or worked solution per sample (a dataset column).
        **kwargs: The other reward arguments; ignored.

    Returns:
        Per sample: 1.0 or 0.0; None where the gold solution holds no readable answer (the
        sample is not one this reward applies to). An unreadable completion scores 0.0.

    Examples:
        >>> accuracy_reward(
        ...     [r"So $x = \boxed{\frac{1}{2}}$.", "I think it is 3.", "Tea time."],
        ...     solution=["0.5", r"The answer is $\dfrac{1}{2}$", "0.5"],
        ... )
        [1.0, 0.0, 0.0]
        >>> accuracy_reward(["42"], solution=["See the figure."])
        [None]

    """
    rewards: list[float | None] = []
    for completion, gold_text in zip(completions, solution, strict=True):
        gold = extract_answer(str(gold_text))
        if gold is None:
            rewards.append(None)
            continue
        answer = extract_answer(completion_text(completion))
        rewards.append(float(answer is not None and answers_match(answer, gold)))
    return rewards


def think_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 where the text starts with one ``<think>...</think>`` block, else 0.0.

    The text must begin with ``<think>`` exactly (no leading whitespace), close it with
    ``</think>``, and hold no other ``<think>`` anywhere (so no nested or second block); what
    follows the block is free.

    Args:
        completions: One completion per sample: text, or a list of messages.
        **kwargs: The other reward arguments; ignored.

    Examples:
        >>> think_format_reward([
        ...     "<think>2 + 2 = 4</think>The answer is 4.",
        ...     "The answer is 4.",
        ...     "<think>a<think>b</think></think>4",
        ...     "<think>never closed",
        ... ])
        [1.0, 0.0, 0.0, 0.0]

    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        ok = text.startswith("<think>") and text.count("<think>") == 1 and "</think>" in text
        rewards.append(float(ok))
    return rewards


def get_soft_overlong_punishment(
    max_completion_len: int, soft_punish_cache: int
) -> Callable[..., list[float]]:
    """DAPO's soft overlong punishment: a reward that falls from 0 to -1 near the length limit.

    With ``L`` the completion length in tokens (``len(completion_ids[i])``) and
    ``start = max_completion_len - soft_punish_cache``: the reward is 0 for ``L <= start``,
    ``(start - L) / soft_punish_cache`` for ``start < L <= max_completion_len`` (so -1 at the
    limit) and -1 beyond it.

    Args:
        max_completion_len: The completion length limit, in tokens.
        soft_punish_cache: How many tokens before the limit the penalty starts; 0 for a hard
            -1 beyond the limit only.

    Returns:
        A reward function ``soft_overlong_punishment(completion_ids, **kwargs)``.

    Examples:
        >>> reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
        >>> reward(completion_ids=[[7] * 80, [7] * 90, [7] * 100, [7] * 120])
        [0.0, -0.5, -1.0, -1.0]

    """
    if max_completion_len < 1:
        raise ValueError(f"max_completion_len must be at least 1, got {max_completion_len}")
    if not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(
            f"soft_punish_cache must be in [0, max_completion_len={max_completion_len}], "
            f"got {soft_punish_cache}"
        )
    start = max_completion_len - soft_punish_cache

    def soft_overlong_punishment(
        completion_ids: Sequence[Sequence[int]], **kwargs: Any
    ) -> list[float]:
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= start:
                rewards.append(0.0)
            elif length <= max_completion_len:
                rewards.append((start - length) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

    return soft_overlong_punishment


# --- reading answers ----------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or the content of its last assistant message."""
    if isinstance(completion, str):
        return completion
    for message in reversed(list(completion)):
        if message.get("role") == "assistant":
            content = message.get("content") or ""
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content)
    return ""


_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d+(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)")
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$([^$]+)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_MATH_CHARS = re.compile(r"[\w\s\\{}\[\]()^+\-*/=.,!|<>:;%$°'~]*")  # no # ? " & @ ...
_BRACE = re.compile(r"[{}]")
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}")


def extract_answer(text: str) -> str | None:
    r"""The final answer written in `text`, read as the module docstring says; None if none.

    Examples:
        >>> extract_answer(r"We get \boxed{\frac{1}{2}} in the end.")
        '\\frac{1}{2}'
        >>> extract_answer("<answer>x = 5</answer>"), extract_answer("Add 2 and 3: 5 apples.")
        ('x = 5', '5')
        >>> extract_answer("no idea") is None
        True

    """
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    close = text.rfind("</answer>")
    open_ = text.rfind("<answer>", 0, close) if close >= 0 else -1
    if open_ >= 0 and text[open_ + 8 : close].strip():
        return text[open_ + 8 : close].strip()
    if _is_bare_answer(text):
        return text.strip()
    return _last_span_or_number(text)


def _last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` whose braces balance (a few tries from the end)."""
    end = len(text)
    for _ in range(10):
        start = max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))
        if start < 0:
            return None
        end = start
        i = start + (6 if text.startswith("\\boxed", start) else 5)
        if text.startswith(" ", i):  # \boxed 5
            match = re.match(r" +([^\s$]+)", text[i : i + 200])
            if match:
                return match.group(1)
            continue
        if not text.startswith("{", i):
            continue
        depth = 0
        for brace in _BRACE.finditer(text, i, i + _MAX_BOXED_CHARS):
            depth += 1 if brace[0] == "{" else -1
            if depth == 0:
                return text[i + 1 : brace.start()]
    return None


def _is_bare_answer(text: str) -> bool:
    """Whether `text` is one short line of math with no words, e.g. ``x = 5`` or ``(1, 2)``."""
    text = _strip_math_delimiters(text.strip())
    if not text or len(text) > MAX_SYMPY_CHARS or "\n" in text:
        return False
    if not re.search(r"[0-9A-Za-z]", text) or not _MATH_CHARS.fullmatch(text):
        return False
    rest = re.sub(r"\\[a-zA-Z]+", " ", _TEXT_COMMAND.sub(" ", text))
    known = _FUNCTION_NAMES | _CONSTANT_NAMES
    return all(len(w) == 1 or w.lower() in known for w in re.findall(r"[A-Za-z]+", rest))


def _last_span_or_number(text: str) -> str | None:
    """Whichever ends later: the last bare math span (in the tail) or the last number."""
    offset = max(0, len(text) - _TAIL_CHARS)
    numbers = list(_NUMBER.finditer(text, offset))
    if not numbers or numbers[-1].start() <= offset + 1:  # none in the tail, or maybe cut
        numbers = list(_NUMBER.finditer(text))
    best_end, best = (numbers[-1].end(), numbers[-1][0]) if numbers else (-1, None)
    for span in _MATH_SPAN.finditer(text, offset):
        content = next(g for g in span.groups() if g is not None)
        if span.end() > best_end and _is_bare_answer(content):
            best_end, best = span.end(), content.strip()
    return best


def _strip_math_delimiters(text: str) -> str:
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
            return text[len(left) : -len(right)].strip()
    return text


# --- comparing answers --------------------------------------------------------------------


def normalize_answer(answer: str) -> str:
    r"""The answer as a canonical string: the first, exact, comparison.

    Examples:
        >>> normalize_answer(r"$\left( \dfrac{3}{4}, 1{,}000 \right)$")
        '(\\frac{3}{4},1000)'
        >>> [normalize_answer(a) for a in [r"90^\circ", "1,000.", r"5\text{ cm}", "50\\%"]]
        ['90', '1000', '5', '50']

    """
    s = _strip_math_delimiters(answer.strip())
    s = re.sub(r"\\(?:left|right|big|Big|bigl|bigr|Bigl|Bigr)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[!,;: ]|~|\\displaystyle|\\quad|\\qquad", "", s)
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°|\\%|%|\\\$|\$", "", s)
    # A unit after the value (5\text{ cm}, 3\mbox{ m}^2) goes; a \text{...} answer is unwrapped.
    s = re.sub(r"(?<=\S)\s*" + _TEXT_COMMAND.pattern + r"(?:\^\{?\d\}?)?\s*$", "", s)
    s = _TEXT_COMMAND.sub(r"\1", s)
    # Spaces go, except one that ends a command before a letter (\pi r is not \pir).
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])|\s+", lambda m: (m[1] or "") and m[1] + " ", s)
    s = s.rstrip(".")
    s = re.sub(r"(?<=\d)\{,\}(?=\d)", "", s)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s


def answers_match(answer: str, gold: str) -> bool:
    r"""Whether two extracted answers are equal, as `accuracy_reward` decides.

    Equal normalised strings (`normalize_answer`) match. Otherwise math-verify decides, in its
    own process (`math_check.MathChecker`, at most 5 s a comparison). Answers it could spend
    minutes on are compared as strings only: longer than `MAX_SYMPY_CHARS`, a power inside an
    exponent (``10^{10^{10}}``), or an exponent of four digits or more.

    Examples:
        >>> answers_match(r"2\sqrt{3}", r"\sqrt{12}"), answers_match("(1, 2)", "(2, 1)")
        (True, False)

    """
    a, b = normalize_answer(answer), normalize_answer(gold)
    if a == b:
        return True
    if any(len(s) > MAX_SYMPY_CHARS or _costly(s) for s in (a, b)):
        return False
    return _checker().equal(b, a)


@functools.cache
def _checker() -> MathChecker:
    return MathChecker()


_OPENING, _CLOSING = "{([", "})]"
_BIG_EXPONENT = re.compile(r"\^\s*[{(\[]?\s*-?\d{4}")


def _costly(text: str) -> bool:
    """Whether sympy may compute for long over `text`: towers of powers, or huge exponents."""
    in_exponent: list[bool] = []  # per open bracket: whether it opened an exponent
    after_caret = False
    for ch in text:
        if ch == "^":
            if any(in_exponent):
                return True
            after_caret = True
        elif ch in _OPENING:
            in_exponent.append(after_caret)
            after_caret = False
        elif ch in _CLOSING:
            if in_exponent:
                in_exponent.pop()
        elif not ch.isspace():
            after_caret = False
    return _BIG_EXPONENT.search(text) is not None
