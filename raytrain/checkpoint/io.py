"""The bytes of a checkpoint: checksummed, durable file writes, the safetensors stream, and the host
copy an asynchronous save writes from.

Every file is checksummed while it is written (xxHash's XXH3-128: about ten times the speed of
writing into the page cache here, where sha256 ran at half of it), so no file is read back for the
manifest. Corruption detection needs no cryptographic hash; manifests written with sha256 by older
raytrain still verify. `file_checksum` reads through mmap: no copy into Python buffers.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import threading
from typing import Any, Callable

import torch
import xxhash
from safetensors.torch import save_file

#: the algorithm of new manifests; verification also reads the others listed here
CHECKSUM = "xxh3_128"
ALGORITHMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_HASH_CHUNK = 1 << 20      # hashed then written while still in the CPU cache: one trip through memory
_WRITEBACK_EVERY = 16 << 20
_DIRECT_ALIGN = 4096       # O_DIRECT: buffer address, file offset and length in whole blocks
_DIRECT_MIN = 4 << 20      # smaller files: the page cache is as fast and has no alignment to pay for


def file_checksum(path: str, algorithm: str = CHECKSUM) -> str:
    """The checksum of a file's bytes, read through mmap (page cache pages, no copies)."""
    h = ALGORITHMS[algorithm]()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                h.update(m)
    return h.hexdigest()


def fsync_file(fd: int) -> None:
    """Data on stable storage. macOS's fsync stops at the drive's cache: F_FULLFSYNC goes through it."""
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def fsync_dir(path: str) -> None:
    """Make renames and new names in `path` durable (POSIX; Windows has no directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


class ChecksumFile:
    """A binary file opened for writing whose bytes are checksummed on the way through; close()
    fsyncs and returns the manifest entry {"size", CHECKSUM}. torch.save writes into it like any file.

    Large files are written with O_DIRECT where the filesystem allows it, through a small aligned
    buffer that stays in the CPU cache: the bytes go to the disk without a copy in the page cache,
    which halves the memory traffic a background save puts beside training and leaves the training
    process's cached files alone. Elsewhere (tmpfs, macOS, Windows, a filesystem that refuses the
    first direct write) the page cache is used."""

    def __init__(self, path: str, direct: bool = False):
        self._path, self._h, self.size = path, ALGORITHMS[CHECKSUM](), 0
        self._fd = _open_direct(path) if direct else None
        self._f = None if self._fd is not None else open(path, "wb", buffering=0)
        self._bounce = mmap.mmap(-1, _HASH_CHUNK) if self._fd is not None else None  # mmap: page aligned
        self._fill = self._written = self._flushed = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        nbytes = len(view)
        self.size += nbytes
        if self._fd is None:
            for start in range(0, nbytes, _HASH_CHUNK):
                self._write_cached(view[start:start + _HASH_CHUNK])
            return nbytes
        while view:
            n = min(len(view), _HASH_CHUNK - self._fill)
            self._bounce[self._fill:self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == _HASH_CHUNK:
                self._flush_bounce()
        return nbytes

    def _write_cached(self, part: memoryview) -> None:
        self._h.update(part)
        while part:  # raw file: write may take less than asked
            part = part[self._f.write(part):]
        end = self._f.tell()
        if end - self._flushed >= _WRITEBACK_EVERY:
            _start_writeback(self._f.fileno(), self._flushed, end - self._flushed)
            self._flushed = end

    def _flush_bounce(self) -> None:
        part, self._fill = memoryview(self._bounce)[:self._fill], 0
        if self._fd is None:  # fell back to the page cache
            return self._write_cached(part)
        padded = -(-len(part) // _DIRECT_ALIGN) * _DIRECT_ALIGN  # O_DIRECT writes whole blocks
        try:
            done = 0
            while done < padded:
                done += os.write(self._fd, memoryview(self._bounce)[done:padded])
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            os.close(self._fd)  # the filesystem took the open but not the write: go through the page cache
            self._fd, self._f = None, open(self._path, "r+b", buffering=0)
            self._f.seek(self._written)
            return self._write_cached(part)
        self._h.update(part)
        self._written += len(part)

    def flush(self) -> None:
        pass  # unbuffered

    def close(self) -> dict:
        try:
            if self._fill:
                self._flush_bounce()
            if self._fd is not None:
                os.ftruncate(self._fd, self.size)  # drop the last block's padding
                fsync_file(self._fd)
            else:
                fsync_file(self._f.fileno())
        finally:
            if self._fd is not None:
                os.close(self._fd)
            if self._f is not None:
                self._f.close()
            if self._bounce is not None:
                self._bounce.close()
        return {"size": self.size, CHECKSUM: self._h.hexdigest()}


def _open_direct(path: str) -> int | None:
    """An O_DIRECT file descriptor for a new file, or None where the platform or filesystem refuses."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:  # EINVAL: the filesystem has no direct I/O (tmpfs, some overlays)
        return None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing this range to disk now (dirty pages stay cached), so the
    fsync at the end waits for little: disk I/O overlaps the writing that follows."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def write_bytes(path: str, chunks, direct: bool = False) -> dict:
    f = ChecksumFile(path, direct)
    try:
        for chunk in chunks:
            f.write(chunk)
    finally:
        entry = f.close()
    return entry


def save_pickle(obj: Any, path: str, direct: bool = True) -> dict:
    f = ChecksumFile(path, direct)
    try:
        torch.save(obj, f)
    finally:
        entry = f.close()
    return entry


def write_json(obj: Any, path: str) -> dict:
    text = obj if isinstance(obj, str) else json.dumps(obj, indent=2, sort_keys=True) + "\n"
    return write_bytes(path, [text.encode("utf-8")])


# ---------------------------------------------------------------- safetensors, streamed from tensor memory

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
              torch.float8_e5m2: "F8_E5M2"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> dict:
    """The safetensors format (8-byte header length, JSON header, raw little-endian data, largest
    dtypes first so every tensor is aligned, as safetensors orders them) written straight from the
    tensors' memory: save_file would first copy every tensor into a Python bytes object. Anything
    unusual (a dtype outside the common set, a big-endian host) goes through save_file instead."""
    if sys.byteorder != "little" or any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        save_file(tensors, path, metadata=metadata)
        with open(path, "rb") as f:
            fsync_file(f.fileno())
        return {"size": os.path.getsize(path), CHECKSUM: file_checksum(path)}
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    flat = (tensors[n].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for n in names)
    return write_bytes(path, [struct.pack("<Q", len(head)) + head, *flat], direct=offset >= _DIRECT_MIN)


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class ChecksumMismatch(ValueError):
    """The bytes read differ from the manifest's checksum."""


def read_safetensors(path: str, expected: tuple[str, str] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a safetensors file as safetensors' own loader does (a private mapping of the file; the
    tensors are views of it, read when used), checksumming it first when `expected` = (algorithm,
    hex digest) from the manifest: a wrong byte is refused before any tensor is handed out.
    Returns (tensors, header metadata); raises ChecksumMismatch, or ValueError for a malformed file."""
    size = os.path.getsize(path)
    buf = torch.empty(0, dtype=torch.uint8)
    if size:
        buf.set_(torch.UntypedStorage.from_file(path, shared=False, nbytes=size))
    view = memoryview(buf.numpy()).cast("B")
    if expected is not None:
        h = ALGORITHMS[expected[0]]()
        h.update(view)
        if h.hexdigest() != expected[1]:
            raise ChecksumMismatch(f"{expected[0]} checksum mismatch with the manifest (corrupted)")
    if size < 8:
        raise ValueError("shorter than a safetensors header")
    (head_len,) = struct.unpack("<Q", bytes(view[:8]))
    if head_len > size - 8:
        raise ValueError(f"header length {head_len} exceeds the file")
    header = json.loads(bytes(view[8:8 + head_len]))
    start = 8 + head_len
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, info in header.items():
        dtype = _ST_NAMES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name}: dtype {info['dtype']} is not supported")
        lo, hi = info["data_offsets"]
        if not 0 <= lo <= hi <= size - start:
            raise ValueError(f"tensor {name}: data offsets {lo}..{hi} outside the file")
        raw = buf[start + lo:start + hi]
        if (start + lo) % dtype.itemsize:  # unaligned (written by another tool): a copy is aligned
            raw = raw.clone()
        out[name] = raw.view(dtype).reshape(info["shape"])
    return out, meta


# ---------------------------------------------------------------- the host copy of an asynchronous save


class HostStaging:
    """Copies a state (nested dicts/lists/tuples of tensors) into host buffers that are kept and
    reused by the next save, so the copy at the step boundary is a plain memcpy (fresh memory costs a
    page fault per 4 KiB, about 4x the copy itself here). From CUDA the buffers are pinned and the copies
    asynchronous; `ready()` waits for them (the writer thread calls it, not the step).

    Sharing is kept: tensors that shared storage share it (tied weights, views), and an object met
    twice is copied once (pickle memoizes by identity: optimizer param_groups share one `betas`
    tuple), so what is written from the copy is byte-identical to the originals. A buffer is reused
    only after the save that wrote from it finished (the writer waits or skips before copying)."""

    def __init__(self):
        self._buffers: list[torch.UntypedStorage] = []
        self._next, self._from_cuda, self._event = 0, False, None

    def copy(self, obj: Any) -> Any:
        self._next, self._from_cuda = 0, False
        out = self._copy(obj, {})
        if self._from_cuda:  # the step goes on at once; the copies finish on the stream
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    def ready(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def _buffer(self, src: torch.UntypedStorage) -> torch.UntypedStorage:
        i, self._next = self._next, self._next + 1
        pin = src.device.type == "cuda"
        self._from_cuda |= pin
        if i < len(self._buffers) and self._buffers[i].nbytes() == src.nbytes() and self._buffers[i].is_pinned() == pin:
            buf = self._buffers[i]
        else:
            buf = torch.empty(src.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
            self._buffers[i:i + 1] = [buf]
        buf.copy_(src, non_blocking=pin)
        return buf

    def _copy(self, obj: Any, memo: dict) -> Any:
        if id(obj) in memo:
            return memo[id(obj)][1]
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                copy = t.to("cpu", copy=True)
            else:
                key = ("storage", t.device, storage.data_ptr())
                if key not in memo:
                    memo[key] = (None, self._buffer(storage))
                copy = torch.empty(0, dtype=t.dtype).set_(memo[key][1], t.storage_offset(), t.size(), t.stride())
        elif isinstance(obj, dict):
            copy = type(obj)((k, self._copy(v, memo)) for k, v in obj.items())
        elif isinstance(obj, list):
            copy = [self._copy(v, memo) for v in obj]
        elif isinstance(obj, tuple):
            items = [self._copy(v, memo) for v in obj]
            if all(a is b for a, b in zip(items, obj)):
                copy = obj  # immutable and holds no tensor: the object itself
            else:
                copy = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        else:
            return obj
        memo[id(obj)] = (obj, copy)  # keeps obj alive so that its id is not reused
        return copy


def lower_thread_priority(nice: int = 10) -> None:
    """Run the calling thread (a background writer) at a lower CPU priority than training, where the
    platform allows it (Linux: nice is per thread)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError):
            pass


# ---------------------------------------------------------------- several ranks, one or several disks


def disk_leaders(directory: str, rank: int, all_gather: Callable[[Any], list]) -> list[int]:
    """For each rank, the lowest rank that sees the same `directory` (a collective): all 0 on a disk
    every rank shares, each node's first rank on node-local disks. Each rank writes a token file
    named after itself and looks for the others' (a shared disk is detected, never assumed)."""
    tokens = all_gather(os.urandom(8).hex())
    token, world = tokens[0], len(tokens)  # rank 0's token: a leftover from an earlier run never matches
    os.makedirs(directory, exist_ok=True)
    mine = os.path.join(directory, f".raytrain-disk-{rank}")
    write_bytes(mine, [token.encode()])
    all_gather(None)  # every rank's token file is written

    def sees(r: int) -> bool:
        try:
            with open(os.path.join(directory, f".raytrain-disk-{r}")) as f:
                return f.read() == token
        except OSError:
            return False

    seen = all_gather([r for r in range(world) if r == rank or sees(r)])
    os.remove(mine)
    return [min(s) for s in seen]


def describe_files(directory: str, entries: dict[str, dict]) -> dict[str, dict]:
    """{relative path: manifest entry} of every file under `directory`; files missing from `entries`
    (written by a backend) or of another size are fsynced and checksummed here."""
    files = {}
    for root, _, names in os.walk(directory):
        if root != directory:  # a backend's folder (dcp/): its entries durable too (rename_into_place syncs the top)
            fsync_dir(root)
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory)
            entry = entries.get(rel)
            if entry is None or entry["size"] != os.path.getsize(path):
                with open(path, "rb") as f:
                    fsync_file(f.fileno())
                entry = {"size": os.path.getsize(path), CHECKSUM: file_checksum(path)}
            files[rel] = entry
    return files


def rename_into_place(tmp: str, final: str) -> None:
    """Rename a complete temporary directory to `final`. A step saved again (a re-run over an old
    output_dir) moves the old one aside first: a crash between the renames leaves a complete copy."""
    fsync_dir(tmp)
    if os.path.exists(final):
        old = final + ".replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))


# Test hook: "FLAGFILE" or "FLAGFILE@STEP". CheckpointWriter creates FLAGFILE and blocks forever once every
# file of the checkpoint (of step STEP, or of any step) is in the temporary directory but before the
# manifest is written, so that a test can kill the process mid-save.
PAUSE_ENV = "RAYTRAIN_TEST_PAUSE_IN_SAVE"


def maybe_pause(tmp: str, step: int) -> None:
    value = os.environ.get(PAUSE_ENV)
    if not value:
        return
    flag, sep, at = value.rpartition("@")
    if not (sep and at.isdigit()):
        flag, at = value, ""
    if at and int(at) != step:
        return
    with open(flag, "w") as f:
        f.write(tmp)
    threading.Event().wait()  # the test kills the process here
