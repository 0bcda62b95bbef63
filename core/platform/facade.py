"""The typed facade over the plugin manager: the only code that calls hooks.

`select_platform()` discovers plugins, picks the platform and returns a `Platform`, whose
kernel tables are resolved once (entry by entry: the first plugin in hook order that
provides an entry wins, the reference last) into the plain callables the model calls.

Every call goes through pluggy: `pm.hook.<name>(**kwargs)`, or, where answers are merged per
plugin (kernel tables), each implementation called with only the arguments it declares
(`k3.platform.calls`). After selection only the selected platform's plugin, kernel-only
plugins and the reference fallback are registered, and the platform hook `k3_capabilities` is
asked of the selected platform's own plugin only: no hook needs to check the platform's name.

In the batch-invariant mode (`select_platform(batch_invariant=True)`) every kernel hook is
asked with `batch_invariant=True` and an entry is taken only from a plugin that marks it
(`k3.plugin.batch_invariant`); a platform that leaves an entry unmarked everywhere is refused
with `BatchInvariantUnsupported`, which names the entries.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from k3.model import K3ForCausalLM, ParallelContext
from k3.plugin.markers import is_batch_invariant
from k3.plugin.tables import KERNEL_TABLES, KernelSet
from k3.plugin.types import KDA_STATE_LAYOUTS, Capabilities, PlatformInfo, ShapeBuckets

from .calls import answers
from .collectives import DispatchingCollectives
from .discovery import Discovery, PluginRecord, allow_list, discover
from .selection import select


class BatchInvariantUnsupported(ValueError):
    """The batch-invariant mode was asked of a platform that has no batch-invariant kernel for
    some entries (`entries`: "family.entry" names)."""

    def __init__(self, platform: str, entries: list[str]):
        self.entries = entries
        super().__init__(f"--batch-invariant: platform {platform!r} has no batch-invariant kernel for "
                         f"{', '.join(entries)} (docs/batch-invariance.md)")


class Platform:
    """The selected platform: info, capabilities, resolved kernels, collectives, plugin report.

    batch_invariant: resolve only kernels marked batch invariant (the batch-invariant mode);
        raises BatchInvariantUnsupported naming the entries no plugin marks."""

    def __init__(self, found: Discovery, info: PlatformInfo, *, batch_invariant: bool = False):
        self._pm = found.pm
        self.info = info
        self.batch_invariant = batch_invariant
        self.records: dict[str, PluginRecord] = found.records
        self.capabilities: Capabilities = self._platform_hook("k3_capabilities")(platform=info) or Capabilities()
        self.kernels = self._resolve_kernels()

    @property
    def name(self) -> str:
        return self.info.name

    def _platform_hook(self, hook_name: str):
        """The hook caller of a platform hook: only the selected platform's own plugin answers."""
        others = [plugin for name, plugin in self._pm.list_name_plugin() if name != self.info.plugin]
        return self._pm.subset_hook_caller(hook_name, remove_plugins=others)

    def _resolve_kernels(self) -> KernelSet:
        tables, providers, missing = {}, {}, []
        for table_cls in KERNEL_TABLES:
            family, merged = table_cls.FAMILY, {}
            hook = getattr(self._pm.hook, f"k3_{family}_kernels")
            for plugin, table in answers(hook, platform=self.info, batch_invariant=self.batch_invariant):
                if not isinstance(table, table_cls):
                    raise TypeError(f"plugin {plugin!r}: k3_{family}_kernels returned "
                                    f"{type(table).__name__}, expected {table_cls.__name__}")
                for entry in table.provided():
                    kernel = getattr(table, entry)
                    if entry not in merged and (not self.batch_invariant or is_batch_invariant(kernel)):
                        merged[entry] = kernel
                        providers[f"{family}.{entry}"] = plugin
            missing += [f"{family}.{entry}" for entry in table_cls.entries() if entry not in merged]
            tables[family] = table_cls(**merged)
        if self.batch_invariant and missing:
            raise BatchInvariantUnsupported(self.name, missing)
        return KernelSet(**tables, providers=providers, batch_invariant=self.batch_invariant)

    def collectives(self, group=None) -> DispatchingCollectives:
        """Every plugin's backends for `group`, in hook call order (torch.distributed last)."""
        backends = [b for found in self._pm.hook.k3_collective_backends(platform=self.info, group=group) for b in found]
        return DispatchingCollectives(backends)

    def parallel_context(self, group=None):
        """ParallelContext of an initialised torch.distributed group, with this platform's
        collectives (world size 1 without torch.distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return ParallelContext()
        return ParallelContext(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                               collectives=self.collectives(group))

    def build_model(self, cfg, *, dtype: torch.dtype, parallel=None):
        """An uninitialised model for this rank on the platform's device, wired to its kernels."""
        return K3ForCausalLM(cfg, kernels=self.kernels, parallel=parallel or self.parallel_context(),
                             dtype=dtype, device=self.info.device)

    @property
    def cache_alignment(self) -> int:
        """Byte alignment of cache regions and rows: the planner's 256, or more where the
        device asks (`Capabilities.cache_alignment_bytes`)."""
        return math.lcm(256, max(1, self.capabilities.cache_alignment_bytes))

    @property
    def kda_state_layout(self) -> str:
        """Element order inside a KDA state row ("hkv" canonical, or "hvk")."""
        layout = self._pm.hook.k3_kda_state_layout(platform=self.info)
        if layout not in KDA_STATE_LAYOUTS:
            raise ValueError(f"k3_kda_state_layout returned {layout!r}; expected one of {', '.join(KDA_STATE_LAYOUTS)}")
        return layout

    @property
    def graph_runner(self):
        """The platform's decode graph capturer (`k3_graph_runner`), or None: run eagerly."""
        return self._pm.hook.k3_graph_runner(platform=self.info)

    @property
    def step_end(self):
        """What to call after each model forward (`k3_step_end`: a lazy backend cuts its trace
        there), or None."""
        return self._pm.hook.k3_step_end(platform=self.info)

    def shape_buckets(self, max_num_seqs: int, max_num_batched_tokens: int) -> ShapeBuckets | None:
        """The platform's static-shape buckets (`k3_shape_buckets`), or None: no padding."""
        buckets = self._pm.hook.k3_shape_buckets(platform=self.info, max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=max_num_batched_tokens)
        if buckets is not None and not isinstance(buckets, ShapeBuckets):
            raise TypeError(f"k3_shape_buckets returned {type(buckets).__name__}, expected ShapeBuckets or None")
        return buckets

    def allocate_cache(self, num_rows: int, row_bytes: int) -> torch.Tensor:
        """The backing tensor of a packed cache (`k3_allocate_cache`), checked against the plan:
        uint8 [num_rows, row_bytes] on this platform's device, rows row_bytes apart, aligned."""
        alignment = self.cache_alignment
        if row_bytes % alignment:
            raise ValueError(f"the planned row ({row_bytes} bytes) is not a multiple of the cache alignment "
                             f"({alignment} bytes): plan rows with row_layout(..., alignment={alignment})")
        backing = self._pm.hook.k3_allocate_cache(platform=self.info, num_rows=num_rows, row_bytes=row_bytes,
                                                  alignment=alignment)
        problems = []
        if backing is None:
            problems.append("no plugin allocated it")
        else:
            if backing.dtype != torch.uint8 or tuple(backing.shape) != (num_rows, row_bytes):
                problems.append(f"got {backing.dtype} {tuple(backing.shape)}, expected uint8 {(num_rows, row_bytes)}")
            elif num_rows and backing.stride() != (row_bytes, 1):
                problems.append(f"rows are not packed: strides {backing.stride()}, expected {(row_bytes, 1)}")
            if backing.device.type != torch.device(self.info.device).type:
                problems.append(f"on {backing.device}, expected {self.info.device}")
            if backing.data_ptr() % alignment:
                problems.append(f"its first byte is not {alignment}-byte aligned")
        if problems:
            raise RuntimeError(f"k3_allocate_cache on platform {self.name!r}: " + "; ".join(problems))
        return backing

    def process_weights(self, model) -> None:
        self._pm.hook.k3_process_weights(platform=self.info, model=model)

    def config_defaults(self) -> dict[str, Any]:
        """Every plugin's serving defaults merged in hook call order: the first value of a key wins."""
        merged: dict[str, Any] = {}
        for defaults in self._pm.hook.k3_config_defaults(platform=self.info):
            for key, value in defaults.items():
                merged.setdefault(key, value)
        return merged

    def validate_config(self, config, options) -> list[str]:
        """Every plugin's problems with serving `config` with `options`, concatenated."""
        found = self._pm.hook.k3_validate_config(platform=self.info, config=config, options=options)
        return [problem for problems in found for problem in problems]

    def add_cli_options(self, parser) -> None:
        self._pm.hook.k3_add_cli_options(parser=parser, platform_name=self.info.name)

    def conformance_expectations(self) -> list[Path]:
        return [Path(p) for p in self._pm.hook.k3_conformance_expectations(platform=self.info) if p]

    def hook_implementations(self) -> dict[str, list[str]]:
        """plugin name -> the hooks it implements (after blocking)."""
        out: dict[str, list[str]] = {}
        for caller_name in dir(self._pm.hook):
            if not caller_name.startswith("k3_"):
                continue
            for impl in getattr(self._pm.hook, caller_name).get_hookimpls():
                out.setdefault(impl.plugin_name, []).append(caller_name)
        return {name: sorted(hooks) for name, hooks in out.items()}


def select_platform(requested: str | None = None, *, batch_invariant: bool = False, env=os.environ) -> Platform:
    """Discover plugins, select the platform (`requested`, else K3_PLATFORM, else detection).
    batch_invariant: resolve the batch-invariant kernels only (see `Platform`)."""
    found = discover(allow_list(env))
    info = select(found, requested or env.get("K3_PLATFORM") or None)
    return Platform(found, info, batch_invariant=batch_invariant)
