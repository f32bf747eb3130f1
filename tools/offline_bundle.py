#!/usr/bin/env python3
"""An offline bundle of spacefusion, Apache TVM and their dependencies, for a machine without internet.

The GPU machines often have Python with torch, cupy and nvcc preinstalled, but no internet and no TVM.
``make`` runs where pip reaches a package registry; ``install`` runs on the offline machine::

    # with internet, in the checkout's root (pins read from pyproject.toml: core + the ``tvm`` extra)
    python3 tools/offline_bundle.py make --out bundle --python-version 3.12 --split-mib 60
    # copy bundle/parts/ (or the whole bundle/ folder) to the offline machine, then there:
    python3 offline_bundle.py install bundle/parts                    # into the running Python
    python3 offline_bundle.py install bundle/parts --target /root/sfdeps   # or a folder, for PYTHONPATH

``make`` writes ``OUT/wheels/*.whl`` (the project's own wheel and binary wheels of every pin for the given
Python and manylinux x86_64), ``OUT/SHA256SUMS`` over them, ``OUT/BUNDLE.json`` (what was asked for) and a
copy of this script; with ``--split-mib N`` it also writes ``OUT/parts/``: the bundle as one tar cut into
parts of at most N MiB, their own ``SHA256SUMS`` and this script, so each part can travel on its own.
``install`` takes the bundle folder or the parts (from one or several folders), checks every checksum,
names each missing or corrupt file and installs nothing then, and otherwise runs ``pip install --no-index
--find-links``.  Into the running Python, pip resolves the requirements against what is installed (the
machine's numpy stays); with ``--target DIR`` (pip ignores what is installed there), every wheel whose
distribution the running Python already has is left out, unless ``--all``, and the rest go in without
dependency resolution, as ``PYTHONPATH=DIR`` then expects.

Standard library only (Python >= 3.11): it runs on the offline machine before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUMS = "SHA256SUMS"
INFO = "BUNDLE.json"
PART = "bundle.tar."
#: manylinux tags pip accepts for x86_64 wheels, newest first (pip download takes the first that has a wheel)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "linux_x86_64")


class BundleError(Exception):
    """What is wrong with a bundle (missing, corrupt, unreadable), in words for the user."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: Path, extras: list[str]) -> tuple[str, list[str]]:
    """``(project name, pins)``: the core dependencies of ``pyproject`` and those of each extra named, in order,
    without the project's references to itself (such as ``spacefusion[tvm]`` inside another extra)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    pins = list(project.get("dependencies", []))
    for extra in extras:
        if extra not in optional:
            raise BundleError(f"{pyproject}: no extra {extra!r}; it has {sorted(optional)}")
        pins += optional[extra]
    own = re.compile(rf"^{re.escape(canonical(name))}\b")
    out: list[str] = []
    for pin in pins:
        if not own.match(canonical(pin)) and pin not in out:
            out.append(pin)
    return name, out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_sums(folder: Path, names: list[str]) -> Path:
    """Write ``folder/SHA256SUMS`` (``sha256sum`` format, so ``sha256sum -c`` reads it too)."""
    path = folder / SUMS
    path.write_text("".join(f"{sha256(folder / n)}  {n}\n" for n in sorted(names)))
    return path


def read_sums(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise BundleError(f"missing {path}: not a bundle folder (or its manifest did not come along)")
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, _, name = line.partition("  ")
            out[name.strip()] = digest.strip()
    return out


def verify(folder: Path, sums: dict[str, str], where: dict[str, Path] | None = None) -> None:
    """Raise naming every file of ``sums`` that is missing or whose SHA-256 differs (``where`` maps a name to
    the file found for it, for parts gathered from several folders; otherwise ``folder / name``)."""
    missing, corrupt = [], []
    for name, digest in sorted(sums.items()):
        path = (where or {}).get(name, folder / name)
        if not path.is_file():
            missing.append(name)
        elif sha256(path) != digest:
            corrupt.append(str(path))
    problems = [f"missing: {n}" for n in missing] + [f"corrupt (SHA-256 differs from {SUMS}): {p}" for p in corrupt]
    if problems:
        raise BundleError(f"the bundle in {folder} is not whole; nothing was installed:\n  " + "\n  ".join(problems)
                          + ("\n  copy the files named again" if corrupt or missing else ""))


def split(tar: Path, dest: Path, part_mib: float) -> list[str]:
    """Cut ``tar`` into ``dest/bundle.tar.000, 001, ...`` of at most ``part_mib`` MiB each."""
    size = max(1, int(part_mib * (1 << 20)))
    names = []
    with tar.open("rb") as f:
        while block := f.read(size):
            name = f"{PART}{len(names):03d}"
            (dest / name).write_bytes(block)
            names.append(name)
    return names


def make(out: Path, *, python_version: str = "3.12", platforms: tuple[str, ...] = PLATFORMS,
         extras: list[str] | None = None, download: bool = True, project: bool = True,
         wheels: list[Path] | None = None, split_mib: float | None = None, pyproject: Path = REPO / "pyproject.toml",
         pip: list[str] | None = None) -> Path:
    """Build the bundle in ``out`` (emptied first); see the module's docstring.  ``download=False`` and
    ``project=False`` fetch and build nothing: the bundle then holds ``wheels`` only (the tests' way)."""
    extras = ["tvm"] if extras is None else extras
    pip = pip or [sys.executable, "-m", "pip"]
    name, pins = requirements(pyproject, extras)
    if out.exists():
        shutil.rmtree(out)
    whl = out / "wheels"
    whl.mkdir(parents=True)
    for w in wheels or []:
        if not w.name.endswith(".whl") or not w.is_file():
            raise BundleError(f"not a wheel file: {w}")
        shutil.copy2(w, whl / w.name)
    if project:
        print(f"building the {name} wheel from {pyproject.parent}", flush=True)
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(whl), str(pyproject.parent)], check=True)
    if download and pins:
        plat = [a for p in platforms for a in ("--platform", p)]
        print(f"downloading for Python {python_version}, {platforms[0]}: {' '.join(pins)}", flush=True)
        subprocess.run([*pip, "download", "-q", "--only-binary=:all:", "--python-version", python_version, *plat,
                        "-d", str(whl), *pins], check=True)
    names = sorted(f"wheels/{p.name}" for p in whl.glob("*.whl"))
    if not names:
        raise BundleError("no wheels to bundle (nothing downloaded, built or given)")
    info = {"project": name, "extras": extras, "requirements": pins, "python_version": python_version,
            "platforms": list(platforms), "wheels": [n.split("/", 1)[1] for n in names]}
    (out / INFO).write_text(json.dumps(info, indent=1) + "\n")
    write_sums(out, names)
    shutil.copy2(Path(__file__), out / Path(__file__).name)
    total = sum((out / n).stat().st_size for n in names)
    print(f"{len(names)} wheels, {total / (1 << 20):.1f} MiB, in {whl}")
    if split_mib:
        parts = out / "parts"
        parts.mkdir()
        with tempfile.TemporaryDirectory() as tmp:
            tar = Path(tmp) / "bundle.tar"
            with tarfile.open(tar, "w") as t:
                for n in [*names, SUMS, INFO]:
                    t.add(out / n, arcname=n)
            pnames = split(tar, parts, split_mib)
        write_sums(parts, pnames)
        shutil.copy2(Path(__file__), parts / Path(__file__).name)
        print(f"{len(pnames)} parts of at most {split_mib:g} MiB in {parts} (with {SUMS} and this script)")
    return out


def gather_parts(sources: list[Path]) -> tuple[Path, dict[str, str], dict[str, Path]]:
    """The parts manifest (the first ``SHA256SUMS`` listing ``bundle.tar.*`` among ``sources``) and where each
    part it lists was found (in any of the sources)."""
    sums_at = next((s / SUMS for s in sources if (s / SUMS).is_file()
                    and any(n.startswith(PART) for n in read_sums(s / SUMS))), None)
    if sums_at is None:
        raise BundleError(f"no parts manifest ({SUMS} listing {PART}*) in {', '.join(map(str, sources))}")
    sums = read_sums(sums_at)
    where = {}
    for name in sums:
        for s in sources:
            if (s / name).is_file():
                where[name] = s / name
                break
    return sums_at.parent, sums, where


def unpack(sources: list[Path], dest: Path) -> Path:
    """Check the parts found in ``sources``, join and unpack them into ``dest``; the bundle folder."""
    folder, sums, where = gather_parts(sources)
    verify(folder, sums, where)
    tar = dest / "bundle.tar"
    with tar.open("wb") as f:
        for name in sorted(sums):
            with where[name].open("rb") as p:
                shutil.copyfileobj(p, f)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    tar.unlink()
    return dest


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def wheel_name(filename: str) -> str:
    return canonical(filename.split("-", 1)[0])


def install(sources: list[Path], *, target: Path | None = None, everything: bool = False,
            pip: list[str] | None = None) -> list[str]:
    """Verify the bundle in ``sources`` (a bundle folder, or the parts) and install it; the wheels installed."""
    pip = pip or [sys.executable, "-m", "pip"]
    sources = [Path(s) for s in sources]
    for s in sources:
        if not s.is_dir():
            raise BundleError(f"no such folder: {s}")
    with tempfile.TemporaryDirectory() as tmp:
        if len(sources) == 1 and (sources[0] / INFO).is_file():
            folder = sources[0]
        else:
            folder = unpack(sources, Path(tmp))
        sums = read_sums(folder / SUMS)
        verify(folder, sums)
        info = json.loads((folder / INFO).read_text()) if (folder / INFO).is_file() else {}
        whl = sorted(folder / n for n in sums if n.endswith(".whl"))
        links = ["--no-index", "--find-links", str(folder / "wheels")]
        if target is None:
            project, extras = info.get("project"), info.get("extras") or []
            want = [f"{project}[{','.join(extras)}]" if extras else project] if project else []
            # the bundle's own project with its extras, resolved against what is installed; else every wheel
            if not want or not any(wheel_name(w.name) == canonical(project) for w in whl):
                want = [str(w) for w in whl]
            cmd = [*pip, "install", *links, *want]
            chosen = [w.name for w in whl]
        else:
            skip = [] if everything else [(w.name, v) for w in whl if (v := installed(wheel_name(w.name)))]
            for name, version in skip:
                print(f"leaving out {name}: this Python has {wheel_name(name)} {version}")
            chosen = [w.name for w in whl if w.name not in {n for n, _ in skip}]
            if not chosen:
                print("nothing to install: this Python has every distribution of the bundle")
                return []
            target.mkdir(parents=True, exist_ok=True)
            cmd = [*pip, "install", "--no-deps", *links, "--target", str(target), "--upgrade",
                   *[str(folder / "wheels" / n) for n in chosen]]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, check=False)
        if proc.returncode:
            raise BundleError(f"pip install failed (exit status {proc.returncode}); the bundle itself checked out")
    print(f"installed {len(chosen)} wheels" + (f" into {target}: export PYTHONPATH={target}:$PYTHONPATH"
                                               if target else ""))
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="offline_bundle.py", description=__doc__.split("\n\n")[0],
                                epilog="see the module's docstring, or docs/architecture.md "
                                       "(Installing on the GPU machine)")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="download the pinned wheels and build the project's (needs internet)")
    m.add_argument("--out", type=Path, default=Path("offline_bundle"), help="bundle folder (emptied first)")
    m.add_argument("--python-version", default="3.12", help="the offline machine's Python (default 3.12)")
    m.add_argument("--platform", action="append", dest="platforms",
                   help=f"a wheel platform tag, repeatable (default: {', '.join(PLATFORMS)})")
    m.add_argument("--extra", action="append", dest="extras",
                   help="an extra of pyproject.toml whose pins to add to the core ones, repeatable (default: tvm)")
    m.add_argument("--no-extras", action="store_true", help="the core dependencies only")
    m.add_argument("--wheel", action="append", type=Path, default=[], help="a local wheel to add, repeatable")
    m.add_argument("--no-download", action="store_true", help="download nothing (with --wheel: offline)")
    m.add_argument("--no-project", action="store_true", help="do not build the project's own wheel")
    m.add_argument("--split-mib", type=float, help="also write parts/: the bundle cut into parts of N MiB")
    m.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml")
    i = sub.add_parser("install", help="verify a bundle (or its parts) and install it, offline")
    i.add_argument("sources", nargs="+", type=Path,
                   help="the bundle folder, or the folder(s) holding its parts and their SHA256SUMS")
    i.add_argument("--target", type=Path, help="install into this folder (for PYTHONPATH), not the running Python")
    i.add_argument("--all", action="store_true", help="with --target: also the distributions this Python has")
    v = sub.add_parser("verify", help="check a bundle's (or its parts') checksums only")
    v.add_argument("sources", nargs="+", type=Path)
    a = p.parse_args(argv)
    try:
        if a.cmd == "make":
            make(a.out, python_version=a.python_version, platforms=tuple(a.platforms or PLATFORMS),
                 extras=[] if a.no_extras else a.extras, download=not a.no_download, project=not a.no_project,
                 wheels=a.wheel, split_mib=a.split_mib, pyproject=a.pyproject)
        elif a.cmd == "install":
            install(a.sources, target=a.target, everything=a.all)
        else:
            if len(a.sources) == 1 and (a.sources[0] / INFO).is_file():
                verify(a.sources[0], read_sums(a.sources[0] / SUMS))
            else:
                folder, sums, where = gather_parts(a.sources)
                verify(folder, sums, where)
            print("the bundle is whole")
    except (BundleError, subprocess.CalledProcessError) as e:
        print(f"offline_bundle: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
