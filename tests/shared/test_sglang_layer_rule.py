"""aerie's DeepSeek layer-id rule, checked against the SGLang it serves with.

SGLang numbers EAGLE-3 capture layers per model class: most add 1 to every id ("Llama rule"),
DeepSeek's `set_eagle3_layers_to_capture` adds 1 only when the first id is 1 ("DeepSeek rule"),
and other classes inherit or delegate to one of those. aerie keeps the architectures that follow
the DeepSeek rule in `aerie.capture.SGLANG_DEEPSEEK_ARCHS`; an architecture missing there is
captured one layer off without any error (the seed's failure). So this test reads the installed
SGLang's model files (`sglang/srt/models/`, parsed, never imported) and derives the list itself:

- every architecture SGLang registers (`EntryClass`, followed through imports),
- its `set_eagle3_layers_to_capture`, found along its base classes (inheritance),
- the rule in that method: a comparison `<ids>[0] == 1` is the DeepSeek rule; a call
  `self.<attr>.set_eagle3_layers_to_capture(...)` delegates to the class assigned to `self.<attr>`
  (a constructor call, a class attribute, or an `__init__` parameter's default class).

A new SGLang release that adds such an architecture fails here instead of mis-capturing.

Config-level: `aerie capture-ids` on the real DeepSeek-V3 and Kimi-K2.5 config.json files
(tests/data/, written from the public files: 61 layers, H 7168, MLA ranks, YaRN; Kimi-K2.5 keeps
them under `text_config`) prints the ids SGLang must be given: `1 29 57`.
"""

from __future__ import annotations

import ast
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from aerie.app.cli import main as aerie_cli
from aerie.capture import SGLANG_DEEPSEEK_ARCHS, convention_for, from_engine_ids, to_engine_ids
from aerie.target import load_config
from tests.sglang_server import SGLANG_VENV, sglang_python

DATA = Path(__file__).parents[1] / "data"
METHOD = "set_eagle3_layers_to_capture"
PACKAGE = "sglang.srt.models"
# Registered architectures whose capture layers are set outside SGLang's own source.
EXTERNAL = {"MindSporeForCausalLM": "delegates to a MindSpore model chosen at run time (mindformers)"}


# --------------------------------------------------------------------------- reading SGLang's source


@dataclass
class Module:
    name: str
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    entry: list[str] = field(default_factory=list)  # names in `EntryClass = ...`


class ModelSource:
    """SGLang's model files, parsed: classes, imports (function-level ones too), EntryClass."""

    def __init__(self, models_dir: Path):
        self.modules: dict[str, Module] = {}
        for path in sorted(models_dir.rglob("*.py")):
            parts = path.relative_to(models_dir).with_suffix("").parts
            name = ".".join((PACKAGE, *parts)).removesuffix(".__init__")
            self.modules[name] = self._parse(name, ast.parse(path.read_text(encoding="utf-8"), str(path)))

    @staticmethod
    def _parse(name: str, tree: ast.Module) -> Module:
        module = Module(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(name.split(".")[: -node.level] + ([node.module] if node.module else []))
                for alias in node.names:
                    module.imports.setdefault(alias.asname or alias.name, (base, alias.name))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                module.classes[node.name] = node
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets
            ):
                module.entry = [n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)]
        return module

    def resolve(self, module: str, name: str, seen: frozenset = frozenset()) -> tuple[str, str] | None:
        """(module, class) that `name` means inside `module`, through imports; None outside models/."""
        m = self.modules.get(module)
        if m is None or (module, name) in seen:
            return None
        if name in m.classes:
            return module, name
        if name in m.imports:
            return self.resolve(*m.imports[name], seen=seen | {(module, name)})
        return None

    def class_named_by(self, module: str, expr: ast.expr) -> tuple[str, str] | None:
        """The class an expression names: `Name` or `imported_module.Name`."""
        if isinstance(expr, ast.Name):
            return self.resolve(module, expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            imported = self.modules[module].imports.get(expr.value.id)
            if imported is not None:
                return self.resolve(".".join(imported), expr.attr)
        return None

    def mro(self, ref: tuple[str, str]) -> list[tuple[str, str]]:
        order, todo = [], [ref]
        while todo:
            r = todo.pop(0)
            if r is None or r in order:
                continue
            order.append(r)
            node = self.modules[r[0]].classes[r[1]]
            todo += [self.class_named_by(r[0], base) for base in node.bases]
        return order

    def node(self, ref: tuple[str, str]) -> ast.ClassDef:
        return self.modules[ref[0]].classes[ref[1]]

    def method(self, ref: tuple[str, str], name: str) -> ast.FunctionDef | None:
        for r in self.mro(ref):
            for item in self.node(r).body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
        return None

    def constructed(self, ref: tuple[str, str], owner: tuple[str, str], func: ast.expr) -> tuple[str, str] | None:
        """The class that `func(...)`, written in a method of `owner`, constructs for class `ref`."""
        direct = self.class_named_by(owner[0], func)
        if direct is not None:
            return direct
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            name = func.attr  # a class attribute: body_cls = module.Class
        elif isinstance(func, ast.Name):
            name = func.id  # an __init__ parameter: language_model_cls=Class
        else:
            return None
        for r in self.mro(ref):  # the most derived definition wins
            for item in self.node(r).body:
                if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in item.targets):
                    return self.class_named_by(r[0], item.value)
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    pairs = list(zip(args.args[len(args.args) - len(args.defaults) :], args.defaults))
                    pairs += list(zip(args.kwonlyargs, args.kw_defaults))
                    for arg, default in pairs:
                        if arg.arg == name and default is not None:
                            return self.class_named_by(r[0], default)
        return None

    def attribute_classes(self, ref: tuple[str, str], attr: str) -> list[tuple[str, str] | str]:
        """Classes assigned to `self.<attr>` anywhere in ref's MRO (a string where unresolvable)."""
        found: list[tuple[str, str] | str] = []
        for r in self.mro(ref):
            for n in ast.walk(self.node(r)):
                if not (isinstance(n, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and t.attr == attr
                    for t in n.targets
                )):  # fmt: skip
                    continue
                if isinstance(n.value, ast.Constant) and n.value.value is None:
                    continue
                if isinstance(n.value, ast.Call):
                    found.append(self.constructed(ref, r, n.value.func) or ast.unparse(n.value.func))
                else:
                    found.append(ast.unparse(n.value))
        return found

    def rule(self, ref: tuple[str, str]) -> str:
        """'deepseek', 'other' (a method without the DeepSeek test), 'none' (no EAGLE-3 capture),
        or 'unresolved: ...' (delegates to something this reading cannot name)."""
        fn = self.method(ref, METHOD)
        if fn is None:
            return "none"
        if any(_first_id_is_one(n) for n in ast.walk(fn)):
            return "deepseek"
        for n in ast.walk(fn):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == METHOD
                    and isinstance(n.func.value, ast.Attribute) and isinstance(n.func.value.value, ast.Name)
                    and n.func.value.value.id == "self"):  # fmt: skip
                targets = self.attribute_classes(ref, n.func.value.attr)
                rules = {
                    self.rule(t) if isinstance(t, tuple) else f"unresolved: self.{n.func.value.attr} = {t}"
                    for t in targets
                }
                if not rules:
                    return f"unresolved: nothing assigned to self.{n.func.value.attr}"
                if len(rules) > 1:
                    return f"unresolved: self.{n.func.value.attr} is one of {sorted(rules)}"
                return rules.pop()
        return "other"

    def architectures(self) -> dict[str, str]:
        """Every registered architecture -> its rule."""
        out = {}
        for name, module in self.modules.items():
            for entry in module.entry:
                ref = self.resolve(name, entry)
                out[entry] = self.rule(ref) if ref is not None else f"unresolved: EntryClass {entry} in {name}"
        return out


def _first_id_is_one(node: ast.AST) -> bool:
    """`<ids>[0] == 1`: the DeepSeek rule's test."""
    return (
        isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)
        and isinstance(node.left, ast.Subscript) and isinstance(node.left.slice, ast.Constant)
        and node.left.slice.value == 0 and isinstance(node.comparators[0], ast.Constant)
        and node.comparators[0].value == 1
    )  # fmt: skip


@pytest.fixture(scope="module")
def sglang_rules() -> dict[str, str]:
    sglang_python()  # skips, or fails under AERIE_REQUIRE_SGLANG, without .venv-sglang
    found = sorted(SGLANG_VENV.glob("lib/python3*/site-packages/sglang/srt/models"))
    assert len(found) == 1, f"expected one sglang/srt/models in {SGLANG_VENV}, found {found}"
    return ModelSource(found[0]).architectures()


# --------------------------------------------------------------------------- the rule list


@pytest.mark.sglang
def test_aeries_deepseek_list_is_exactly_what_sglang_applies(sglang_rules):
    unresolved = {a: r for a, r in sglang_rules.items() if r.startswith("unresolved") and a not in EXTERNAL}
    assert not unresolved, f"cannot tell which layer-id rule these SGLang architectures apply: {unresolved}"
    deepseek = {a for a, r in sglang_rules.items() if r == "deepseek"}
    assert deepseek == SGLANG_DEEPSEEK_ARCHS, (
        f"aerie.capture.SGLANG_DEEPSEEK_ARCHS differs from the installed SGLang: add {sorted(deepseek - SGLANG_DEEPSEEK_ARCHS)}, "
        f"remove {sorted(SGLANG_DEEPSEEK_ARCHS - deepseek)}"
    )


@pytest.mark.sglang
def test_the_reading_finds_each_way_of_applying_a_rule(sglang_rules):
    # the scan must see the plain Llama rule, inheritance and delegation, not only DeepSeek's own method
    assert sglang_rules["DeepseekV3ForCausalLM"] == "deepseek"  # its own method
    assert sglang_rules["MistralLarge3ForCausalLM"] == "deepseek"  # inherited from DeepseekV3ForCausalLM
    assert (
        sglang_rules["KimiK25ForConditionalGeneration"] == "deepseek"
    )  # self.language_model = DeepseekV3ForCausalLM(...)
    assert sglang_rules["LlamaForCausalLM"] == sglang_rules["Qwen2ForCausalLM"] == "other"
    assert sglang_rules["Qwen3VLMoeForConditionalGeneration"] == "other"  # through an __init__ parameter's default
    assert sglang_rules["Qwen3_5ForCausalLM"] == "other"  # through a class attribute (body_cls)
    assert sum(r == "other" for r in sglang_rules.values()) >= 20
    # Kimi-VL (the older Kimi wrapper) has no EAGLE-3 capture in this SGLang at all
    assert sglang_rules["KimiVLForConditionalGeneration"] == "none"


# --------------------------------------------------------------------------- the real configs


def model_folder(tmp_path: Path, config_file: str) -> Path:
    folder = tmp_path / config_file.removesuffix(".json")
    folder.mkdir()
    shutil.copy(DATA / config_file, folder / "config.json")
    return folder


@pytest.mark.parametrize("config_file", ["deepseek_v3_config.json", "kimi_k25_config.json"])
def test_capture_ids_for_the_real_deepseek_v3_and_kimi_k25_configs(tmp_path, config_file):
    folder = model_folder(tmp_path, config_file)
    cfg = load_config(folder)  # Kimi-K2.5: the text model's numbers come from text_config
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (61, 7168)
    assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (1536, 512, 64)
    assert cfg["rope_scaling"]["type"] == "yarn"

    result = CliRunner().invoke(aerie_cli, ["capture-ids", "--model", str(folder)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "1 29 57"
    as_json = json.loads(CliRunner().invoke(aerie_cli, ["capture-ids", "--model", str(folder), "--json"]).output)
    assert as_json["convention"] == "sglang-deepseek" and as_json["capture_points"] == [2, 30, 58]


def test_points_where_the_two_rules_part():
    # The default points start at 2, where both rules give the same ids ([1, 29, 57]: the DeepSeek
    # model then adds 1). Any other first point separates them; the Llama rule's ids are one off.
    deepseek, llama = "sglang-deepseek", "sglang-llama"
    assert convention_for("sglang", "KimiK25ForConditionalGeneration") == deepseek
    assert to_engine_ids([2, 30, 58], deepseek, 61) == to_engine_ids([2, 30, 58], llama, 61) == [1, 29, 57]
    assert to_engine_ids([3, 30, 58], deepseek, 61) == [3, 30, 58]
    assert to_engine_ids([3, 30, 58], llama, 61) == [2, 29, 57]
    assert from_engine_ids([2, 29, 57], deepseek, 61) == [2, 29, 57]  # what SGLang captures for those ids
