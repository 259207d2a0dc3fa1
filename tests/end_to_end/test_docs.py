"""The docs cannot drift from the code: their Python blocks run and their commands parse.

Every ```python block of README.md and docs/*.md runs, each on its own, in a fresh namespace.
An HTML comment on the line before a block changes how:

- `<!-- compile-only: why -->`: the block is compiled and its imports run, nothing else (it
  would load a real model or train);
- `<!-- requires: module -->`: skipped where the optional `module` is not installed;
- `<!-- given: a, b, ... -->`: the block uses names it does not define; the test supplies them
  (`GIVEN`), and a block with top-level `await` is awaited;
- `<!-- process: why -->`: the block starts a process; its test is marked `process`.

Every `agentgrpo` command line of a ```bash block is read by the real command-line parser, so a
renamed option or subcommand fails here. The site itself is built by `make docs`.
"""

from __future__ import annotations

import ast
import asyncio
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from agentgrpo.cli import build_parser
from agentgrpo.cli.options import check_unknown_options
from environments import Counter
from tests.support.paths import REPO

ROOT = REPO
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(
    r"(?:^<!-- (?P<marker>[\w-]+): (?P<detail>.*?) -->\n)?^```(?P<lang>\w+)\n(?P<code>.*?)^```",
    re.DOTALL | re.MULTILINE,
)
MARKERS = {None, "compile-only", "requires", "given", "process"}


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its marker (if any) and its code."""

    page: Path
    line: int
    lang: str
    marker: str | None
    detail: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(lang: str) -> list[Block]:
    """Every ```lang block of the pages, in order."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            if m["lang"] == lang:
                line = text.count("\n", 0, m.start("code"))  # the fence's line, 1-based
                found.append(Block(page, line, lang, m["marker"], m["detail"] or "", m["code"]))
    return found


def given_names(request) -> dict[str, object]:
    """What `<!-- given: ... -->` blocks may use: a tiny model, a tokenizer, one Counter row."""
    return {
        "model": request.getfixturevalue("tiny_model"),
        "tokenizer": request.getfixturevalue("tokenizer"),
        "rows": Counter.dataset("train").select(range(1)).to_list(),
    }


def run_block(block: Block, namespace: dict[str, object]) -> None:
    """Execute `block` in `namespace`, awaiting it when it has top-level `await`."""
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    code = compile(block.code, block.where, "exec", flags=flags, dont_inherit=True)  # as written
    result = eval(code, namespace)  # a coroutine exactly when the block awaits
    if asyncio.iscoroutine(result):
        asyncio.run(result)


def imports_only(block: Block) -> str:
    """The block's top-level import statements, as source."""
    tree = ast.parse(block.code, block.where)
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    return "\n".join(ast.unparse(node) for node in imports)


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(b, id=b.where, marks=[pytest.mark.process] if b.marker == "process" else [])
        for b in blocks("python")
    ],
)
def test_python_block_runs(block, request):
    assert block.marker in MARKERS, f"{block.where}: unknown marker {block.marker!r}"
    namespace: dict[str, object] = {"__name__": f"docs_{block.page.stem}_{block.line}"}
    if block.marker == "requires":
        pytest.importorskip(block.detail)
    if block.marker == "given":
        names = [name.strip() for name in block.detail.split("(")[0].split(",")]
        namespace.update({name: given_names(request)[name] for name in names})
    if block.marker == "compile-only":
        compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        block = Block(block.page, block.line, block.lang, None, "", imports_only(block))
    run_block(block, namespace)


def test_the_docs_keep_an_example_of_each_environment_shape():
    assert len(blocks("python")) >= 13
    code = "\n".join(block.code for block in blocks("python"))
    for shape in ("class Light", "class Inventory", "gym_environment(", "demonstrations("):
        assert shape in code, f"docs/environments.md lost its {shape} example"


def agentgrpo_commands() -> list:
    """The argv of each `agentgrpo ...` line of the bash blocks, comments dropped."""
    commands = []
    for block in blocks("bash"):
        started = ""  # the lines of a command continued with a backslash, so far
        for offset, line in enumerate(block.code.splitlines(), start=1):
            if line.endswith("\\"):
                started += line[:-1] + " "
                continue
            line, started = started + line, ""
            words = shlex.split(line.split("&&")[-1], comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # PYTHONPATH=. agentgrpo
                words.pop(0)
            if words[:1] == ["agentgrpo"] and words[1:2] != ["vllm-serve"]:
                where = f"{block.page.relative_to(ROOT)}:{block.line + offset}"
                commands.append(pytest.param(words, id=where))
    return commands


@pytest.mark.parametrize("argv", agentgrpo_commands())
def test_documented_command_parses(argv):
    parser, commands = build_parser()
    namespace, unknown = parser.parse_known_args(argv[1:])
    assert namespace.command in commands, argv
    check_unknown_options(unknown, commands[namespace.command])


def test_the_readme_links_point_at_files():
    """README.md is outside the site that `mkdocs build --strict` checks, so its links are here."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [target for target in targets if "://" not in target]
    assert len(local) >= 10
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


GOOD_PAGE = """# A page

See [the other section](#a-section) and [the API](api.md).

## A section
"""
BROKEN_PAGES = {  # the page, and what its error names
    "link": ("# A page\n\nSee [a missing page](missing.md).\n", "missing.md"),
    "anchor": ("# A page\n\nSee [a section](api.md#no-such-section).\n", "#no-such-section"),
    "api reference": ("# A page\n\n::: agentgrpo.no_such_name\n", "agentgrpo.no_such_name"),
}


def build_docs(tmp_path: Path, page: str) -> subprocess.CompletedProcess:
    """`make docs` on a site of the repository's mkdocs.yml whose pages are `page` and api.md."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(page)
    (docs / "api.md").write_text("# API\n\n::: agentgrpo.GRPOConfig\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.update(docs_dir=str(docs), nav=["index.md", "api.md"])
    config["hooks"] = [str(ROOT / hook) for hook in config["hooks"]]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    command = ["make", "-s", "-C", str(ROOT), "docs", f"MKDOCS_CONFIG={tmp_path / 'mkdocs.yml'}"]
    command.append(f"SITE_DIR={tmp_path / 'site'}")
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.process
def test_make_docs_builds_a_site_whose_links_anchors_and_references_resolve(tmp_path):
    built = build_docs(tmp_path, GOOD_PAGE)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("GRPOConfig") > 1


@pytest.mark.parametrize("broken", BROKEN_PAGES)
@pytest.mark.process
def test_make_docs_fails_on_a_broken_link_anchor_or_api_reference(broken, tmp_path):
    page, named = BROKEN_PAGES[broken]
    built = build_docs(tmp_path, page)
    assert built.returncode != 0, f"make docs passed a page with a broken {broken}"
    assert named in built.stderr
