"""The comparison harness's workloads (issue 5): the benchmark shapes, their FLOPs, bytes and roofline.

Pure standard library, so the table, its formulas and the artefact matching can be checked on a
machine without torch.  ``experiments/harness.py`` builds inputs, references and systems from it.

Counting rules (stated once, used everywhere):

* FLOPs count the matrix products only, 2 per multiply-add.  Attention is 4*b*h*m*l*d (QK^T and PV),
  halved when causal, as FlashAttention counts it.  Softmax / LayerNorm / bias / sigmoid element-wise
  work is not counted, except for LayerNorm, which has no product: 8 FLOPs per element there
  (residual add, mean, centre, square, variance, normalise, scale, shift).
* Bytes are the minimal device-memory traffic: every input read once plus every output written once,
  at the workload's dtype (fp16: 2 bytes an element).
* ``roofline`` says which roof a workload is judged against: "compute" (tensor-core peak for the dtype)
  for attention and GEMMs, "memory" (DRAM bandwidth) for Softmax-GEMM and LayerNorm.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
ROOFLINES = ("compute", "memory")
#: Workload kinds (how harness.py builds inputs, reference and systems for them).
KINDS = ("attention", "softmax_gemm", "residual_layernorm", "gemm_sigmoid", "gemm")
NO_ARTEFACT = "no artefact"


@dataclass(frozen=True)
class Workload:
    """One benchmark: a kind, its sizes by dimension name, dtype and flags (``causal`` for attention).

    ``reference_for`` names the workload this one is a reference row of (the plain GEMM under the
    sigmoid-GEMM epilogue): it has no spacefusion kernel of its own, and its systems' times also count
    as baselines of that workload's spacefusion row.
    """

    key: str
    label: str
    kind: str
    shape: Mapping[str, int]
    dtype: str = "float16"
    causal: bool = False
    reference_for: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.key}: unknown kind {self.kind!r}; known {KINDS}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.key}: unsupported dtype {self.dtype!r}")
        need = {"attention": "bhmld", "softmax_gemm": "mln", "residual_layernorm": "mn",
                "gemm_sigmoid": "mnk", "gemm": "mnk"}[self.kind]
        if sorted(self.shape) != sorted(need):
            raise ValueError(f"{self.key}: a {self.kind} shape has dims {list(need)}, got {dict(self.shape)}")
        if self.causal and self.kind != "attention":
            raise ValueError(f"{self.key}: only attention can be causal")

    # ---- tensors ------------------------------------------------------------------------------

    def _s(self, *dims: str) -> tuple[int, ...]:
        return tuple(int(self.shape[d]) for d in dims)

    @property
    def inputs(self) -> dict[str, tuple[int, ...]]:
        """Input tensors by the names spacefusion's kernels give them, with their shapes (row-major)."""
        s = self._s
        if self.kind == "attention":
            return {"Q": s("b", "h", "m", "d"), "K": s("b", "h", "l", "d"), "V": s("b", "h", "l", "d")}
        if self.kind == "softmax_gemm":
            return {"S": s("m", "l"), "V": s("l", "n")}
        if self.kind == "residual_layernorm":
            return {"X": s("m", "n"), "R": s("m", "n"), "W": s("n"), "B": s("n")}
        if self.kind == "gemm_sigmoid":
            return {"A": s("m", "k"), "Bw": s("k", "n"), "bias": s("n")}
        return {"A": s("m", "k"), "Bw": s("k", "n")}

    @property
    def outputs(self) -> dict[str, tuple[int, ...]]:
        s = self._s
        if self.kind == "attention":
            return {"O": s("b", "h", "m", "d")}
        if self.kind == "softmax_gemm":
            return {"O": s("m", "n")}
        return {"Y": s("m", "n")}

    @property
    def output(self) -> str:
        """The output that is checked."""
        return next(iter(self.outputs))

    @property
    def scale(self) -> float:
        """Attention's softmax scale, 1/sqrt(d)."""
        return 1.0 / math.sqrt(self.shape["d"]) if self.kind == "attention" else 1.0

    @property
    def reduction_length(self) -> int:
        """The most terms one reduction sums (the ``K`` of the output check, smg/tolerance.py)."""
        s = self.shape
        return {"attention": max(s.get("l", 1), s.get("d", 1)), "softmax_gemm": s.get("l", 1),
                "residual_layernorm": s.get("n", 1)}.get(self.kind, s.get("k", 1))

    # ---- FLOPs, bytes, roofline ----------------------------------------------------------------

    @property
    def flops(self) -> int:
        """FLOPs by the module docstring's rules."""
        s = self.shape
        if self.kind == "attention":
            full = 4 * s["b"] * s["h"] * s["m"] * s["l"] * s["d"]
            return full // 2 if self.causal else full
        if self.kind == "softmax_gemm":
            return 2 * s["m"] * s["l"] * s["n"]
        if self.kind == "residual_layernorm":
            return 8 * s["m"] * s["n"]
        return 2 * s["m"] * s["n"] * s["k"]

    @property
    def nbytes(self) -> int:
        """Minimal device-memory bytes: inputs read once, outputs written once."""
        elems = sum(math.prod(t) for t in (*self.inputs.values(), *self.outputs.values()))
        return elems * DTYPE_BYTES[self.dtype]

    @property
    def roofline(self) -> str:
        return "memory" if self.kind in ("softmax_gemm", "residual_layernorm") else "compute"

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.nbytes

    @property
    def shape_str(self) -> str:
        return "x".join(str(v) for v in self.shape.values())

    def describe(self) -> dict[str, Any]:
        """JSON-able description for the results file."""
        return {
            "key": self.key, "label": self.label, "kind": self.kind, "shape": dict(self.shape),
            "dtype": self.dtype, "causal": self.causal, "reference_for": self.reference_for,
            "inputs": {n: list(v) for n, v in self.inputs.items()},
            "outputs": {n: list(v) for n, v in self.outputs.items()},
            "flops": self.flops, "bytes": self.nbytes, "roofline": self.roofline,
            "arithmetic_intensity": self.arithmetic_intensity, "note": self.note,
        }

    # ---- which spacefusion artefact computes this workload ------------------------------------

    @property
    def wants_artefact(self) -> bool:
        return self.reference_for is None

    def matches(self, meta: Mapping[str, Any]) -> bool:
        """Whether a parsed ``kernel.json`` computes this workload (name, shape, dtype, flags, params)."""
        if not self.wants_artefact:
            return False
        wl = meta.get("workload") or {}
        if not isinstance(wl, Mapping):
            return False
        name, shape = wl.get("name"), wl.get("shape") or {}
        if wl.get("dtype", self.dtype) != self.dtype or not isinstance(shape, Mapping):
            return False
        if any(shape.get(d) != v for d, v in self.shape.items()):
            return False
        params = {p.get("name"): p for p in meta.get("params", [])  # scratch, tensor maps: the launcher's
                  if isinstance(p, Mapping) and p.get("role") not in ("scratch", "tensormap")}
        for pname, pshape in {**self.inputs, **self.outputs}.items():
            p = params.get(pname)
            if p is None or tuple(p.get("shape", ())) != pshape or p.get("dtype", self.dtype) != self.dtype:
                return False
        if self.kind == "attention":
            if shape.get("n", self.shape["d"]) != self.shape["d"]:
                return False
            if "scale" in wl and not math.isclose(float(wl["scale"]), self.scale, rel_tol=1e-6):
                return False
            if name == "mha":
                return not self.causal
            if name == "attention":
                causal = str(wl.get("causal", "False")) == "True"
                kv = int(wl.get("kv_heads", self.shape["h"]))
                return causal == self.causal and kv == self.shape["h"]
            return False
        if self.kind == "gemm_sigmoid":
            return name == "gemm_sigmoid" and set(params) == {"A", "Bw", "bias", "Y"}
        return name == self.kind and set(params) == {*self.inputs, *self.outputs}


def _attn(key: str, label: str, b: int, h: int, m: int, l: int, d: int, causal: bool = False) -> Workload:  # noqa: E741
    return Workload(key, label, "attention", {"b": b, "h": h, "m": m, "l": l, "d": d}, causal=causal)


#: The issue's benchmark shapes, fp16, in report order.
WORKLOADS: tuple[Workload, ...] = (
    _attn("mha_bert", "MHA BERT", 32, 12, 512, 512, 64),
    _attn("mha_vit", "MHA ViT", 16, 16, 197, 197, 64),
    _attn("mha_llama", "MHA LLaMA", 4, 32, 2048, 2048, 128),
    _attn("mha_causal", "causal MHA", 4, 32, 2048, 2048, 128, causal=True),
    Workload("softmax_gemm", "Softmax-GEMM", "softmax_gemm", {"m": 4096, "l": 4096, "n": 64}),
    Workload("layernorm", "LayerNorm(x+r)", "residual_layernorm", {"m": 16384, "n": 4096}),
    Workload("gemm_sigmoid", "sigmoid(A@B+bias)", "gemm_sigmoid", {"m": 8192, "n": 8192, "k": 1024}),
    Workload("gemm", "GEMM A@B (reference)", "gemm", {"m": 8192, "n": 8192, "k": 1024},
             reference_for="gemm_sigmoid", note="the plain GEMM under the sigmoid epilogue, for reference"),
    # beyond the table: decoding-shaped attention (few queries, a long KV cache), where one
    # block per row tile leaves most SMs idle unless blocks slice the KV steps
    _attn("mha_decode", "MHA decode (64 queries, 8K KV)", 1, 32, 64, 8192, 128),
)
BY_KEY: dict[str, Workload] = {w.key: w for w in WORKLOADS}


def select(keys: Iterable[str] | None) -> list[Workload]:
    """Workloads by key (all when ``keys`` is None), in table order; KeyError naming unknown keys."""
    if keys is None:
        return list(WORKLOADS)
    keys = list(keys)
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        raise KeyError(f"unknown workloads {unknown}; known: {list(BY_KEY)}")
    return [w for w in WORKLOADS if w.key in keys]


# ---- artefact folders ---------------------------------------------------------------------------


def artefact_folders(paths: Iterable[str | Path]) -> list[Path]:
    """Each path is an artefact folder (holds kernel.json) or a folder of them (one level down)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "kernel.json").is_file():
            out.append(p)
        elif p.is_dir():
            out.extend(sorted(c for c in p.iterdir() if (c / "kernel.json").is_file()))
    return out


def read_meta(folder: Path) -> dict[str, Any]:
    """The parsed kernel.json of an artefact folder."""
    data = json.loads((Path(folder) / "kernel.json").read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{folder}/kernel.json: not a JSON object")
    return data


def match_artefacts(workloads: Iterable[Workload], folders: Iterable[Path]) -> tuple[dict[str, Path | None],
                                                                                    list[dict[str, str]]]:
    """Pick an artefact folder for every workload that wants one.

    Returns ``(chosen, unused)``: ``chosen[key]`` is the first folder (in the order given) whose
    kernel.json matches the workload, or None (reported as NO_ARTEFACT); ``unused`` lists the folders
    not chosen, each with why (unreadable, matches no selected workload, or a later duplicate).
    """
    workloads = list(workloads)
    chosen: dict[str, Path | None] = {w.key: None for w in workloads if w.wants_artefact}
    unused: list[dict[str, str]] = []
    for folder in folders:
        try:
            meta = read_meta(folder)
        except (OSError, ValueError) as exc:
            unused.append({"path": str(folder), "why": f"unreadable kernel.json: {exc}"})
            continue
        hits = [w.key for w in workloads if w.matches(meta)]
        if not hits:
            unused.append({"path": str(folder), "why": "matches no selected workload"})
            continue
        free = [k for k in hits if chosen[k] is None]
        if free:
            chosen[free[0]] = Path(folder)
        else:
            unused.append({"path": str(folder), "why": f"duplicate: {hits[0]} already has {chosen[hits[0]]}"})
    return chosen, unused
