"""Prepare, on this machine, the wheels the GPU machine's image lacks, for `scripts/gpu-verify.sh`.

The GPU machine has no network, Python 3.12 and its own packages (torch 2.11 among them; the list
is scripts/gpu-image-packages.txt, read off the device tool's KINDS.md). Whatever posttrain needs
(its dependencies and test tools) and the image does not hold travels as wheels in the ignored
folder .whl/, which a device call carries and gpu-verify.sh installs into /tmp/site. This script
walks the requirements from posttrain's own (and the extras asked for, e.g. `trl` for the
comparison with TRL), takes each missing package at the version requirements/lock.txt pins (else
the newest that fits), downloads wheels for CPython 3.12 on manylinux x86_64 without their
dependencies, follows each wheel's own requirements the same way, checks the total against what
one device call can carry, and prints the files.

Usage: python scripts/gpu_wheels.py [--dest .whl] [--with trl==1.16.0 ...] [--limit-mib 60] [--dry-run]
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
#: what a pip marker sees on the GPU machine
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
#: test tools the GPU run needs besides the project's dependencies (pytest, hypothesis and
#: pytest-timeout are in the image; ruff and wandb serve tests that are not CUDA tests)
TEST_NEEDS = ["pytest", "hypothesis", "pytest-timeout"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    path = os.path.join(ROOT, "scripts", "gpu-image-packages.txt")
    with open(path) as f:
        return {canonical(line.strip()) for line in f if line.strip() and not line.startswith("#")}


def lock_pins() -> dict[str, str]:
    pins = {}
    with open(os.path.join(ROOT, "requirements", "lock.txt")) as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
            if m:
                pins[canonical(m.group(1))] = m.group(2)
    return pins


def project_requirements() -> list[str]:
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def wheel_requirements(path: str) -> list[str]:
    """A wheel's Requires-Dist lines that apply on the GPU machine (no extras)."""
    from packaging.markers import Marker

    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    out = []
    for req in msg.get_all("Requires-Dist") or []:
        spec, _, marker = req.partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate(ENV):
            continue
        out.append(spec.strip())
    return out


def download(spec: str, dest: str) -> str:
    """Download one wheel for the GPU machine; its file's path."""
    before = set(os.listdir(dest))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", dest, "--disable-pip-version-check"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}  # (this machine's find-links and torch cap are for itself)
    proc = subprocess.run([*cmd, spec], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"gpu_wheels: pip could not download {spec} for CPython 3.12: "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    new = sorted(set(os.listdir(dest)) - before)
    if not new:  # already there
        name = canonical(re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0])
        new = [f for f in os.listdir(dest) if canonical(f.split("-")[0]) == name]
    return os.path.join(dest, new[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=os.path.join(ROOT, ".whl"))
    ap.add_argument("--with", dest="extra", action="append", default=[], help="another root requirement (e.g. trl==1.16.0)")
    ap.add_argument("--limit-mib", type=float, default=60.0, help="what the wheels may weigh together (a call carries 64 MiB "
                    "with the working tree)")
    ap.add_argument("--dry-run", action="store_true", help="say what would be downloaded, download nothing")
    args = ap.parse_args(argv)
    from packaging.requirements import Requirement

    have, pins = image_packages(), lock_pins()
    queue = [*project_requirements(), *TEST_NEEDS, *args.extra]
    seen: set[str] = set()
    wanted: list[str] = []
    os.makedirs(args.dest, exist_ok=True)
    files = []
    while queue:
        req = Requirement(queue.pop(0))
        name = canonical(req.name)
        if name in seen or name in have:
            continue
        seen.add(name)
        version = pins.get(name)
        spec = f"{req.name}=={version}" if version and (not req.specifier or req.specifier.contains(version)) else str(req)
        wanted.append(spec)
        if args.dry_run:
            print(f"would download {spec}")
            continue
        path = download(spec, args.dest)
        files.append(path)
        queue += wheel_requirements(path)
    if args.dry_run:
        return 0
    stale = [f for f in os.listdir(args.dest) if os.path.join(args.dest, f) not in files]
    for f in stale:  # one version of each, or the install there stops
        os.remove(os.path.join(args.dest, f))
    total = sum(os.path.getsize(f) for f in files)
    for f in sorted(files):
        print(f"{os.path.getsize(f) / 2**20:7.2f} MiB  {os.path.relpath(f, ROOT)}")
    print(f"{len(files)} wheels, {total / 2**20:.1f} MiB in {os.path.relpath(args.dest, ROOT)}/ "
          f"(limit {args.limit_mib:.0f} MiB; carry it: run(..., carry=['.whl']))")
    if total > args.limit_mib * 2**20:
        print(f"gpu_wheels: {total / 2**20:.1f} MiB is over the {args.limit_mib:.0f} MiB a call can carry beside the "
              "working tree; split the wheels over two calls or drop an extra", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
