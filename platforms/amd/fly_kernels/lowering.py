"""Lower a FlyDSL kernel for gfx942 / gfx950 on any machine, no ROCm or GPU needed, and keep what
each stage gave: the traced Fly IR, the ROCDL dialect after `convert-gpu-to-rocdl`, the LLVM
dialect before code generation, the AMDGCN assembly (with its register / LDS / spill metadata)
and, where Triton is installed, a linked hsaco.

FlyDSL (0.5) traces a `@flyc.jit` launcher into MLIR and lowers it through its own pipeline
(`RocmBackend.pipeline_fragments`) ending in `gpu-module-to-binary{format=fatbin}`, which
needs ROCm's ld.lld (and its device bitcode when a kernel calls ocml). This driver runs the same
pipeline up to that last pass, then the same pass with `format=isa` (LLVM's AMDGPU code
generator inside FlyDSL's MLIR: assembly, no linker), the device bitcode taken from Triton's
wheel (ocml / ockl, `triton/backends/amd/lib`) when present. The assembly is assembled and
linked by the LLVM MC and lld linked into libtriton (`amd.assemble_amdgcn`, `amd.link_hsaco`), as
bench/amdgcn_report.py does for the Triton kernels. Nothing here runs a kernel.

FlyDSL's own entry points are used to trace (`JitFunction._compile_only`, whose compile step is
intercepted: tracing is all that is taken from it); the pins in pyproject (`flydsl==0.5.0`) keep
those private names stable.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# the stages kept (the pass after which each is taken; the first is the traced module)
STAGES = ("fly", "rocdl", "llvm", "amdgcn", "hsaco")
_AFTER = {"rocdl": "convert-gpu-to-rocdl", "llvm": "reconcile-unrealized-casts"}
METADATA = {"vgprs": "vgpr_count", "sgprs": "sgpr_count", "agprs": "agpr_count", "vgpr_spills": "vgpr_spill_count",
            "sgpr_spills": "sgpr_spill_count", "scratch_bytes": "private_segment_fixed_size",
            "lds_bytes": "group_segment_fixed_size"}


@dataclass
class Lowered:
    """What lowering one launcher for one target gave: `ir[stage]` text for every stage that ran
    (STAGES), `stage` the last one, `error` the failing stage's exception (None when all ran),
    `resources` the AMDGCN metadata (METADATA's keys, per kernel name), `hsaco_bytes`."""

    arch: str
    ir: dict[str, str] = field(default_factory=dict)
    stage: str | None = None
    error: str | None = None
    resources: dict[str, dict[str, int | None]] = field(default_factory=dict)
    hsaco_bytes: int = 0


class _Traced(Exception):
    """Raised from the intercepted compile step to carry the traced module out of FlyDSL."""

    def __init__(self, asm: str, fragments: list[str]):
        super().__init__("traced")
        self.asm, self.fragments = asm, fragments


@contextlib.contextmanager
def _target(arch: str):
    """FlyDSL reads its target from the `ARCH` environment variable (flydsl.utils.env); set it,
    and turn its disk cache off, for the duration of one trace."""
    saved = {k: os.environ.get(k) for k in ("ARCH", "FLYDSL_RUNTIME_ENABLE_CACHE")}
    os.environ.update(ARCH=arch, FLYDSL_RUNTIME_ENABLE_CACHE="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def trace(launcher, args: tuple, arch: str) -> tuple[str, list[str]]:
    """(traced MLIR text, FlyDSL's pass pipeline for `arch`) of `launcher(*args)`: FlyDSL's front
    end runs (AST rewrite, tracing, verification), its compile step is intercepted."""
    from flydsl.compiler import jit_function

    def intercept(cls, asm, *, func_name, config):
        raise _Traced(asm, list(config.fragments))

    original = jit_function.MlirCompiler.__dict__["compile"]
    jit_function.MlirCompiler.compile = classmethod(intercept)
    try:
        with _target(arch):
            launcher._compile_only(*args)
    except _Traced as traced:
        return traced.asm, traced.fragments
    finally:
        jit_function.MlirCompiler.compile = original
    raise RuntimeError("FlyDSL compiled without reaching its compile step (a cached artifact?)")


def _bitcode_root() -> str:
    """A ROCm-like root whose amdgcn/bitcode holds Triton's ocml / ockl (empty without Triton)."""
    root = Path(tempfile.mkdtemp(prefix="k3-flydsl-rocm-"))
    (root / "amdgcn" / "bitcode").mkdir(parents=True)
    try:
        import triton

        for bc in (Path(triton.__file__).parent / "backends" / "amd" / "lib").glob("*.bc"):
            (root / "amdgcn" / "bitcode" / bc.name).symlink_to(bc)
    except ImportError:
        pass
    return str(root)


def _number(text: str, key: str) -> int | None:
    m = re.search(rf"\.{key}:\s+(\d+)", text)
    return int(m.group(1)) if m else None


def resources(isa: str) -> dict[str, dict[str, int | None]]:
    """kernel name -> AMDGCN metadata numbers (METADATA) and occupancy, from the assembly's
    metadata block (one `.name:` entry per kernel)."""
    out = {}
    for chunk in re.split(r"\n\s+- \.agpr_count:", isa)[1:]:
        chunk = ".agpr_count:" + chunk
        name = re.search(r"\.name:\s+(\S+)", chunk)
        if name:
            out[name.group(1)] = {k: _number(chunk, key) for k, key in METADATA.items()}
    occupancy = re.findall(r";\s*Occupancy:\s*(\d+)", isa)
    for row, waves in zip(out.values(), occupancy):
        row["occupancy_waves"] = int(waves)
    return out


def _link(isa: str, arch: str) -> bytes:
    """hsaco of the assembly, through libtriton's LLVM MC and lld (the target id's empty
    environment spelled as Triton's assembler expects)."""
    from triton._C.libtriton import amd, llvm

    llvm.init_targets()
    obj = amd.assemble_amdgcn(isa.replace("amdgcn-amd-amdhsa-unknown-", "amdgcn-amd-amdhsa--"), arch, "")
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "kernel.o"), Path(tmp, "kernel.hsaco")
        src.write_bytes(obj)
        amd.link_hsaco(str(src), str(dst))
        return dst.read_bytes()


def lower(launcher, args: tuple, arch: str) -> Lowered:
    """Trace `launcher(*args)` (tensors as compile placeholders: CPU tensors of the right dtype)
    for `arch` and lower it as far as this machine allows (Lowered)."""
    from flydsl._mlir import ir
    from flydsl._mlir.passmanager import PassManager
    from flydsl.compiler import jit_function

    out = Lowered(arch)
    try:
        asm, fragments = trace(launcher, args, arch)
        out.ir["fly"], out.stage = asm, "fly"
        *passes, binary = fragments
        if not binary.startswith("gpu-module-to-binary"):
            raise RuntimeError(f"FlyDSL's pipeline no longer ends in gpu-module-to-binary: {binary!r}")
        with jit_function._create_mlir_context():
            module = ir.Module.parse(asm)
            for fragment in passes:
                PassManager.parse(f"builtin.module({fragment})").run(module.operation)
                for stage, marker in _AFTER.items():
                    if marker in fragment:
                        out.ir[stage], out.stage = str(module), stage
            PassManager.parse(f'builtin.module(gpu-module-to-binary{{format=isa opts="" section= '
                              f'toolkit={_bitcode_root()}}})').run(module.operation)
            isa = jit_function._extract_isa_text(module.operation.get_asm(enable_debug_info=False))
        out.ir["amdgcn"], out.stage, out.resources = isa, "amdgcn", resources(isa)
        hsaco = _link(isa, arch)
        out.hsaco_bytes, out.stage = len(hsaco), "hsaco"
    except Exception as e:                   # record the stage reached and why the next failed
        out.error = f"{type(e).__name__}: {str(e).strip()[-800:]}"
    return out
