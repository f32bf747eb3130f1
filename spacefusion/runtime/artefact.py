"""Kernel artefacts: the only contract between the TVM lowering and the GPU runtime.

A kernel artefact is a folder holding ``kernel.cu`` (CUDA source), ``kernel.json`` (launch metadata)
and optionally a prebuilt cubin. This module is pure stdlib so that artefacts can be written where TVM
runs and read where only torch/cupy are installed.
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the largest traversal stride (``elementStrides``) the driver takes along a tensor map's dim: the contract's
#: bound on ``tensor_map.im2col.stride`` (``runtime.tensormap`` encodes it)
MAX_TRAVERSAL_STRIDE = 8

FORMAT_TAG = "spacefusion-kernel/1"
#: a kernel one of whose dims is a run-time size (``SymbolicSpec``): its own tag, so that a runtime that knows
#: only /1 refuses it (launched as /1 it would get no size argument and the grid of one size)
SYMBOLIC_FORMAT_TAG = "spacefusion-kernel/2"
#: the role of a symbolic kernel's size argument: an int32 passed by value, not a tensor
SIZE_ROLE = "size"
SOURCE_FILE = "kernel.cu"
META_FILE = "kernel.json"

#: dtype names as TVM spells them; each is also a ``torch`` attribute name.
SUPPORTED_DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}
)
#: the role of a tensor the kernel writes in place (``spacefusion.lower.stores``: a KV cache written at run-time
#: positions): passed like an input, by the caller, never allocated nor returned
INOUT_ROLE = "inout"
#: scratch params are workspaces the launcher allocates (zeroed once) and keeps: never passed or returned;
#: tensormap params are 128-byte TMA descriptors the launcher encodes for the tensor it binds (``tensor_map``)
ROLES = frozenset({"input", "output", "scratch", "tensormap", SIZE_ROLE, INOUT_ROLE})
#: the swizzles a TMA descriptor can name, in bytes (CU_TENSOR_MAP_SWIZZLE_NONE/32B/64B/128B)
TMA_SWIZZLES = (0, 32, 64, 128)
MAX_THREADS_PER_BLOCK = 1024

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_REQUIRED_KEYS = ("kernel_name", "arch", "grid", "block", "params", "param_order")


class ArtefactError(ValueError):
    """A kernel artefact is missing or malformed; the message names the folder and the field."""


class SizeRangeError(ValueError):
    """Tensors given to a symbolic kernel disagree on its run-time size, or the size is outside its range."""


@dataclass(frozen=True)
class SymbolicSpec:
    """A symbolic kernel's run-time size (kernel.json's ``symbolic``): dim ``dim`` of its graph is the int32
    argument ``var``, offered for sizes ``lo..hi``; ``axes`` gives, per tensor holding it, the axis of that
    size; the grid has ``times * ceil(size / tile)`` blocks along x, at most ``cap`` (a persistent grid's
    blocks, which loop over the tiles ``cap`` apart; 0: no cap).  The params' ``shape`` and the ``grid``
    recorded are those at the size the kernel's schedule was picked at."""

    dim: str
    var: str
    lo: int
    hi: int
    axes: tuple[tuple[str, int], ...]
    tile: int
    times: int
    cap: int = 0

    def size_of(self, shapes: Mapping[str, Sequence[int]], kernel: str = "kernel") -> int:
        """The size the tensors of ``shapes`` (name -> shape) give the symbolic dim; ``SizeRangeError``
        where two disagree, none holds the dim, or the size is outside ``lo..hi``."""
        seen = {n: shapes[n][a] for n, a in self.axes if n in shapes and len(shapes[n]) > a}
        if not seen:
            raise SizeRangeError(f"{kernel}: none of the tensors given holds dim {self.dim!r} "
                                 f"(held by {[n for n, _ in self.axes]})")
        sizes = set(seen.values())
        if len(sizes) > 1:
            raise SizeRangeError(f"{kernel}: the tensors disagree on the size of dim {self.dim!r}: {seen}")
        size = sizes.pop()
        if not self.lo <= size <= self.hi:
            raise SizeRangeError(f"{kernel}: dim {self.dim!r} of size {size} is outside the kernel's range "
                                 f"[{self.lo}, {self.hi}]: another kernel serves it")
        return int(size)

    def shape_at(self, p: ParamSpec, size: int) -> tuple[int, ...]:
        """``p``'s shape at ``size`` (its recorded shape where it does not hold the dim)."""
        axis = dict(self.axes).get(p.name)
        return p.shape if axis is None else (*p.shape[:axis], size, *p.shape[axis + 1:])

    def grid_at(self, size: int) -> tuple[int, int, int]:
        tiles = self.times * -(-size // self.tile)
        return (min(self.cap, tiles) if self.cap else tiles, 1, 1)

    def to_json(self) -> dict[str, Any]:
        grid = {"tile": self.tile, "times": self.times} | ({"cap": self.cap} if self.cap else {})
        return {"dim": self.dim, "var": self.var, "range": [self.lo, self.hi], "axes": dict(self.axes),
                "grid": grid}


#: an ELF file's first bytes, and the e_machine of NVIDIA's CUDA cubins (EM_CUDA)
ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190
_ELF64_HEADER_BYTES = 64


def check_cubin(path: Path) -> None:
    """Raise ArtefactError naming ``path`` unless it looks like a cubin: a 64-bit little-endian ELF file
    for EM_CUDA whose section header table lies inside the file (not truncated).

    Why here and not at the module load: this is pure stdlib and reads bytes only, so a garbage or
    truncated cubin is refused on any machine before a CUDA call (cuModuleLoad would fail on the GPU
    with an opaque driver error, and a loader that falls back to compiling the source would hide that
    the shipped binary is broken).  It checks the header, not the code: a valid cubin for another
    architecture passes here and fails at the module load."""
    data = path.read_bytes()[:_ELF64_HEADER_BYTES]
    size = path.stat().st_size
    if not data.startswith(ELF_MAGIC):
        raise ArtefactError(f"{path}: not a cubin (no ELF header: starts with {data[:8]!r}, {size} bytes)")
    if len(data) < _ELF64_HEADER_BYTES or data[4] != 2 or data[5] != 1:
        raise ArtefactError(f"{path}: not a cubin (not a complete 64-bit little-endian ELF header, {size} bytes)")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine != EM_CUDA:
        raise ArtefactError(f"{path}: not a cubin (ELF for machine {machine}, a cubin is EM_CUDA = {EM_CUDA})")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if shoff + shentsize * shnum > size:
        raise ArtefactError(f"{path}: truncated cubin (its section headers end at byte {shoff + shentsize * shnum}, "
                            f"the file has {size})")


@dataclass(frozen=True)
class ParamSpec:
    """One tensor argument of the kernel: a contiguous row-major buffer of this shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    #: a tensormap param's (tensor, box innermost first, swizzle bytes); None for every other role
    tensor_map: tuple[str, tuple[int, ...], int] | None = None
    #: the mapped tensor's dims in the map's order (its first the contiguous one); None: innermost first.
    #: A bshd attention maps K [b, L, h, d] as (d, L, h, b), so its box rows run along L
    tensor_map_dims: tuple[int, ...] | None = None
    #: an im2col map's pixel-box corners ((w, h) lower, (w, h) upper); its box is then (channels per pixel,
    #: pixels per load, 1, 1).  None: a tiled map
    tensor_map_im2col: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    #: an im2col map's traversal stride along its spatial dims ((w, h): a strided conv's); None: 1 each
    tensor_map_im2col_stride: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "role": self.role}
        if self.tensor_map is not None:
            tensor, box, swizzle = self.tensor_map
            d["tensor_map"] = {"tensor": tensor, "box": list(box), "swizzle": swizzle}
            if self.tensor_map_dims is not None:
                d["tensor_map"]["dims"] = list(self.tensor_map_dims)
            if self.tensor_map_im2col is not None:
                lower, upper = self.tensor_map_im2col
                d["tensor_map"]["im2col"] = {"lower": list(lower), "upper": list(upper)}
                if self.tensor_map_im2col_stride is not None:
                    d["tensor_map"]["im2col"]["stride"] = list(self.tensor_map_im2col_stride)
        return d


@dataclass(frozen=True)
class KernelArtefact:
    """Validated contents of an artefact folder (metadata only; the source is read on demand)."""

    folder: Path
    kernel_name: str
    arch: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem_bytes: int
    params: tuple[ParamSpec, ...]
    param_order: tuple[str, ...]
    workload: Mapping[str, Any] = field(default_factory=dict, hash=False)
    cubin: str | None = None
    #: code-generation flags the kernel was built with (e.g. -ftz=true): every compile path uses them
    nvcc_flags: tuple[str, ...] = ()
    #: the kernel's first statement waits for the grid before it (``griddepcontrol.wait``): the runtime may
    #: launch it programmatically dependent (overlapping that grid's end), which is unsafe for a kernel without
    #: the wait (it could read the previous grid's outputs before they are written)
    grid_dependency_wait: bool = False
    #: the run-time size of a ``spacefusion-kernel/2`` artefact; None for a kernel of fixed sizes
    symbolic: SymbolicSpec | None = None

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, folder: str | Path) -> KernelArtefact:
        """Read and validate ``folder/kernel.json``; raise ArtefactError naming the first problem.

        A cubin that kernel.json names is checked to be one (``check_cubin``: ELF, EM_CUDA, not truncated)
        and refused by its path otherwise; a named cubin that is missing gives a RuntimeWarning and the
        runtime's documented fallback, compiling kernel.cu (``CudaKernel``: nvcc, then NVRTC)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ArtefactError(f"artefact folder {folder} does not exist or is not a directory")
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            raise ArtefactError(f"{folder}: missing {META_FILE}")
        if not (folder / SOURCE_FILE).is_file():
            raise ArtefactError(f"{folder}: missing {SOURCE_FILE}")
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ArtefactError(f"{meta_path}: not valid JSON ({exc})") from exc
        art = cls.from_meta(meta, folder)
        if not re.search(rf"\b{re.escape(art.kernel_name)}\s*\(", art.source):
            raise ArtefactError(f"{folder}: kernel_name {art.kernel_name!r} is not defined in {SOURCE_FILE}")
        if art.cubin is not None:
            cubin = folder / art.cubin
            if cubin.is_file():
                check_cubin(cubin)  # a garbage cubin is refused here, before any CUDA call
            else:  # the documented fallback: the runtime compiles kernel.cu (nvcc, else NVRTC); say so
                warnings.warn(f"{cubin}: the cubin {META_FILE} names is missing; the runtime will compile "
                              f"{SOURCE_FILE} instead (nvcc, else NVRTC)", RuntimeWarning, stacklevel=2)
        return art

    @classmethod
    def from_meta(cls, meta: Any, folder: str | Path) -> KernelArtefact:
        """Validate a parsed kernel.json dict (no file access), so save() can check before writing."""
        where = str(folder)
        if not isinstance(meta, dict):
            raise ArtefactError(f"{where}: {META_FILE} must hold a JSON object, got {type(meta).__name__}")
        tag = meta.get("format")
        if tag not in (FORMAT_TAG, SYMBOLIC_FORMAT_TAG):
            raise ArtefactError(f"{where}: format tag is {tag!r}, expected {FORMAT_TAG!r} (or {SYMBOLIC_FORMAT_TAG!r}"
                                f" for a kernel with a run-time size)")
        for key in _REQUIRED_KEYS:
            if key not in meta:
                raise ArtefactError(f"{where}: {META_FILE} lacks required key {key!r}")

        name = meta["kernel_name"]
        if not isinstance(name, str) or not _IDENT.match(name):
            raise ArtefactError(f"{where}: kernel_name {name!r} is not a C identifier")
        arch = meta["arch"]
        if not isinstance(arch, str) or not re.fullmatch(r"sm_\d+[a-z]?", arch):
            raise ArtefactError(f"{where}: arch {arch!r} is not of the form 'sm_90a'")
        grid = _dim3(meta["grid"], "grid", where)
        block = _dim3(meta["block"], "block", where)
        if math.prod(block) > MAX_THREADS_PER_BLOCK:
            raise ArtefactError(f"{where}: block {list(block)} has {math.prod(block)} threads (> 1024)")
        smem = meta.get("dynamic_smem_bytes", 0)
        if not _is_int(smem) or smem < 0:
            raise ArtefactError(f"{where}: dynamic_smem_bytes must be a non-negative int, got {smem!r}")

        params = _params(meta["params"], where)
        order = meta["param_order"]
        if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
            raise ArtefactError(f"{where}: param_order must be a list of names, got {order!r}")
        # an input read only through its tensor map is bound (the map is built from it) but not passed
        mapped = {p.tensor_map[0] for p in params if p.tensor_map is not None}
        names = [p.name for p in params if not (p.name in mapped and p.name not in order)]
        if len(set(order)) != len(order) or sorted(order) != sorted(names):
            raise ArtefactError(
                f"{where}: param_order {order} does not match params {names} "
                f"(missing {sorted(set(names) - set(order))}, unknown {sorted(set(order) - set(names))})"
            )

        workload = meta.get("workload", {})
        if not isinstance(workload, dict):
            raise ArtefactError(f"{where}: workload must be an object, got {workload!r}")
        cubin = meta.get("cubin")
        if cubin is not None and (not isinstance(cubin, str) or Path(cubin).name != cubin):
            raise ArtefactError(f"{where}: cubin must be a file name inside the artefact, got {cubin!r}")
        waits = meta.get("grid_dependency_wait", False)
        if not isinstance(waits, bool):
            raise ArtefactError(f"{where}: grid_dependency_wait must be true or false, got {waits!r}")
        flags = meta.get("nvcc_flags", [])
        if not isinstance(flags, list) or not all(isinstance(f, str) and f.startswith("-") for f in flags):
            raise ArtefactError(f"{where}: nvcc_flags must be a list of '-flag' strings, got {flags!r}")

        symbolic = _symbolic(meta, tag, params, where)
        return cls(
            folder=Path(folder),
            kernel_name=name,
            arch=arch,
            grid=grid,
            block=block,
            dynamic_smem_bytes=smem,
            params=params,
            param_order=tuple(order),
            workload=workload,
            cubin=cubin,
            nvcc_flags=tuple(flags),
            grid_dependency_wait=waits,
            symbolic=symbolic,
        )

    @classmethod
    def save(
        cls, folder: str | Path, source: str, meta: Mapping[str, Any], *, cubin: bytes | None = None
    ) -> KernelArtefact:
        """Validate ``meta`` then write kernel.cu, kernel.json (and the cubin); return the loaded artefact.

        The format tag is filled in when absent. Validation happens before anything is written, so a
        bad lowering never leaves a half-written artefact behind.
        """
        folder = Path(folder)
        meta = {"format": FORMAT_TAG, **dict(meta)}
        if cubin is not None:
            meta.setdefault("cubin", "kernel.cubin")
        cls.from_meta(meta, folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SOURCE_FILE).write_text(source)
        if cubin is not None:
            (folder / meta["cubin"]).write_bytes(cubin)
        (folder / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return cls.load(folder)

    # ---- accessors ----------------------------------------------------------------------------

    @property
    def source_path(self) -> Path:
        return self.folder / SOURCE_FILE

    @property
    def source(self) -> str:
        return self.source_path.read_text()

    @property
    def cubin_path(self) -> Path | None:
        """The prebuilt cubin if the metadata names one and it exists, else None (compile instead)."""
        if self.cubin is None:
            return None
        path = self.folder / self.cubin
        return path if path.is_file() else None

    @property
    def inputs(self) -> tuple[ParamSpec, ...]:
        """The tensors a caller passes: inputs, and those the kernel writes in place (``INOUT_ROLE``)."""
        return tuple(p for p in self.params if p.role in ("input", INOUT_ROLE))

    @property
    def outputs(self) -> tuple[ParamSpec, ...]:
        return tuple(p for p in self.params if p.role == "output")

    @property
    def scratch(self) -> tuple[ParamSpec, ...]:
        return tuple(p for p in self.params if p.role == "scratch")

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.folder}: kernel {self.kernel_name} has no param {name!r}")

    @property
    def ordered_params(self) -> tuple[ParamSpec, ...]:
        """Params in kernel-signature order, i.e. the order in which pointers are passed."""
        return tuple(self.param(n) for n in self.param_order)

    def to_meta(self) -> dict[str, Any]:
        """The kernel.json dict this artefact round-trips to."""
        meta: dict[str, Any] = {
            "format": FORMAT_TAG if self.symbolic is None else SYMBOLIC_FORMAT_TAG,
            "kernel_name": self.kernel_name,
            "arch": self.arch,
            "grid": list(self.grid),
            "block": list(self.block),
            "dynamic_smem_bytes": self.dynamic_smem_bytes,
            "params": [p.to_json() for p in self.params],
            "param_order": list(self.param_order),
            "workload": dict(self.workload),
        }
        if self.cubin is not None:
            meta["cubin"] = self.cubin
        if self.nvcc_flags:
            meta["nvcc_flags"] = list(self.nvcc_flags)
        if self.grid_dependency_wait:
            meta["grid_dependency_wait"] = True
        if self.symbolic is not None:
            meta["symbolic"] = self.symbolic.to_json()
        return meta


def _symbolic(meta: Mapping[str, Any], tag: str, params: tuple[ParamSpec, ...], where: str) -> SymbolicSpec | None:
    """kernel.json's ``symbolic`` section, checked against the params: required by (and only in) the /2 format;
    its ``var`` the one param of role ``size`` (int32), its axes those of inputs and outputs."""
    spec = meta.get("symbolic")
    sized = [p for p in params if p.role == SIZE_ROLE]
    if tag == FORMAT_TAG:
        if spec is not None or sized:
            raise ArtefactError(f"{where}: a {FORMAT_TAG!r} kernel has no run-time size: 'symbolic' and params of "
                                f"role {SIZE_ROLE!r} need format {SYMBOLIC_FORMAT_TAG!r}")
        return None
    if not isinstance(spec, dict):
        raise ArtefactError(f"{where}: a {SYMBOLIC_FORMAT_TAG!r} kernel needs a 'symbolic' object, got {spec!r}")
    var, rng, axes, grid = spec.get("var"), spec.get("range"), spec.get("axes"), spec.get("grid")
    if not isinstance(spec.get("dim"), str) or [p.name for p in sized] != [var]:
        raise ArtefactError(f"{where}: symbolic {{dim, var}} must name a dim and the one param of role "
                            f"{SIZE_ROLE!r} (params of that role: {[p.name for p in sized]}), got {spec!r}")
    if sized[0].dtype != "int32" or sized[0].shape != (1,):
        raise ArtefactError(f"{where}: size param {var!r} must be int32 of shape [1] (passed by value)")
    if not (isinstance(rng, list) and len(rng) == 2 and all(_is_int(v) for v in rng) and 1 <= rng[0] <= rng[1]):
        raise ArtefactError(f"{where}: symbolic range {rng!r} must be [lo, hi] with 1 <= lo <= hi")
    shapes = {p.name: p.shape for p in params if p.role in ("input", "output")}
    if not isinstance(axes, dict) or not axes or not all(
            n in shapes and _is_int(a) and 0 <= a < len(shapes[n]) for n, a in axes.items()):
        raise ArtefactError(f"{where}: symbolic axes {axes!r} must map inputs/outputs to one of their axes")
    if not (isinstance(grid, dict) and all(_is_int(grid.get(k)) and grid[k] > 0 for k in ("tile", "times"))
            and set(grid) <= {"tile", "times", "cap"} and (_is_int(grid.get("cap", 1)) and grid.get("cap", 1) > 0)):
        raise ArtefactError(f"{where}: symbolic grid {grid!r} must be {{tile, times}} and an optional cap (a "
                            "persistent grid's blocks), positive ints")
    return SymbolicSpec(spec["dim"], var, rng[0], rng[1], tuple(sorted(axes.items())), grid["tile"], grid["times"],
                        grid.get("cap", 0))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _dim3(value: Any, what: str, where: str) -> tuple[int, int, int]:
    """Accept 1-3 positive ints (CUDA pads missing dims with 1)."""
    if not isinstance(value, list) or not 1 <= len(value) <= 3 or not all(_is_int(v) and v > 0 for v in value):
        raise ArtefactError(f"{where}: {what} must be a list of 1-3 positive ints, got {value!r}")
    padded = [*value, 1, 1][:3]
    return (padded[0], padded[1], padded[2])


def _params(value: Any, where: str) -> tuple[ParamSpec, ...]:
    if not isinstance(value, list) or not value:
        raise ArtefactError(f"{where}: params must be a non-empty list, got {value!r}")
    out: list[ParamSpec] = []
    for i, p in enumerate(value):
        if not isinstance(p, dict):
            raise ArtefactError(f"{where}: params[{i}] must be an object, got {p!r}")
        name = p.get("name")
        if not isinstance(name, str) or not _IDENT.match(name):
            raise ArtefactError(f"{where}: params[{i}] name {name!r} is not an identifier")
        shape = p.get("shape")
        if not isinstance(shape, list) or not shape or not all(_is_int(s) and s > 0 for s in shape):
            raise ArtefactError(f"{where}: param {name!r} has bad shape {shape!r} (need a list of positive ints)")
        dtype = p.get("dtype")
        if dtype not in SUPPORTED_DTYPES:
            raise ArtefactError(f"{where}: param {name!r} has unsupported dtype {dtype!r}")
        role = p.get("role")
        if role not in ROLES:
            raise ArtefactError(f"{where}: param {name!r} has role {role!r}, expected one of {sorted(ROLES)}")
        tmap = _tensor_map(p, name, role, where)
        out.append(ParamSpec(name=name, shape=tuple(shape), dtype=dtype, role=role, tensor_map=tmap,
                             tensor_map_dims=_tensor_map_dims(p, name, len(tmap[1]), where) if tmap else None,
                             tensor_map_im2col=_tensor_map_im2col(p, name, len(tmap[1]), where) if tmap else None,
                             tensor_map_im2col_stride=_im2col_stride(p, name, len(tmap[1]), where) if tmap else None))
    names = [p.name for p in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ArtefactError(f"{where}: duplicate param names {dupes}")
    tensors = {p.name: p for p in out if p.role in ("input", "output")}
    for p in out:
        if p.tensor_map is not None:
            t = tensors.get(p.tensor_map[0])
            if t is None or len(t.shape) != len(p.tensor_map[1]):
                raise ArtefactError(f"{where}: tensormap {p.name!r} describes {p.tensor_map[0]!r}, which is not a "
                                    f"{len(p.tensor_map[1])}-d input or output of the kernel")
    if not any(p.role in ("output", INOUT_ROLE) for p in out):
        raise ArtefactError(f"{where}: no param has role 'output' or {INOUT_ROLE!r} (the kernel writes nothing)")
    return tuple(out)


def _tensor_map_im2col(p: Mapping[str, Any], name: str, rank: int,
                       where: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """An im2col tensormap's pixel-box corners (``tensor_map.im2col``: lower and upper, one int per spatial
    dim, each in -128..127 for a 4-d map), or None for a tiled map."""
    spec = p["tensor_map"].get("im2col")
    if spec is None:
        return None
    ok = isinstance(spec, dict) and rank >= 3
    corners = [spec.get(k) if ok else None for k in ("lower", "upper")]
    if not ok or not all(isinstance(c, list) and len(c) == rank - 2 and all(_is_int(v) and -128 <= v <= 127 for v in c)
                         for c in corners):
        raise ArtefactError(f"{where}: tensormap {name!r} im2col {spec!r} must be {{lower, upper}}: {rank - 2} ints "
                            f"each in -128..127 (a {rank}-d image's spatial dims)")
    return tuple(corners[0]), tuple(corners[1])


def _im2col_stride(p: Mapping[str, Any], name: str, rank: int, where: str) -> tuple[int, ...] | None:
    """An im2col tensormap's traversal stride (``tensor_map.im2col.stride``: one int in 1..``MAX_TRAVERSAL_STRIDE``
    per spatial dim), or None where it has none (1 each, a stride-1 window, or a tiled map)."""
    spec = p["tensor_map"].get("im2col")
    stride = spec.get("stride") if isinstance(spec, dict) else None
    if stride is None:
        return None
    top = MAX_TRAVERSAL_STRIDE
    if not (isinstance(stride, list) and len(stride) == rank - 2 and all(_is_int(v) and 1 <= v <= top for v in stride)):
        raise ArtefactError(f"{where}: tensormap {name!r} im2col stride {stride!r} must be {rank - 2} ints each in "
                            f"1..{top} (the map's traversal stride along a {rank}-d image's spatial dims)")
    return tuple(stride)


def _tensor_map_dims(p: Mapping[str, Any], name: str, rank: int, where: str) -> tuple[int, ...] | None:
    """A tensormap param's dim order (``tensor_map.dims``: a permutation of the tensor's dims, the
    map's first dim first), or None where the map takes them innermost first."""
    dims = p["tensor_map"].get("dims")
    if dims is None:
        return None
    if not isinstance(dims, list) or not all(_is_int(d) for d in dims) or sorted(dims) != list(range(rank)):
        raise ArtefactError(f"{where}: tensormap {name!r} dims {dims!r} must be a permutation of 0..{rank - 1}")
    return tuple(dims)


def _tensor_map(p: Mapping[str, Any], name: str, role: str, where: str) -> tuple[str, tuple[int, ...], int] | None:
    """A tensormap param's description: the tensor it maps, the box (1-256 elements per dim,
    innermost first) and the swizzle; a 128-byte uint8 buffer in the kernel signature."""
    spec = p.get("tensor_map")
    if role != "tensormap":
        if spec is not None:
            raise ArtefactError(f"{where}: param {name!r} ({role}) has a tensor_map; only tensormap params do")
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("tensor"), str):
        raise ArtefactError(f"{where}: tensormap {name!r} needs tensor_map {{tensor, box, swizzle}}, got {spec!r}")
    box, swizzle = spec.get("box"), spec.get("swizzle")
    if not isinstance(box, list) or not 1 <= len(box) <= 5 or not all(_is_int(b) and 1 <= b <= 256 for b in box):
        raise ArtefactError(f"{where}: tensormap {name!r} box {box!r} must be 1-5 ints in 1..256")
    if swizzle not in TMA_SWIZZLES:
        raise ArtefactError(f"{where}: tensormap {name!r} swizzle {swizzle!r} must be one of {TMA_SWIZZLES}")
    if list(p.get("shape", [])) != [128] or p.get("dtype") != "uint8":
        raise ArtefactError(f"{where}: tensormap {name!r} must be a uint8[128] param (a CUtensorMap)")
    return spec["tensor"], tuple(box), int(swizzle)
