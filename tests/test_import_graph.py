"""The subpackages import one way (issue 29): tools and jobs above the Lightning glue, the glue above the engines, the
engines above storage and the runtime. Read from the source, so a new import that runs upward or closes a cycle fails
here before it confuses a reader."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moc_lightning"

LAYERS: dict[str, int] = {
    "runtime": 0, "storage": 0, "data": 0,
    "engine": 1,
    "sharding": 2,
    "config": 3,
    "pec": 4,
    "memory": 5, "export": 5, "models": 5,
    "replay": 6,
    "lightning": 7,
    "jobs": 8,
    "tools": 9,
    "": 10,
}  # fmt: skip
"""Each part of the package (a subpackage, or a module at the top level; ``""`` is the top-level ``__init__``, the
public API) and its layer: a part imports parts of lower layers and itself, never a part of its own layer or above."""


def part_of(module: str) -> str:
    """The part of the package a dotted module name under ``moc_lightning`` belongs to."""
    parts = module.split(".")
    assert parts[0] == "moc_lightning", module
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path) -> set[str]:
    """The ``moc_lightning`` modules (or packages) a source file imports, at any depth of its code."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("moc_lightning")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("moc_lightning"):
                found.add(name)
    return found


def edges() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> the files that import across it."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"))
        for target in {part_of(name) for name in imports(path)} - {source}:
            found.setdefault((source, target), []).append(str(path.relative_to(PACKAGE.parent)))
    return found


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert parts | {""} == LAYERS.keys(), "give every new subpackage or top-level module its layer in LAYERS"


def test_no_part_imports_its_own_layer_or_above() -> None:
    upward = [
        f"{source} (layer {LAYERS[source]}) imports {target} (layer {LAYERS[target]}) in {files}"
        for (source, target), files in edges().items()
        if LAYERS[target] >= LAYERS[source]
    ]
    assert not upward, "\n".join(upward)


def test_the_check_finds_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "moc_lightning" / "engine" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from moc_lightning.lightning.callback import MoCCheckpoint\nfrom . import layout\n")
    global PACKAGE
    kept, PACKAGE = PACKAGE, tmp_path / "moc_lightning"
    try:
        assert imports(bad) == {"moc_lightning.lightning.callback", "moc_lightning.engine"}
        assert edges() == {("engine", "lightning"): ["moc_lightning/engine/bad.py"]}
    finally:
        PACKAGE = kept


def test_the_top_level_keeps_the_public_api() -> None:
    import moc_lightning

    assert set(moc_lightning.__all__) >= {"MoCCheckpoint", "CheckpointConfig", "StorageConfig", "ReplayConfig",
                                          "DynamicKConfig"}  # fmt: skip
    assert (PACKAGE / "py.typed").exists(), "the package says it is typed (PEP 561)"
