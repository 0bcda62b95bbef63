"""The AMD Instinct architectures the amd plugin targets, and the launch configuration each gives
the portable Triton kernels (k3.platforms.triton_kernels) through the launch options those
kernels already take (num_warps, block sizes, dot precision, MoE mode): one table, no fork of a
kernel. Nothing here has run on AMD hardware; every served kernel is compile-checked for both
targets offline (bench/amdgcn_report.py, tests/kernels/test_amd_compile.py) and its numerics
under these configurations checked under the Triton interpreter
(tests/kernels/test_amd_launch_numerics.py: configurations' numerics only, not AMD code
generation).

Facts used (AMD's CDNA3 / CDNA4 ISA guides): a wavefront is 64 lanes on both, so a Triton
"warp" is 64 threads and num_warps=4 is 256 threads (twice an NVIDIA launch of the same
num_warps); LDS is 64 KiB per CU on gfx942 and 160 KiB on gfx950; the matrix cores take fp8 as
E4M3FNUZ on gfx942 and as OCP E4M3FN on gfx950; gfx950 takes MXFP4 (E2M1 with E8M0 block
scales) operands natively (`tl.dot_scaled`), gfx942 has Triton upcast them; XF32 (Triton's
"tf32") exists on gfx942 only, so fp32 dots that NVIDIA runs in TF32 run in IEEE fp32 on gfx950.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arch:
    """One AMD target: its facts and the launch options k3 gives each served kernel on it.

    name: the gfx target ("gfx942"); product: the Instinct part it is measured against;
    wavefront: lanes per wavefront (Triton's threads per warp); lds_bytes: LDS per CU;
    compute_units: CUs of the product (grid sizing); fp8: torch dtype name of the matrix
    cores' fp8 flavour; fp8_triton: Triton's name of the same ("fp8e4b8" / "fp8e4nv");
    native_mxfp4: MXFP4 operands in the matrix cores; tf32: whether XF32 dots exist (else fp32
    dots run in IEEE fp32); launch: kernel name -> keyword launch options passed to the kernel's
    Python entry (the names of k3.platforms.amd.kernels.SERVED).
    """

    name: str
    product: str
    wavefront: int
    lds_bytes: int
    compute_units: int
    fp8: str
    fp8_triton: str
    native_mxfp4: bool
    tf32: bool
    launch: dict[str, dict] = field(default_factory=dict)


# Launch options, none tuned on a device. Where the NVIDIA default compiles to spills or an
# occupancy of one wave per SIMD for AMD (bench/amdgcn_report.py, docs/amd.md), the row gives a
# smaller tile: the KDA decode step walks its state row 16 columns at a time (the whole row, the
# default, takes 512 VGPRs + 256 AGPRs and spills 157; 16 columns: 148 VGPRs, no spill, 3 waves)
# and the chunked recurrence 16 columns a program (32: 58-62 registers spilled); the MLA decode
# steps 16 positions at a time (32 spills 19-41 registers at 8 waves; 16: 204-214 VGPRs, none). The other
# kernels keep the defaults the NVIDIA path uses (their compiled reports show no spill).
_COMMON = {
    "kda_decode_step": {"block_v": 16},
    "kda_recurrent": {"block_v": 32},
    "indexer_decode_scores": {"block_l": 64},
}

ARCHS = {
    "gfx942": Arch("gfx942", "MI300X", wavefront=64, lds_bytes=64 << 10, compute_units=304, fp8="float8_e4m3fnuz",
                   fp8_triton="fp8e4b8", native_mxfp4=False, tf32=True,
                   launch={**_COMMON,
                           # fp32 dots: XF32 (Triton "tf32") as NVIDIA's TF32; 3xTF32 has no AMD form
                           "indexer_prefill_scores": {"block_s": 64, "precisions": ("tf32", "ieee")},
                           "mla_decode": {"operands": "native", "block_n": 16},
                           # no native MXFP4: Triton's dot_scaled would upcast to bf16 on CDNA3, so
                           # the in-kernel E2M1 decoding serves decode batches (dequant from 1,024)
                           "moe_experts": {"prefer": "decode", "tf32": True},
                           "kda_chunked": {"precision": "ieee", "block_v": 16}}),
    "gfx950": Arch("gfx950", "MI355X", wavefront=64, lds_bytes=160 << 10, compute_units=256, fp8="float8_e4m3fn",
                   fp8_triton="fp8e4nv", native_mxfp4=True, tf32=False,
                   launch={**_COMMON,
                           "indexer_prefill_scores": {"block_s": 64, "precisions": ("ieee", "ieee")},
                           "indexer_decode_scores": {"block_l": 64, "ieee": True},
                           "mla_decode": {"operands": "native", "ieee": True, "block_n": 16},
                           # native MXFP4 matrix-core operands for bf16 batches (tl.dot_scaled)
                           "moe_experts": {"prefer": "dot_scaled", "tf32": False},
                           "kda_chunked": {"precision": "ieee", "block_v": 16}}),
}
DEFAULT_ARCH = "gfx950"


def arch(name: str) -> Arch:
    """The table row of gfx target `name` (feature flags such as ":sramecc+" dropped); a
    ValueError naming the known targets for any other."""
    base = name.split(":")[0]
    if base not in ARCHS:
        raise ValueError(f"amd: no launch configuration for {name!r}; known targets: {', '.join(sorted(ARCHS))}")
    return ARCHS[base]
