"""The GPU must be exclusive while a gate times: an advisory lock file (fcntl.flock) so two gate runs
never time at once, and a warning when other processes use the GPU.

The lock lives at $MEGART_LOCK_DIR/megart-faithful.lock, else /tmp/megart-faithful.lock (or the
path given with --lock-file). The lock file is opened without truncation and never written: it stays
empty, and a path that holds anything else (a results file given by mistake) is refused untouched.
The holder writes its pid, command line and start time into a separate file, `<lock>.holder`, so a
waiter that times out can say who holds it. flock locks die with their process: a crashed holder
never leaves a stale lock behind.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from .codes import LOCKED, USAGE, GateError

LOCK_NAME = "megart-faithful.lock"


def default_path() -> Path:
    d = os.environ.get("MEGART_LOCK_DIR")
    return Path(d) / LOCK_NAME if d else Path("/tmp") / LOCK_NAME


HOLDER_TAG = "megart-faithful-gpu-lock"     # marks a holder file as ours


def holder_path(path: Path) -> Path:
    return path.with_name(path.name + ".holder")


def _holder(path: Path) -> dict:
    try:
        h = json.loads(holder_path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return h if isinstance(h, dict) and h.get("tag") == HOLDER_TAG else {}


def _old_lock_record(path: Path) -> bool:
    """Earlier megart versions wrote the holder into the lock file itself; a crashed one left it there."""
    try:
        rec = json.loads(path.read_text(errors="replace")[:4096])
    except (OSError, ValueError):
        return False
    return isinstance(rec, dict) and bool(rec) and set(rec) <= {"pid", "host", "since", "cmd"}


def _refuse_foreign(path: Path) -> None:
    """A lock file is empty, and a holder file is one of ours; anything else belongs to someone else."""
    foreign = None
    try:
        if path.is_dir():
            foreign = f"{path} is a directory"
        elif path.exists() and path.stat().st_size > 0 and not _old_lock_record(path):
            foreign = f"{path} is not empty ({path.stat().st_size} bytes)"
        hp = holder_path(path)
        if foreign is None and hp.exists() and not _holder(path):
            foreign = f"{hp} exists and is not a megart lock holder record"
    except OSError as exc:
        foreign = f"{path} cannot be inspected ({exc})"
    if foreign:
        raise GateError(USAGE, f"refusing the lock file: {foreign}. A lock file is an empty file megart creates; "
                               "pointing --lock-file at another file (a results file, say) would risk its contents. "
                               "Give a path of its own, or leave --lock-file out.")


class GpuLock:
    """`with GpuLock(timeout=...):` waits up to `timeout` seconds for the lock, else GateError(LOCKED)."""

    def __init__(self, path: str | os.PathLike | None = None, timeout: float = 600.0, poll: float = 0.1,
                 label: str = ""):
        self.path = Path(path) if path else default_path()
        self.timeout = float(timeout)
        self.poll = poll
        self.label = label
        self._f = None
        self.waited = 0.0

    def acquire(self) -> "GpuLock":
        _refuse_foreign(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a")          # created if missing, never truncated, never written
        except OSError as exc:
            raise GateError(LOCKED, f"cannot open the GPU lock file {self.path}: {exc}. Point MEGART_LOCK_DIR (or "
                                    "--lock-file) at a directory every gate user can write.") from None
        t0 = time.monotonic()
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                if waited >= self.timeout:
                    f.close()
                    h = _holder(self.path)
                    who = (f"pid {h.get('pid')} on {h.get('host', '?')} since {h.get('since', '?')}, running: "
                           f"{h.get('cmd', '?')}") if h.get("pid") else "a process that has not written its pid yet"
                    raise GateError(LOCKED, f"the GPU is busy: another faithful gate run holds {self.path} ({who}). "
                                            f"Waited {waited:.1f} s (--lock-timeout {self.timeout:g}). Two gate runs "
                                            "must never time at once; wait for it to finish, or raise "
                                            "--lock-timeout.") from None
                time.sleep(min(self.poll, max(0.0, self.timeout - waited)))
        self.waited = time.monotonic() - t0
        self._f = f
        try:
            _refuse_foreign(self.path)        # (checked again: it may have changed while we waited)
            _write_holder(self.path, {"tag": HOLDER_TAG, "pid": os.getpid(), "host": socket.gethostname(),
                                      "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                                      "cmd": self.label or " ".join(sys.argv)})
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        if self._f is not None:
            try:
                if _holder(self.path).get("pid") == os.getpid():
                    holder_path(self.path).unlink(missing_ok=True)
            except OSError:
                pass
            finally:
                fcntl.flock(self._f.fileno(), fcntl.LOCK_UN)
                self._f.close()
                self._f = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _write_holder(path: Path, rec: dict) -> None:
    """Who holds the lock, for a waiter's message (written next to the lock, renamed into place)."""
    hp = holder_path(path)
    tmp = hp.with_name(f"{hp.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, hp)
    except OSError:
        tmp.unlink(missing_ok=True)    # the lock still holds; a waiter just cannot name us


def other_gpu_processes(device_index: int | None = None) -> list[dict] | None:
    """Compute processes on this GPU other than us, from nvidia-smi; None when that cannot be known
    (no nvidia-smi, it failed, or it timed out): the caller then stays silent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    uuid = None
    if device_index is not None:
        try:
            import torch
            uuid = str(torch.cuda.get_device_properties(device_index).uuid).lower().removeprefix("gpu-")
        except Exception:
            uuid = None
    procs = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        gpu, pid, name, mem = parts[0], parts[1], parts[2], parts[3]
        if uuid and gpu.lower().removeprefix("gpu-") != uuid:
            continue
        try:
            if int(pid) == os.getpid():
                continue
        except ValueError:
            continue
        procs.append({"pid": int(pid), "name": name, "used_memory_mib": mem})
    return procs
