r"""Built-in reward functions: answer accuracy, think format, soft overlong punishment.

Each is a plain reward function with the calling convention of `agentgrpo.rewards.calls` (TRL's):
called once per batch with keyword arguments, returning one float (or None, "not applicable") per
completion.

- `accuracy_reward`: does the completion's final answer equal the gold `solution`? Verified as
  strings after normalisation, then numerically or symbolically with sympy.
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

sympy is imported on first use, so importing this module stays fast. It never evaluates text
with ``eval``: a small parser here turns simple LaTeX into sympy objects, and refuses powers and
factorials that would build huge numbers, so no answer can hang the trainer.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sympy

MAX_SYMPY_CHARS = 200  # longer answers are compared as strings only
_TAIL_CHARS = 2000  # math spans and numbers are looked for in this many final characters
_MAX_BOXED_CHARS = 2000  # a \boxed{ whose braces do not close within this many is skipped
_MAX_EXPONENT = 1000  # |exponent| of a numeric power, and largest factorial argument
_MAX_DIGITS = 10_000  # largest numeric power allowed, in decimal digits
_REL_TOL = 1e-6
_ABS_TOL = 1e-20  # absorbs evalf's rounding when one side is exactly zero
_FUNCTION_NAMES = {"sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp"}
_CONSTANT_NAMES = {"pi", "infty", "inf", "oo"}
_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
    "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon",
    "phi", "varphi", "chi", "psi", "omega",
}  # fmt: skip


# --- the reward functions -----------------------------------------------------------------


def accuracy_reward(
    completions: Sequence[Any], solution: Sequence[Any], **kwargs: Any
) -> list[float | None]:
    r"""1.0 where the completion's final answer equals the gold solution's, else 0.0.

    Both answers are read as the module docstring describes. They are equal when their
    normalised strings match (``$``, ``\left``/``\right``, spacing commands, spaces, thousands
    separators, a trailing ``.`` and units such as ``\%``, ``^\circ`` or ``\text{cm}`` are
    dropped; ``\dfrac``/``\tfrac`` read as ``\frac``), or when sympy finds them numerically
    equal (relative tolerance 1e-6) or ``simplify(a - b) == 0``. A leading ``x =`` is ignored,
    and tuples or intervals such as ``(1, 2)`` are compared element by element (brackets too).
    Expressions with free symbols are compared at a few fixed points before ``simplify``.

    Args:
        completions: One completion per sample: text, or a list of messages.
        solution: The gold answer or worked solution per sample (a dataset column).
        **kwargs: The other reward arguments; ignored.

    Returns:
        Per sample: 1.0 or 0.0; None where the gold solution holds no readable answer (the
        sample is not one this reward applies to). An unreadable completion scores 0.0.

    Example:
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

    Example:
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

    Example:
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

    Example:
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

    Example:
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

    Example:
        >>> answers_match(r"2\sqrt{3}", r"\sqrt{12}"), answers_match("(1, 2)", "(2, 1)")
        (True, False)

    """
    a, b = normalize_answer(answer), normalize_answer(gold)
    if a == b:
        return True
    (a_open, a_items, a_close), (b_open, b_items, b_close) = _split_items(a), _split_items(b)
    if (a_open, a_close, len(a_items)) != (b_open, b_close, len(b_items)):
        return False
    return all(_items_match(x, y) for x, y in zip(a_items, b_items, strict=True))


_DEPTH = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}
_ENCLOSURES = [("\\{", "\\}"), ("(", ")"), ("[", "]"), ("(", "]"), ("[", ")")]


def _split_items(s: str) -> tuple[str, list[str], str]:
    """Split a tuple, interval or list at its top-level commas: (opening, items, closing)."""
    for left, right in _ENCLOSURES:
        if s.startswith(left) and s.endswith(right):
            items = _split_top_level(s[len(left) : -len(right)])
            if items is not None and len(items) > 1:
                return left, items, right
    return "", _split_top_level(s) or [s], ""


def _split_top_level(s: str) -> list[str] | None:
    """Split at commas outside brackets; None when the brackets do not balance."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += _DEPTH.get(ch, 0)
        if depth < 0:
            return None
        if ch == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    return items + [s[start:]] if depth == 0 else None


def _items_match(a: str, b: str) -> bool:
    a, b = _drop_variable(a), _drop_variable(b)
    if a == b:
        return True
    return _sympy_equal(a, b)


def _drop_variable(s: str) -> str:
    """``x=5`` -> ``5``: a single name on the left of the only ``=`` is not part of the answer."""
    match = re.fullmatch(r"(?:[A-Za-z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?=([^=]+)", s)
    return match.group(1) if match else s


def _sympy_equal(a: str, b: str) -> bool:
    """Numeric or symbolic equality; any failure (parse, evaluation, size) means not equal."""
    x, y = _to_sympy(a), _to_sympy(b)
    if x is None or y is None:
        return False
    try:
        if x == y:
            return True
        symbols = sorted(x.free_symbols | y.free_symbols, key=str)
        if not symbols:
            return _close(x, y) is True
        verdicts = [_close(x.subs(point), y.subs(point)) for point in _points(symbols)]
        usable = [v for v in verdicts if v is not None]
        if len(usable) >= 2:
            return all(usable)
        return bool(_sympy().simplify(x - y) == 0)
    except Exception:  # sympy raises many kinds on odd input: all mean "not shown equal"
        return False


def _points(symbols: list[sympy.Symbol]) -> list[dict[sympy.Symbol, sympy.Float]]:
    """A few generic points, one value per symbol, one of them negative."""
    values = [0.5371, 1.2913, -0.8779, 2.0617]
    return [
        {s: _sympy().Float(values[(k + i) % len(values)]) for i, s in enumerate(symbols)}
        for k in range(len(values))
    ]


def _close(x: sympy.Expr, y: sympy.Expr) -> bool | None:
    """Relative closeness of two numbers; None when either does not evaluate to a finite one."""
    vx, vy = x.evalf(30), y.evalf(30)
    if not (vx.is_number and vy.is_number):
        return None
    if not (vx.is_finite and vy.is_finite):
        return True if vx == vy else None
    diff = abs(vx - vy).evalf(30)
    scale = max(abs(vx).evalf(30), abs(vy).evalf(30))
    return bool(diff <= _REL_TOL * scale or diff <= _ABS_TOL)


@functools.cache
def _sympy() -> Any:
    import sympy

    return sympy


@functools.lru_cache(maxsize=4096)
def _to_sympy(text: str) -> sympy.Expr | None:
    """Parse simple LaTeX into a sympy expression; None if it is not that or is too big."""
    if len(text) > MAX_SYMPY_CHARS:
        return None
    try:
        return _LatexParser(text).parse()
    except Exception:
        return None


# --- a small LaTeX parser -----------------------------------------------------------------

_TOKEN = re.compile(r"(\d+\.?\d*|\.\d+)|(\\[a-zA-Z]+|\\[{}|])|([a-zA-Z]+)|(\S)")
_OPERATOR_COMMANDS = {"\\cdot": "*", "\\times": "*", "\\ast": "*", "\\div": "/"}
_BRACKETS = {"(": ")", "{": "}", "[": "]", "\\{": "\\}"}


class _LatexParser:
    r"""Recursive descent over simple LaTeX math, building sympy objects.

    Grammar: sum := product (('+'|'-') product)*; product := unary (('*'|'/')? unary)* (a
    missing operator is implicit multiplication: ``2\sqrt{3}``, ``3x``); unary := '-' unary |
    power; power := postfix ('^' unary)?; postfix := primary '!'*.
    """

    def __init__(self, text: str) -> None:
        text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
        self.tokens: list[str] = []
        for number, command, word, other in _TOKEN.findall(text):
            if word and word not in _FUNCTION_NAMES | _CONSTANT_NAMES:
                self.tokens.extend(word)  # xy is x*y
            else:
                token = number or command or word or other
                self.tokens.append(_OPERATOR_COMMANDS.get(token, token))
        self.i = 0
        self.sp = _sympy()

    def parse(self) -> sympy.Expr:
        expr = self.sum()
        if self.i != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.i]!r}")
        return expr

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise ValueError(f"expected {expected!r}, found {token!r}")
        self.i += 1
        return token

    def sum(self) -> sympy.Expr:
        expr = self.product()
        while self.peek() in ("+", "-"):
            sign = 1 if self.take() == "+" else -1
            expr = expr + sign * self.product()
        return expr

    def product(self) -> sympy.Expr:
        expr = self.unary()
        while True:
            token = self.peek()
            if token in ("*", "/"):
                self.take()
                rhs = self.unary()
                expr = expr * rhs if token == "*" else expr / rhs
            elif token is not None and self._starts_primary(token):
                expr = expr * self.power()
            else:
                return expr

    def unary(self) -> sympy.Expr:
        if self.peek() in ("-", "+"):
            return (-1 if self.take() == "-" else 1) * self.unary()
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.postfix()
        if self.peek() != "^":
            return base
        self.take()
        exponent = self.unary()
        _check_power(base, exponent)
        return base**exponent

    def postfix(self) -> sympy.Expr:
        expr = self.primary()
        while self.peek() == "!":
            self.take()
            if not (expr.is_integer and 0 <= expr <= _MAX_EXPONENT):
                raise ValueError("factorial too big or not of a small integer")
            expr = self.sp.factorial(expr)
        return expr

    def _starts_primary(self, token: str) -> bool:
        if token in _BRACKETS:
            return True
        return token[0].isalnum() or token[0] == "." or (token[0] == "\\" and token != "\\}")

    def group(self) -> sympy.Expr:
        r"""A braced group, or a single primary as LaTeX allows (``\sqrt2``)."""
        if self.peek() == "{":
            self.take()
            expr = self.sum()
            self.take("}")
            return expr
        return self.primary()

    def primary(self) -> sympy.Expr:
        sp, token = self.sp, self.take()
        if token[0].isdigit() or token[0] == ".":
            return sp.Rational(token)
        if token in _BRACKETS:
            expr = self.sum()
            self.take(_BRACKETS[token])
            return expr
        if token == "|":
            expr = self.sum()
            self.take("|")
            return sp.Abs(expr)
        name = token.removeprefix("\\")
        if name == "frac":
            numerator = self.group()
            return numerator / self.group()
        if name == "sqrt":
            if self.peek() == "[":
                self.take()
                index = self.sum()
                self.take("]")
                radicand = self.group()
                _check_power(radicand, 1 / index)
                return radicand ** (1 / index)
            return sp.sqrt(self.group())
        if name in _FUNCTION_NAMES:
            function = {"ln": sp.log, "log": sp.log}.get(name) or getattr(sp, name)
            return function(self.power())
        if name == "pi":
            return sp.pi
        if name in ("infty", "inf", "oo"):
            return sp.oo
        if (len(name) == 1 and name.isalpha()) or name in _GREEK:
            return sp.Symbol(name + self._subscript())
        raise ValueError(f"cannot read {token!r}")

    def _subscript(self) -> str:
        if self.peek() != "_":
            return ""
        self.take()
        if self.peek() == "{":
            self.take()
            parts = []
            while self.peek() != "}":
                parts.append(self.take())
            self.take("}")
            return "_" + "".join(parts)
        return "_" + self.take()


def _check_power(base: sympy.Expr, exponent: sympy.Expr) -> None:
    """Refuse numeric powers that would build huge numbers (``9^{9^{9}}``) before sympy does."""
    if not exponent.is_number:
        return
    size = abs(complex(exponent.evalf(15)))
    if size > _MAX_EXPONENT:
        raise ValueError(f"exponent too large: {exponent}")
    if base.is_number:
        magnitude = abs(complex(base.evalf(15)))
        if magnitude and size * abs(math.log10(magnitude)) > _MAX_DIGITS:
            raise ValueError("power too large")
