"""Build this project's container images locally with podman (``make images``), with no registry.

1. the base image ``localhost/airflow-elastic-gpu-base:bookworm``: a Debian bookworm root file system
   made by ``debootstrap --variant=minbase`` (python3, pip) and ``podman import``ed; skipped when the
   image exists;
2. the images of ``docker/`` built ``--from`` that base (their ``FROM python:3.11-slim`` cannot be
   pulled here): ``localhost/airflow-elastic-gpu-agent:dev`` (agent, launcher source, broker API)
   and ``localhost/airflow-elastic-gpu-trainer:dev`` (the demo trainer, CPU PyTorch).

Builds ``pip install`` through the host's network (``--network host``) with the host's own pip
configuration: its index, find-links and constraint paths (``pip config list``) are bind-mounted
into the build read-only, so the images get the same packages as the project's virtual
environment. podman reads ``containers/containers.conf`` ($CONTAINERS_CONF): the ``runc`` runtime
and no default ulimits.

Usage: ``python containers/build_images.py [--rebuild-base] [--only agent|trainer]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS_CONF = ROOT / "containers" / "containers.conf"
BASE_IMAGE = "localhost/airflow-elastic-gpu-base:bookworm"
AGENT_IMAGE = "localhost/airflow-elastic-gpu-agent:dev"
TRAINER_IMAGE = "localhost/airflow-elastic-gpu-trainer:dev"
BASE_PACKAGES = ("python3", "python3-pip", "python-is-python3", "ca-certificates", "passwd")
BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8",
            "PIP_BREAK_SYSTEM_PACKAGES=1", "PIP_DISABLE_PIP_VERSION_CHECK=1", "PYTHONUNBUFFERED=1")


@dataclass(frozen=True)
class ImageBuild:
    """One image of ``docker/``: its Dockerfile (relative to the repository root) and local tag."""

    dockerfile: str
    tag: str


IMAGES = {"agent": ImageBuild("docker/Dockerfile.agent", AGENT_IMAGE),
          "trainer": ImageBuild("docker/Dockerfile.train", TRAINER_IMAGE)}


class ContainerSetupError(RuntimeError):
    """podman (or debootstrap) is missing or unusable; the message says how to fix it."""


def say(message: str) -> None:
    print(f"[images] {message}", flush=True)


def podman_env() -> dict[str, str]:
    """The environment for podman calls: ``$CONTAINERS_CONF`` set to the project's file unless the
    caller set one."""
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}


def podman(*args: str, check: bool = True, capture: bool = True, timeout_s: float | None = None
           ) -> subprocess.CompletedProcess[str]:
    """Run ``podman ARGS``.

    :raises ContainerSetupError: podman is not installed.
    :raises subprocess.CalledProcessError: it failed and ``check``.
    """
    if shutil.which("podman") is None:
        raise ContainerSetupError("podman is not installed: `apt-get install podman runc` (make images does it)")
    return subprocess.run(["podman", *args], env=podman_env(), text=True, check=check, timeout=timeout_s,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)


def check_podman() -> None:
    """Run a trivial container-free podman command and check the runtime.

    :raises ContainerSetupError: podman cannot run here; the message names the usual fixes.
    """
    try:
        info = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout_s=60)
    except subprocess.CalledProcessError as exc:
        raise ContainerSetupError(
            f"podman does not work here: {exc.stderr.strip()[-400:]}\n"
            f"Fixes: install Debian's runc (`apt-get install runc`; crun fails on kernels with hybrid "
            f"cgroups) and use {CONTAINERS_CONF.relative_to(ROOT)} (runtime = \"runc\", "
            f"default_ulimits = []) through $CONTAINERS_CONF") from None
    runtime = info.stdout.strip()
    if runtime != "runc":
        raise ContainerSetupError(f"podman uses the runtime {runtime!r}, expected runc: check $CONTAINERS_CONF "
                                  f"(default {CONTAINERS_CONF.relative_to(ROOT)}) and `apt-get install runc`")


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def build_base(*, rebuild: bool) -> None:
    """debootstrap a minimal bookworm with python3 and pip, import it as :data:`BASE_IMAGE`.

    :raises ContainerSetupError: debootstrap is missing or failed.
    """
    if image_exists(BASE_IMAGE) and not rebuild:
        say(f"base image {BASE_IMAGE} exists (--rebuild-base to make it again)")
        return
    if shutil.which("debootstrap") is None:
        raise ContainerSetupError("debootstrap is not installed: `apt-get install debootstrap` (make images does it)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="aeg-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        say(f"debootstrap bookworm (minbase + {', '.join(BASE_PACKAGES)}): about a minute")
        done = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                               "bookworm", str(rootfs)], text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise ContainerSetupError(f"debootstrap failed (exit {done.returncode}):\n{done.stdout[-1500:]}")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*.deb" if cache.endswith("archives") else "*_*"):
                entry.unlink()
        say("podman import (tar of the root file system)")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        changes = [arg for env in BASE_ENV for arg in ("--change", f"ENV {env}")]
        imported = subprocess.run(["podman", "import", *changes, "--change", 'CMD ["python3"]', "-", BASE_IMAGE],
                                  stdin=tar.stdout, env=podman_env(), text=True, capture_output=True)
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise ContainerSetupError(f"podman import failed: {imported.stderr.strip()[-800:]}")
    say(f"base image {BASE_IMAGE} built in {time.monotonic() - started:.0f} s")


def pip_mounts() -> tuple[list[str], str]:
    """The host's pip configuration for builds: ``(podman -v arguments, pip.conf text)``.

    Every local path it names (index and find-links ``file://`` URLs, constraint files) is
    bind-mounted read-only at the same path, so that the configuration means the same inside.
    """
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], text=True, capture_output=True).stdout
    options: dict[str, str] = {}
    for line in listed.splitlines():  # global.extra-index-url='a b'  /  :env:.find-links='x'
        match = re.fullmatch(r"[^.]*\.([a-z-]+)='(.*)'", line.strip())
        if match:
            options[match.group(1)] = match.group(2)
    for name, env in (("find-links", "PIP_FIND_LINKS"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                      ("index-url", "PIP_INDEX_URL"), ("constraint", "PIP_CONSTRAINT")):
        if os.environ.get(env):
            options[name] = os.environ[env]
    mounts: list[str] = []
    for value in options.values():
        for item in value.split():
            path = item.removeprefix("file://")
            if path.startswith("/") and Path(path).exists():
                top = Path(path) if Path(path).is_dir() else Path(path).parent
                if top.name == "simple":  # a file:// index: mount its parent (the files it links to)
                    top = top.parent
                mounts += ["-v", f"{top}:{top}:ro"]
    conf = "[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(options.items()))
    return _dedupe(mounts), conf


def _dedupe(mounts: list[str]) -> list[str]:
    pairs = list(dict.fromkeys(zip(mounts[::2], mounts[1::2], strict=True)))
    return [part for pair in pairs for part in pair]


def build_image(image: ImageBuild) -> None:
    """``podman build`` one Dockerfile of ``docker/`` from :data:`BASE_IMAGE`, context the repository root.

    :raises subprocess.CalledProcessError: the build failed (its output was shown).
    """
    mounts, conf = pip_mounts()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="aeg-pip-") as tmp:
        conf_file = Path(tmp) / "pip.conf"
        conf_file.write_text(conf)
        say(f"build {image.tag} from {image.dockerfile} (base {BASE_IMAGE})")
        podman("build", "--network", "host", "--from", BASE_IMAGE, "-f", image.dockerfile, "-t", image.tag,
               "--layers", *mounts, "-v", f"{conf_file}:/etc/pip.conf:ro", str(ROOT), capture=False)
    say(f"{image.tag} built in {time.monotonic() - started:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild-base", action="store_true", help="debootstrap the base image again")
    parser.add_argument("--only", choices=sorted(IMAGES), action="append", help="build only these images")
    args = parser.parse_args(argv)
    try:
        check_podman()
        build_base(rebuild=args.rebuild_base)
        for name in args.only or sorted(IMAGES):
            build_image(IMAGES[name])
    except ContainerSetupError as exc:
        print(f"[images] error: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"[images] error: {' '.join(exc.cmd[:3])}... failed with exit code {exc.returncode}", file=sys.stderr)
        return 1
    for tag in (BASE_IMAGE, *(IMAGES[n].tag for n in args.only or sorted(IMAGES))):
        size = podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip()
        say(f"{tag}: {int(size) / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
