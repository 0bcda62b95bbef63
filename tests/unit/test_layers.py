"""The import graph of k3 has no upward arrow: every module of core/ (and the kernel libraries
under platforms/) imports only its own package and the layers below its own.

The layers, lowest first (docs/architecture.md, "Layers", says what each is for). A package may
import anything in its own layer or a lower one, never a higher one; lazy imports inside
functions count the same as module-level ones.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS = (
    ("base", {"k3.dtypes", "k3.dtype_names", "k3.presets", "k3._config_fields", "k3._config_hf", "k3.config",
              "k3.log", "k3.__version__", "k3._version"}),   # the version string (core/_version.py: a constant, no import)
    ("text", {"k3.tokenizer", "k3.chat"}),
    ("grammar", {"k3.structured"}),
    ("number formats", {"k3.quant"}),
    ("contract", {"k3.plugin"}),
    ("op helpers", {"k3.ops_helpers"}),
    ("reference", {"k3.reference"}),
    ("kernel libraries", {"k3.platforms.torch_kernels", "k3.platforms.triton_kernels", "k3.platforms.xla_kernels"}),
    ("model", {"k3.model"}),
    ("platform", {"k3.platform"}),
    ("cache and checkpoints", {"k3.cache", "k3.checkpoint", "k3.vision", "k3.lora"}),
    ("engine", {"k3.engine"}),
    ("server", {"k3.serve"}),
    ("entry points", {"k3.cli", "k3.conformance", "k3"}),
)
RANK = {package: rank for rank, (_, packages) in enumerate(LAYERS) for package in packages}
SCANNED = (("core", "k3"), ("platforms/torch_kernels", "k3.platforms.torch_kernels"),
           ("platforms/triton_kernels", "k3.platforms.triton_kernels"), ("platforms/xla_kernels", "k3.platforms.xla_kernels"))


def module_name(path: Path, folder: str, package: str) -> str:
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    if parts[-1] in ("__init__", "__main__"):
        parts = parts[:-1]
    return ".".join([package, *parts])


def package_of(module: str) -> str:
    """The layer entry a module belongs to: k3.<pkg>, k3.platforms.<lib>, or k3 itself."""
    parts = module.split(".")
    if parts[:2] == ["k3", "platforms"]:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def imported(path: Path, module: str):
    """(line, imported k3 module) for every import of the file, relative ones resolved."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "k3")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "k3":
                continue
            if target == "k3":            # `from k3 import reference`, `from k3 import hookimpl`
                for a in node.names:
                    sub = "plugin" if a.name == "hookimpl" else a.name
                    known = (ROOT / "core" / sub).is_dir() or (ROOT / "core" / f"{sub}.py").is_file()
                    yield node.lineno, f"k3.{sub}" if known or sub == "__version__" else "k3"
            else:
                yield node.lineno, target


def test_every_package_has_a_layer():
    unplaced = set()
    for folder, package in SCANNED:
        for path in (ROOT / folder).rglob("*.py"):
            unplaced.add(package_of(module_name(path, folder, package)))
    assert not unplaced - RANK.keys(), f"packages with no layer in LAYERS: {sorted(unplaced - RANK.keys())}"


def test_no_module_imports_a_higher_layer():
    upward = []
    for folder, package in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = module_name(path, folder, package)
            own = package_of(module)
            for line, target in imported(path, module):
                other = package_of(target)
                if other in RANK and RANK[other] > RANK[own]:
                    upward.append(f"{path.relative_to(ROOT)}:{line}: {own} ({LAYERS[RANK[own]][0]}) imports "
                                  f"{target} ({LAYERS[RANK[other]][0]})")
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_the_contract_imports_only_lower_layers():
    """The contract is what third parties build on: it stays free of the model, the engine, the
    cache, checkpoints and anything above them (the test above, spelled out for k3.plugin)."""
    allowed = {p for p, r in RANK.items() if r <= RANK["k3.plugin"]}
    found = {package_of(t) for path in (ROOT / "core/plugin").rglob("*.py")
             for _, t in imported(path, module_name(path, "core", "k3"))}
    assert found <= allowed, f"k3.plugin imports {sorted(found - allowed)}"


def test_vendor_hook_modules_import_only_the_contract_and_kernel_libraries():
    """A vendor plugin's hook modules build on the contract (k3.plugin), the kernel libraries, the
    number formats and their own package; only `serve.py`, a console script, reaches the CLI."""
    allowed = {"k3.plugin", "k3.quant", "k3.dtypes", "k3.platforms.torch_kernels", "k3.platforms.triton_kernels",
               "k3.platforms.xla_kernels", "k3.platforms._probe"}
    found = []
    for path in sorted((ROOT / "platforms").glob("*/*.py")):
        vendor = path.parent.name
        if vendor in ("torch_kernels", "triton_kernels", "xla_kernels") or path.name == "serve.py":
            continue
        module = module_name(path, "platforms", "k3.platforms")
        for line, target in imported(path, module):
            own = target.startswith(f"k3.platforms.{vendor}")
            # nvidia's detection tells a PPU apart with ppu's: another vendor's detect module is fine
            own = own or (target.startswith("k3.platforms.") and target.endswith(".detect"))
            if not own and not any(target == a or target.startswith(a + ".") for a in allowed):
                found.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    assert not found, "vendor hook modules importing more than the contract:\n" + "\n".join(found)
