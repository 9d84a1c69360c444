"""The documents name only what exists: a newcomer copying a command or opening a path finds it.

Checked in README.md, ARCHITECTURE.md, CONTRIBUTING.md, BENCHMARKS.md, docs/*.md and
services/*/README.md, in fenced blocks and `inline code`:
- a repository path (its first part a top-level entry of the repository or of the document's
  folder) exists; `<placeholder>` parts and globs match something;
- `aerie SUB [SUB2] --option`: the sub-command and every option are the real CLI's (the click
  commands the `aerie.commands` entry points load: what `aerie ... --help` lists);
- `celery -A APP CMD --option`: APP is a module of the repository, CMD one of aerie's Celery
  commands (`celery.commands` entry points) or Celery's own, the option CMD's;
- `python -m MODULE`: MODULE is a file of the repository (or an installed module);
- `aerie...` dotted names (`aerie.settings`, `aerie_trainer.model.own_shape`): the module file
  exists and the attribute, if any, is defined in it;
- every `AERIE_*` variable is a field of aerie.settings.Settings or named in code; any other
  VARIABLE_NAME in code is named in the code, docker-compose.yml, .env.example or k8s/;
- `tests/x.py -k words` and `tests/x.py::name` select a test of that file, `test_name` one of the suite;
- a relative link's file exists, and its #anchor is one of that file's headings;
- the README's "Two commands" are set-up + `aerie run` and the test command `.ci/run` runs.
(docs/deploy.md's compose and kubectl lines are tests/deploy/test_docs_and_shell.py's.)
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from importlib.metadata import entry_points
from importlib.util import find_spec
from pathlib import Path

import click
from markdown_it import MarkdownIt

from tests.services import REPO

DOCS = [
    REPO / "README.md",
    REPO / "ARCHITECTURE.md",
    REPO / "CONTRIBUTING.md",
    REPO / "BENCHMARKS.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "services").glob("*/README.md")),
]
# Where code (not prose) lives: an AERIE_* name found here exists.
CODE_SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".toml", ".example", ".cfg", ".ini", ""}
CODE_ROOTS = [
    "shared",
    "services",
    "scripts",
    "k8s",
    "tests",
    "benchmarks",
    ".ci",
    "docker-compose.yml",
    ".env.example",
]
COMMAND_LINE = re.compile(r"^(\.venv/bin/)?(aerie|celery|python|bash) ")
OTHER_TOOLS_VARIABLES = {"NVIDIA_VISIBLE_DEVICES", "COMPOSE_PROJECT_NAME"}  # Docker's, read by no aerie file
EXTERNAL = {"sglang"}  # installed in .venv-sglang, not in .venv
CELERY_OWN = {"worker", "inspect", "control", "purge", "status", "call", "events", "beat", "result", "report", "shell"}


def snippets(text: str) -> list[str]:
    """Each line of every fenced block, and every inline code span."""
    found: list[str] = []
    for block in MarkdownIt().parse(text):
        if block.type == "fence" and block.info.strip() in ("bash", "sh", "shell", "console"):
            found += block.content.replace("\\\n", " ").splitlines()
        elif block.type == "fence" and not block.info.strip():  # plain text: its unindented command lines
            found += [line for line in block.content.replace("\\\n", " ").splitlines() if COMMAND_LINE.match(line)]
        elif block.type == "inline":
            found += [t.content for t in block.children or [] if t.type == "code_inline"]
    return found


def commands(line: str) -> list[list[str]]:
    """The simple commands of one line (split at && || ; |), comments dropped."""
    lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    argv: list[list[str]] = [[]]
    for t in tokens:
        if set(t) <= set(";&|"):
            argv.append([])
        elif argv[-1] or not re.match(r"^[A-Z_]+=", t):  # VAR=value before a command: not the command
            argv[-1].append(t)
    return [a for a in argv if a]


@cache
def aerie_cli() -> click.Group:
    from aerie.app.cli import main

    return main


@cache
def subcommand(path: tuple[str, ...], name: str) -> click.Command | None:
    """`aerie PATH... NAME`'s click command (None: no such command), each loaded once."""
    group = subcommand(path[:-1], path[-1]) if path else aerie_cli()
    return group.get_command(click.Context(group), name) if isinstance(group, click.Group) else None


def options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}


def check_aerie(argv: list[str]) -> list[str]:
    command: click.Command = aerie_cli()
    path = ["aerie"]
    args = argv[1:]
    while isinstance(command, click.Group) and args and not args[0].startswith("-"):
        if args[0].startswith(("<", "[")) or args[0] in ("COMMAND", "..."):
            return []
        sub = subcommand(tuple(path[1:]), args[0])
        if sub is None:
            return [f"`{' '.join(path)} {args[0]}`: no such command"]
        path.append(args.pop(0))
        command = sub
    known = options(command) | ({"--version", "--debug"} if len(path) == 1 else set())
    return [
        f"`{' '.join(path)} {opt}`: no such option"
        for opt in (a.lstrip("[").split("=")[0] for a in args if a.lstrip("[").startswith("--"))
        if opt not in known and opt != "--"
    ]


def check_celery(argv: list[str]) -> list[str]:
    if "-A" not in argv or argv.index("-A") + 2 >= len(argv):
        return []
    i = argv.index("-A")
    app, sub, rest = argv[i + 1], argv[i + 2], argv[i + 3 :]
    problems = [] if module_exists(app) else [f"`celery -A {app}`: no module {app}"]
    ours = {ep.name: ep for ep in entry_points(group="celery.commands")}
    if sub in ours:
        known = options(ours[sub].load()) | {"--debug"}
        problems += [
            f"`celery {sub} {o}`: no such option" for o in rest if o.startswith("--") and o.split("=")[0] not in known
        ]
    elif sub not in CELERY_OWN:
        problems.append(f"`celery -A {app} {sub}`: no such command")
    return problems


def module_exists(name: str) -> bool:
    if module_file(name):
        return True
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def module_file(name: str) -> Path | None:
    """The repository file of a dotted module name, without importing it."""
    parts = name.split(".")
    roots = [REPO, REPO / "shared", *(p for p in (REPO / "services").iterdir() if p.is_dir())]
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


DOTTED = re.compile(r"^(aerie(?:_extractor|_trainer|_sglang)?(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?$")


@cache
def entry_point_groups() -> set[str]:
    """The entry-point groups the repository's packages declare (`aerie.stages`, `aerie.commands`)."""
    import tomllib

    return {
        group
        for p in [REPO / "shared" / "pyproject.toml", *(REPO / "services").glob("*/pyproject.toml")]
        for group in tomllib.loads(p.read_text()).get("project", {}).get("entry-points", {})
    }


def check_dotted(name: str) -> list[str]:
    if name in entry_point_groups():
        return []
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:n]))
        if path is None:
            continue
        attrs = parts[n:]
        if not attrs:
            return []
        text = "\n".join(p.read_text() for p in ([path] if path.name != "__init__.py" else path.parent.glob("*.py")))
        # the first attribute is defined in the module (a class's attribute: defined anywhere in it)
        if all(
            re.search(rf"^\s*(?:async def|def|class)\s+{a}\b|^\s*{a}\s*[:=]|\b{a}\s*=|import .*\b{a}\b", text, re.M)
            for a in attrs
        ):
            return []
        return [f"`{name}`: {'.'.join(attrs)} is not defined in {path.relative_to(REPO)}"]
    return [f"`{name}`: no module {'.'.join(parts[:2])} in the repository"]


PATHLIKE = re.compile(
    r"^\.?[A-Za-z0-9_.\-<>*]+(/[A-Za-z0-9_.\-<>*{},]*)+$|^[A-Za-z0-9_\-]+\.(py|sh|md|toml|lock|in|yaml|yml)$"
)


def check_path(token: str, doc: Path) -> list[str]:
    token = token.split("::")[0].rstrip(":,.")
    if token.startswith(("/", "~", "./", "../", ".venv", "http", "s3:", "file:")) or "://" in token or "..." in token:
        return []  # outside the repository, made by the reader, or elided
    if token.count("<") != token.count(">"):
        return []
    if not PATHLIKE.match(token):
        return []
    first = token.split("/")[0]
    bases = [b for b in (REPO, doc.parent) if (b / first).exists() or "<" in first or "*" in first]
    if "/" not in token:  # a bare file name: beside the document, or anywhere in the repository
        if "<" in token or token in repository_names():
            return []
        return [f"`{token}`: no file of that name in the repository"]
    if not bases:
        return []
    pattern = re.sub(r"<[^>]*>", "*", token.rstrip("/"))
    pattern = re.sub(r"\{([^}]*)\}", "*", pattern)
    if any(b.glob(pattern) for b in bases) and any(list(b.glob(pattern)) for b in bases):
        return []
    return [f"`{token}`: no such path in the repository"]


@cache
def repository_names() -> set[str]:
    return {Path(line).name for line in git_files()}


@cache
def git_files() -> list[str]:
    import subprocess

    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True
    )
    return out.stdout.splitlines()


@cache
def code_names() -> set[str]:
    return set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", code_text()))


@cache
def code_text() -> str:
    texts = []
    for root in CODE_ROOTS:
        p = REPO / root
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file() and f.suffix in CODE_SUFFIXES]
        texts += [
            f.read_text(errors="replace")
            for f in files
            if "egg-info" not in str(f) and "__pycache__" not in str(f) and f != Path(__file__)
        ]
    return "\n".join(texts)


def check_env(name: str) -> list[str]:
    """An AERIE_* variable is a setting or a name the code reads; another name (a compose variable,
    a k8s secret key, a dtype) is named in the code, the compose files or k8s/."""
    from aerie.settings import Settings

    if name.startswith("AERIE_") and name.removeprefix("AERIE_").lower() in Settings.model_fields:
        return []
    if name.endswith("_") or name in code_names():  # a prefix (AERIE_TEST_) or a name in code
        return []
    return [f"{name}: neither a setting of aerie.settings nor named in code, compose or k8s/"]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def check_links(doc: Path, text: str) -> list[str]:
    """Every relative link's file exists, and its #anchor is a heading of that file."""
    found = []
    for block in MarkdownIt().parse(text):
        for token in block.children or []:
            href = str(token.attrs.get("href", "")) if token.type == "link_open" else ""
            if not href or re.match(r"^[a-z]+:", href):
                continue
            target, _, anchor = href.partition("#")
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists():
                found.append(f"link {href}: no such file")
            elif anchor and path.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", path.read_text() if target else text, re.M)
                if anchor not in {slug(h) for h in headings}:
                    found.append(f"link {href}: no heading #{anchor} in {path.name}")
    return found


@cache
def suite_test_names() -> set[str]:
    return {n for p in (REPO / "tests").rglob("test_*.py") for n in re.findall(r"def (test_\w+)", p.read_text())}


def check_tests(snippet: str) -> list[str]:
    """`tests/x.py -k "a or b"` and `tests/x.py::name`: each name selects a test of that file; a
    `test_name` (or `test_prefix_*`) alone is a test of the suite."""
    found = []
    for path, quoted, bare in re.findall(r"(tests/[\w/]+\.py) -k (?:\"([^\"]+)\"|(\S+))", snippet):
        words = set(re.findall(r"\w+", quoted or bare)) - {"and", "or", "not"}
        text = (REPO / path).read_text() if (REPO / path).is_file() else ""
        found += [f"`{path} -k {w}`: selects no test" for w in sorted(words) if text and w not in text]
    for name, star in re.findall(r"^(test_\w+?)(\*?)$", snippet.strip()):
        if not any(t == name or (star and t.startswith(name)) for t in suite_test_names()):
            found.append(f"`{name}{star}`: no such test under tests/")
    for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", snippet):
        if (REPO / path).is_file() and not re.search(rf"def {name}\b", (REPO / path).read_text()):
            found.append(f"`{path}::{name}`: no such test")
    return found


def problems_of(doc: Path, text: str | None = None) -> list[str]:
    text = doc.read_text() if text is None else text
    found: list[str] = check_links(doc, text)
    for snippet in snippets(text):
        found += check_tests(snippet)
    for snippet in snippets(text):
        for argv in commands(snippet):
            head = Path(argv[0]).name
            if head == "aerie":
                found += check_aerie(argv)
            elif head == "celery":
                found += check_celery(argv)
            elif Path(argv[0]).name.startswith("python") and argv[1:2] == ["-m"] and len(argv) > 2:
                module = argv[2]
                if "<" not in module and module.split(".")[0] not in EXTERNAL and not module_exists(module):
                    found.append(f"`python -m {module}`: no such module")
            for token in argv:
                m = DOTTED.match(token)
                if m:
                    found += check_dotted(m.group(1))
                else:
                    found += check_path(token, doc)
    variables = set(re.findall(r"\bAERIE_[A-Z0-9_]+", text))  # anywhere; other names in code only
    variables |= {v for snippet in snippets(text) for v in re.findall(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b", snippet)}
    for name in sorted(variables - OTHER_TOOLS_VARIABLES):
        found += check_env(name)
    return [f"{doc.relative_to(REPO)}: {p}" for p in dict.fromkeys(found)]


def test_the_documents_name_only_what_exists():
    problems = [p for doc in DOCS for p in problems_of(doc)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_what_it_is_for():
    readme = REPO / "README.md"
    broken = """
`shared/aerie/nothing.py`, `aerie_trainer.model.no_such_shape`, `AERIE_NO_SUCH_SETTING`, `EXTRACTOR_QUEUE`,
[gone](docs/gone.md), [no heading](docs/deploy.md#no-such-heading),
`tests/shared/test_store.py -k "s3 and no_such_story"`, `tests/shared/test_store.py::test_no_such_story`,
`test_no_such_story_anywhere`

```bash
aerie run --no-such-flag
aerie serve
celery -A aerie_extractor.worker enqueue --no-such-option x
python -m benchmarks.no_such_bench
```
"""
    problems = "\n".join(problems_of(readme, broken))
    for expected in (
        "`shared/aerie/nothing.py`: no such path",
        "`aerie_trainer.model.no_such_shape`: no_such_shape is not defined",
        "AERIE_NO_SUCH_SETTING: neither",
        "EXTRACTOR_QUEUE: neither",
        "link docs/gone.md: no such file",
        "`tests/shared/test_store.py -k no_such_story`: selects no test",
        "`tests/shared/test_store.py::test_no_such_story`: no such test",
        "`test_no_such_story_anywhere`: no such test under tests/",
        "link docs/deploy.md#no-such-heading: no heading #no-such-heading in deploy.md",
        "`aerie run --no-such-flag`: no such option",
        "`aerie serve`: no such command",
        "`celery enqueue --no-such-option`: no such option",
        "`python -m benchmarks.no_such_bench`: no such module",
    ):
        assert expected in problems, f"{expected!r} not in:\n{problems}"
    assert not problems_of(
        readme, "`shared/aerie/settings.py` `aerie run --quick` `aerie stack up --dir x` `AERIE_STORE`"
    )


def two_commands(readme: str) -> list[str]:
    """The command lines (comments dropped) of the README's "Two commands" block."""
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in MarkdownIt().parse(section) if b.type == "fence")
    return [line.split("#", 1)[0].strip() for line in block.content.splitlines() if line.split("#", 1)[0].strip()]


def test_the_readme_keeps_two_commands_and_ci_runs_its_test_command():
    main_job, tests = two_commands((REPO / "README.md").read_text())
    assert main_job == "bash scripts/setup.sh && .venv/bin/aerie run", main_job
    ci = [
        line
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == [f"exec {tests}"], f".ci/run runs {ci}, the README's test command is {tests!r}"
    assert (REPO / tests.split()[-1]).is_file()


def test_benchmarks_md_names_every_benchmark_script():
    """BENCHMARKS.md is the map of benchmarks/: a script it does not name is one nobody finds."""
    text = (REPO / "BENCHMARKS.md").read_text()
    scripts = [p.name for pattern in ("*.py", "*.sh") for p in sorted((REPO / "benchmarks").glob(pattern))]
    assert scripts and [s for s in scripts if s != "__init__.py" and s not in text] == []
