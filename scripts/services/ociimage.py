"""Container images for the test node, written here without any registry or `FROM`: layer
tarballs and an OCI image archive (oci-layout, index.json, blobs), streamed into containerd with
`ctr -n k8s.io images import -`. Standard library only; run by scripts/services/kubernetes.sh
(the pause image) and by the node tests (the project image).

    ociimage.py pause --pause BIN --ref REF --containerd SOCK
    ociimage.py project --repo DIR --containerd SOCK [--cache DIR] [--tag-prefix REF]

The project image holds the project's Python (the interpreter the venv was made from, less its
test suite and its own site-packages), the venv at its own path, the shared libraries both link
against (ldd), busybox (seq, sleep, ...: the training operator's init container runs them), dash
as /bin/sh, an nslookup that resolves through glibc (see NSLOOKUP), and the source tree's
ctxlaunch/ and templates/ under /opt/ctxlaunch (first on PYTHONPATH). It is two
layers, each cached under --cache keyed by what it holds: the environment layer by the
pyproject.toml hash, the Python version and the venv's installed distributions (torch's
version among them), the source layer by the hash of the source files. The tag is the digest of
both keys, so a changed source tree gives a new tag and an unchanged one is not re-imported.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path

LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"
EPOCH = 0  # every file's mtime in a layer: layers are reproducible
BUSYBOX = Path("/bin/busybox")
HOME = "/home/ctxlaunch"
"""The pods' home directory, writable by the non-root user they run as."""
BUSYBOX_TOOLS = ("sh", "nslookup", "seq", "sleep", "echo", "cat", "ls", "env", "mkdir", "rm")
DEFAULT_CACHE = (
    Path(
        os.environ.get("CTXLAUNCH_KUBE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ctxlaunch"
    )
    / "images"
)


class ImageError(RuntimeError):
    """One line for the user."""


# --------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------
class Layer:
    """An uncompressed layer tarball being written: directories made as needed, files and
    symlinks added under their absolute paths, in the order given."""

    def __init__(self, path: Path):
        self.path = path
        self._tmp = path.with_suffix(".tmp")
        self._tar = tarfile.open(self._tmp, "w", format=tarfile.PAX_FORMAT)
        self._seen: set[str] = set()

    def _info(self, name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime = kind, mode, EPOCH
        return info

    def directory(self, name: str, mode: int = 0o755) -> None:
        name = name.strip("/")
        if not name or name in self._seen:
            return
        self.directory(os.path.dirname(name))
        self._seen.add(name)
        self._tar.addfile(self._info(name, tarfile.DIRTYPE, mode))

    def symlink(self, name: str, target: str) -> None:
        name = name.strip("/")
        if name in self._seen:
            return
        self.directory(os.path.dirname(name))
        self._seen.add(name)
        info = self._info(name, tarfile.SYMTYPE, 0o777)
        info.linkname = target
        self._tar.addfile(info)

    def file(
        self,
        name: str,
        source: Path | None = None,
        data: bytes | None = None,
        mode: int | None = None,
    ) -> None:
        name = name.strip("/")
        if name in self._seen:
            return
        self.directory(os.path.dirname(name))
        self._seen.add(name)
        if source is not None:
            stat = source.stat()
            info = self._info(name, tarfile.REGTYPE, mode or (stat.st_mode & 0o7777))
            info.size = stat.st_size
            with source.open("rb") as handle:
                self._tar.addfile(info, handle)
        else:
            payload = data or b""
            info = self._info(name, tarfile.REGTYPE, mode or 0o644)
            info.size = len(payload)
            self._tar.addfile(info, io.BytesIO(payload))

    def path_as_is(self, path: Path) -> None:
        """A host path at the same path in the image: a symlink stays a symlink (and what it
        points to is added too), a directory is added whole."""
        if path.is_symlink():
            target = os.readlink(path)
            self.symlink(str(path), target)
            self.path_as_is((path.parent / target) if not os.path.isabs(target) else Path(target))
        elif path.is_dir():
            self.tree(path, path)
        elif path.is_file():
            self.file(str(path), source=path)

    def tree(self, root: Path, at: Path, skip: Iterable[str] = ()) -> None:
        """Every file under `root` at `at` (sorted, so the tarball is reproducible); names
        matching a `skip` pattern (relative to root) are left out."""
        patterns = [re.compile(p) for p in skip]
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            kept = []
            for d in sorted(dirnames):
                rel = os.path.normpath(os.path.join(rel_dir, d))
                if any(p.fullmatch(rel) for p in patterns):
                    continue
                full = Path(dirpath, d)
                if full.is_symlink():
                    self.symlink(str(at / rel), os.readlink(full))
                else:
                    kept.append(d)
            dirnames[:] = kept
            self.directory(str(at / rel_dir))
            for f in sorted(filenames):
                rel = os.path.normpath(os.path.join(rel_dir, f))
                if any(p.fullmatch(rel) for p in patterns):
                    continue
                full = Path(dirpath, f)
                if full.is_symlink():
                    self.symlink(str(at / rel), os.readlink(full))
                elif full.is_file():
                    self.file(str(at / rel), source=full)

    def close(self) -> tuple[str, int]:
        """Finish the tarball; (sha256 digest, size)."""
        self._tar.close()
        digest = sha256_file(self._tmp)
        os.replace(self._tmp, self.path)
        return digest, self.path.stat().st_size

    def abort(self) -> None:
        self._tar.close()
        self._tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def cached_layer(cache: Path, key: str, fill) -> tuple[Path, str, int]:
    """The layer `key` from the cache, or written by `fill(layer)` and cached; (path, digest,
    size). The digest is kept beside the tarball so a cached layer is not hashed again."""
    cache.mkdir(parents=True, exist_ok=True)
    path, meta = cache / f"{key}.tar", cache / f"{key}.json"
    # One writer per layer: a second build of the same layer (another test run, another
    # worker) waits for the first and then takes its result from the cache.
    with (cache / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file() and meta.is_file():
            info = json.loads(meta.read_text())
            os.utime(path)  # used now: the pruning keeps the layers used last
            return path, info["digest"], info["size"]
        layer = Layer(path)
        try:
            fill(layer)
        except BaseException:
            layer.abort()
            raise
        digest, size = layer.close()
        tmp = meta.with_suffix(".jtmp")
        tmp.write_text(json.dumps({"digest": digest, "size": size}))
        os.replace(tmp, meta)
        return path, digest, size


# --------------------------------------------------------------------------------------------
# the image archive and its import
# --------------------------------------------------------------------------------------------
def image_blobs(
    layers: list[tuple[Path, str, int]],
    ref: str,
    env: list[str],
    entrypoint: list[str] | None,
    cmd: list[str] | None,
    workdir: str = "/",
) -> tuple[list[tuple[str, bytes]], dict]:
    """The config and manifest blobs (digest, bytes) and the index of an image of `layers`."""
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {
            "Env": env,
            "WorkingDir": workdir,
            **({"Entrypoint": entrypoint} if entrypoint else {}),
            **({"Cmd": cmd} if cmd else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [d for _, d, _ in layers]},
        "history": [{"created_by": "ctxlaunch scripts/services/ociimage.py"} for _ in layers],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA,
        "config": {"mediaType": CONFIG_MEDIA, "digest": config_digest, "size": len(config_bytes)},
        "layers": [{"mediaType": LAYER_MEDIA, "digest": d, "size": s} for _, d, s in layers],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": MANIFEST_MEDIA,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": ref,
                    "org.opencontainers.image.ref.name": ref,
                },
            }
        ],
    }
    return [(config_digest, config_bytes), (manifest_digest, manifest_bytes)], index


def write_archive(
    out, layers: list[tuple[Path, str, int]], blobs: list[tuple[str, bytes]], index: dict
) -> None:
    """The OCI image layout as one tar stream to the binary file `out`."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:

        def add_bytes(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), EPOCH, 0o644
            tar.addfile(info, io.BytesIO(data))

        add_bytes("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        add_bytes("index.json", json.dumps(index).encode())
        for path, digest, size in layers:
            info = tarfile.TarInfo("blobs/sha256/" + digest.split(":", 1)[1])
            info.size, info.mtime, info.mode = size, EPOCH, 0o644
            with path.open("rb") as handle:
                tar.addfile(info, handle)
        for digest, data in blobs:
            add_bytes("blobs/sha256/" + digest.split(":", 1)[1], data)


def ctr(containerd: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["ctr", "--address", containerd, "-n", "k8s.io", *args], **kwargs)


def has_image(containerd: str, ref: str) -> bool:
    result = ctr(containerd, "images", "ls", "-q", capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise ImageError(f"ctr cannot list images on {containerd}: {result.stderr.strip()}")
    return ref in result.stdout.split()


def import_image(
    containerd: str,
    layers: list[tuple[Path, str, int]],
    ref: str,
    env: list[str],
    entrypoint: list[str] | None = None,
    cmd: list[str] | None = None,
) -> None:
    """Stream the archive into `ctr -n k8s.io images import -` (it unpacks for the CRI's
    snapshotter)."""
    blobs, index = image_blobs(layers, ref, env, entrypoint, cmd)
    process = subprocess.Popen(
        [
            "ctr",
            "--address",
            containerd,
            "-n",
            "k8s.io",
            "images",
            "import",
            "--no-unpack=false",
            "-",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        write_archive(process.stdin, layers, blobs, index)
        process.stdin.close()
    except BrokenPipeError:
        pass
    output = process.stdout.read().decode(errors="replace")
    if process.wait() != 0:
        raise ImageError(f"ctr images import of {ref} failed: {output.strip()}")
    if not has_image(containerd, ref):
        raise ImageError(
            f"ctr images import reported success but {ref} is not listed: {output.strip()}"
        )


# --------------------------------------------------------------------------------------------
# the pause image
# --------------------------------------------------------------------------------------------
def pause_image(pause: Path, ref: str, containerd: str, cache: Path) -> None:
    if not pause.is_file():
        raise ImageError(f"--pause {pause}: no such file")
    key = "pause-" + hashlib.sha256(pause.read_bytes()).hexdigest()[:16]
    layer = cached_layer(cache, key, lambda lay: lay.file("/pause", source=pause, mode=0o755))
    import_image(containerd, [layer], ref, env=["PATH=/"], entrypoint=["/pause"])


# --------------------------------------------------------------------------------------------
# the project image
# --------------------------------------------------------------------------------------------
SOURCE_PARTS = ("ctxlaunch", "templates", "pyproject.toml")


def venv_of(repo: Path) -> Path:
    venv = Path(os.environ.get("VIRTUAL_ENV") or sys.prefix)
    if not (venv / "pyvenv.cfg").is_file():
        raise ImageError(
            f"{venv} is not a virtual environment (no pyvenv.cfg): run this with "
            "the project's .venv/bin/python"
        )
    return venv


def base_python(venv: Path) -> Path:
    """The installation the venv was made from (pyvenv.cfg's home is its bin directory)."""
    cfg = dict(
        line.split(" = ", 1)
        for line in (venv / "pyvenv.cfg").read_text().splitlines()
        if " = " in line
    )
    return Path(cfg["home"]).parent


def env_key(repo: Path, venv: Path) -> str:
    site = (
        venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    )
    dists = sorted(p.name for p in site.glob("*.dist-info"))
    torch = next((d for d in dists if d.startswith("torch-")), "no-torch")
    h = hashlib.sha256()
    for part in (
        (repo / "pyproject.toml").read_bytes(),
        sys.version.encode(),
        str(venv).encode(),
        str(base_python(venv)).encode(),
        "\n".join(dists).encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return f"env-{torch.removesuffix('.dist-info')}-{h.hexdigest()[:16]}"


def source_files(repo: Path) -> list[Path]:
    files = []
    for part in SOURCE_PARTS:
        path = repo / part
        if path.is_file():
            files.append(path)
            continue
        for p in sorted(path.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc"):
                files.append(p)
    return files


def source_key(repo: Path) -> str:
    h = hashlib.sha256(NSLOOKUP + DASH.read_bytes() + HOME.encode())
    for path in source_files(repo):
        h.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
    return "src-" + h.hexdigest()[:16]


def shared_libraries(paths: Iterable[Path]) -> set[Path]:
    """Every shared library the executables and extension modules load (ldd), with the
    dynamic loader; what is in the venv or the base Python itself is added with them."""
    found: set[Path] = set()
    batch = [str(p) for p in paths]
    for start in range(0, len(batch), 64):
        result = subprocess.run(["ldd", *batch[start : start + 64]], capture_output=True, text=True)
        for line in result.stdout.splitlines():
            match = re.search(r"=>\s*(/\S+)|^\s*(/\S+)\s+\(0x", line)
            if match:
                found.add(Path(match.group(1) or match.group(2)))
    return found


def fill_env(layer: Layer, venv: Path) -> None:
    python = base_python(venv)
    lib = f"python{sys.version_info.major}.{sys.version_info.minor}"
    # Debian's merged /usr: /bin, /lib and /lib64 are links into it.
    for name in ("bin", "lib", "lib64", "sbin"):
        layer.symlink(f"/{name}", f"usr/{name}")
    layer.directory("/tmp", 0o1777)
    layer.directory("/etc")
    layer.file("/etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n")
    layer.file("/etc/group", data=b"root:x:0:\n")
    layer.directory("/root", 0o700)
    layer.file("/usr/bin/busybox", source=BUSYBOX, mode=0o755)
    for tool in BUSYBOX_TOOLS:
        layer.symlink(f"/usr/bin/{tool}", "busybox")
    layer.tree(
        python,
        python,
        skip=[
            f"lib/{lib}/test",
            f"lib/{lib}/site-packages(/.*)?",
            rf"lib/{lib}/config-.*",
            r"lib/.*\.a",
        ],
    )
    layer.tree(venv, venv)
    binaries = [p for p in (python / "bin").iterdir() if p.is_file() and not p.is_symlink()]
    binaries += [p for p in python.rglob("*.so*") if p.is_file()]
    binaries += [p for p in venv.rglob("*.so*") if p.is_file()]
    binaries += [BUSYBOX, DASH]  # Debian's busybox and dash link against libc (and libresolv)
    inside = (str(python), str(venv))
    for library in sorted(shared_libraries(binaries)):
        if str(library).startswith(inside):
            continue
        # Added at its real path, and linked from the name ldd found it by (under the image's
        # merged /usr, as on Debian: /lib and /lib64 are links into /usr).
        real = Path(os.path.realpath(library))
        layer.file(str(real), source=real)
        named = Path(os.path.realpath(library.parent)) / library.name
        if named != real:
            layer.symlink(str(named), str(real))


NSLOOKUP = b"""#!/bin/sh
# The training operator's init container runs `nslookup <job>-master-0` until it answers.
# busybox 1.35's nslookup queries every search domain and fails when any says NXDOMAIN, even
# after one answered; this one resolves as the trainer will, through glibc (search, ndots).
exec python3 -c 'import socket, sys; print(sys.argv[1], socket.gethostbyname(sys.argv[1]))' "$1"
"""


DASH = Path("/usr/bin/dash")
"""The image's /bin/sh: busybox's sh runs its own nslookup applet whatever PATH says."""


def fill_source(layer: Layer, repo: Path) -> None:
    layer.file("/usr/local/bin/nslookup", data=NSLOOKUP, mode=0o755)
    layer.file("/usr/bin/sh", source=DASH, mode=0o755)  # replaces the busybox link below it
    # The pods run as a non-root user (the rendered securityContext), as the Dockerfile's
    # image does; any user may write its home, as anyone may write /tmp.
    layer.directory(HOME, mode=0o1777)
    for path in source_files(repo):
        layer.file(str(Path("/opt/ctxlaunch") / path.relative_to(repo)), source=path)


def project_image(repo: Path, containerd: str, cache: Path, tag_prefix: str) -> str:
    venv = venv_of(repo)
    started = time.monotonic()
    ekey, skey = env_key(repo, venv), source_key(repo)
    tag = hashlib.sha256(f"{ekey}/{skey}".encode()).hexdigest()[:12]
    ref = f"{tag_prefix}:{tag}"
    if has_image(containerd, ref):
        print(f"ociimage: {ref} already imported", file=sys.stderr)
        return ref
    env_layer = cached_layer(cache, ekey, lambda lay: fill_env(lay, venv))
    built = time.monotonic()
    src_layer = cached_layer(cache, skey, lambda lay: fill_source(lay, repo))
    env = [
        f"PATH={venv}/bin:/usr/local/bin:/usr/bin:/bin",
        f"VIRTUAL_ENV={venv}",
        "PYTHONPATH=/opt/ctxlaunch",
        "PYTHONDONTWRITEBYTECODE=1",
        f"HOME={HOME}",
    ]
    import_image(containerd, [env_layer, src_layer], ref, env=env, cmd=["python3"])
    done = time.monotonic()
    print(
        f"ociimage: {ref}: layers {built - started:.1f} s "
        f"(environment {env_layer[2] / 1e9:.2f} GB), import {done - built:.1f} s",
        file=sys.stderr,
    )
    # Keep the cache small: the layers used last only (an environment layer is the whole
    # venv, about 2 GB, one per checkout; kept without bound they filled the disk, and the
    # kubelet evicts images when its disk runs low).
    prune(cache, "src-", keep=4)
    prune(cache, "env-", keep=2)
    return ref


def prune(cache: Path, prefix: str, keep: int) -> None:
    """Remove all but the `keep` layers named PREFIX* that were used (or written) last."""
    layers = sorted(cache.glob(f"{prefix}*.tar"), key=lambda p: p.stat().st_mtime)
    for old in layers[:-keep]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
        old.with_suffix(".lock").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    pause = sub.add_parser("pause")
    pause.add_argument("--pause", type=Path, required=True)
    pause.add_argument("--ref", required=True)
    project = sub.add_parser("project")
    project.add_argument("--repo", type=Path, required=True)
    project.add_argument("--tag-prefix", default="ctxlaunch.local/ctxlaunch")
    for p in (pause, project):
        p.add_argument("--containerd", required=True, help="containerd's socket")
        p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    if shutil.which("ctr") is None:
        print("ociimage: error: no ctr on PATH (apt-get install containerd)", file=sys.stderr)
        return 1
    try:
        if args.what == "pause":
            pause_image(args.pause, args.ref, args.containerd, args.cache)
            print(args.ref)
        else:
            print(project_image(args.repo.resolve(), args.containerd, args.cache, args.tag_prefix))
    except ImageError as exc:
        print(f"ociimage: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
