"""Model loading and saving over libcubetorch_io: load_file, load, save_file, init_io_helper.

The library reads the safetensors data section with many threads into one buffer that
Python allocated (page-aligned memory, or pinned memory when asked), decrypting
veTurboIO-encrypted files on the fly; tensors are views into that buffer. A plain file loaded
to the CPU (no cipher, no integrity tag) is instead mapped copy-on-write and its pages made
present by many threads at once (MADV_POPULATE_READ), so nothing is copied: the tensors share
the page cache. Under a
cubetorchfs mount the library asks the daemon for a descriptor of the file made resident in
memory, so the bytes do not pass through FUSE (docs/fd_exchange.md).
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import threading
from typing import Any, Dict, Iterable, Optional, Union

import torch

from . import _io
from ._io import LoadError

# safetensors dtype name -> torch dtype attribute; absent in an older torch: a clear error.
_DTYPE_ATTR = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def _torch_dtype(name: str, tensor: str, path: str) -> torch.dtype:
    attr = _DTYPE_ATTR.get(name)
    dtype = getattr(torch, attr, None) if attr else None
    if not isinstance(dtype, torch.dtype):
        raise LoadError(f"{path}: tensor '{tensor}' has dtype {name}, which torch "
                        f"{torch.__version__} does not have")
    return dtype


def _dtype_name(dtype: torch.dtype, key: str) -> str:
    for name, attr in _DTYPE_ATTR.items():
        if getattr(torch, attr, None) == dtype:
            return name
    raise TypeError(f"tensor '{key}': dtype {dtype} has no safetensors equivalent")


def _threads(num_threads: Optional[int]) -> int:
    if num_threads is None:
        return 0
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    return int(num_threads)


_MADV_POPULATE_READ = 22  # Linux 5.14
_POPULATE_CHUNK = 64 << 20
_libc = None
# Thread pools for populating, by thread count, kept: starting threads costs more than a hot
# populate. A forked child (a DataLoader worker) has none of its parent's threads, so the
# pools belong to the process that made them.
_pools: Dict[int, Any] = {}
_pools_lock = threading.Lock()


def _forget_pools() -> None:
    global _pools, _pools_lock
    _pools, _pools_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _populate_pool(threads: int):
    from concurrent.futures import ThreadPoolExecutor
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="cube_torch-map")
        return _pools[threads]


def _io_threads(num_threads: Optional[int]) -> int:
    """num_threads, or the count the library uses when given 0."""
    return num_threads or _io.lib().ctio_default_threads()


def _mapped(f: "_io.File", n: int, threads: int, path: str) -> Optional[torch.Tensor]:
    """The data section mapped copy-on-write with every page present, or None when the file
    must be read instead. Writes to the tensors stay in this process."""
    where = f.mappable()
    if where is None or n == 0:
        return None
    fd, off = where
    if off % 8:  # a header not padded to 8 bytes: tensors would be misaligned; read instead
        return None
    start = off - off % mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fd, off - start + n, access=mmap.ACCESS_COPY, offset=start)
    except (OSError, ValueError):
        return None  # a descriptor that cannot be mapped: read it
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    flat = torch.frombuffer(m, dtype=torch.uint8, offset=off - start, count=n)
    base = flat.data_ptr() - (off - start)  # page-aligned start of the mapping
    length = off - start + n
    failed = []

    def populate(first: int) -> None:
        # ctypes lets go of the GIL around madvise: the threads fault pages in at once.
        if _libc.madvise(base + first, min(_POPULATE_CHUNK, length - first), _MADV_POPULATE_READ):
            failed.append(ctypes.get_errno())

    chunks = range(0, length, _POPULATE_CHUNK)
    threads = min(threads, len(chunks))  # no more threads than pieces
    if threads > 1:
        list(_populate_pool(threads).map(populate, chunks))
    else:
        for c in chunks:
            populate(c)
    if failed and failed[0] not in (errno.EINVAL, errno.ENOSYS):  # older kernel: pages come lazily
        raise OSError(failed[0], f"{path}: mapping the data section: {os.strerror(failed[0])} "
                      "(was the file truncated while loading?)")
    return flat


def _cipher_arg(use_cipher: Optional[bool]) -> int:
    if use_cipher is None:
        return -1
    return 1 if use_cipher else 0


class IOHelper:
    """Reusable pinned staging buffers for loads to CUDA (init_io_helper()). Allocated on the
    first CUDA load, freed with the helper; CPU loads do not need them."""

    def __init__(self, slot_bytes: int = 16 << 20, slots: int = 0):
        self.slot_bytes = int(slot_bytes)
        self.slots = int(slots)
        self._h = ctypes.c_void_p()
        # One load at a time uses the slots: two loads sharing them would overwrite each
        # other's bytes between read and copy.
        self.lock = threading.Lock()

    def _handle(self) -> ctypes.c_void_p:
        """The staging slots, allocated on first use. REQUIRES: self.lock held."""
        if not self._h:
            lib = _io.lib()
            err = _io.errbuf()
            _io.check(lib.ctio_helper_new(self.slot_bytes, self.slots, ctypes.byref(self._h), err,
                                          len(err)), err)
        return self._h

    def __del__(self):
        if getattr(self, "_h", None):
            try:
                _io.lib().ctio_helper_free(self._h)
            except Exception:
                pass
            self._h = ctypes.c_void_p()


def init_io_helper(slot_bytes: int = 16 << 20, slots: int = 0) -> IOHelper:
    """Pinned staging buffers to reuse across load_file(..., device="cuda", helper=h) calls.
    slots 0: one more than the cores, 4 to 17 (at most slots - 1 threads read at once)."""
    return IOHelper(slot_bytes, slots)


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # Private anonymous memory, page-aligned, that lives as long as the tensors viewing it.
    # Transparent huge pages: the kernel then maps (and zeroes) 2 MiB at a time instead of
    # taking one page fault per 4 KiB, which on a hot page cache is most of a load's cost
    # (bench/load_bench.py: about 3 GB/s with small pages, 12-16 GB/s with huge ones).
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled in this kernel: small pages
    return torch.frombuffer(m, dtype=torch.uint8)


def _cuda_index(dev: torch.device, path: str) -> int:
    """The CUDA device index to load onto, or a clear error naming the file and the device."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{path}: device {dev} requested but torch has no CUDA")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"{path}: device {dev} requested but this machine has {count} CUDA "
                         f"device{'' if count == 1 else 's'} (cuda:0 to cuda:{count - 1})")
    return index


def _device_buffer(n: int, index: int, path: str) -> torch.Tensor:
    """n bytes on CUDA device `index`; out of memory names the file and what it needed."""
    try:
        return torch.empty(n, dtype=torch.uint8, device=torch.device("cuda", index))
    except torch.cuda.OutOfMemoryError as e:
        raise torch.cuda.OutOfMemoryError(
            f"{path}: not enough memory on cuda:{index} for the model's {n} bytes: {e}") from e


def _views(flat: torch.Tensor, tensors: Iterable[Dict[str, Any]], path: str) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    sizes: Dict[torch.dtype, int] = {}
    for t in tensors:
        dtype = _torch_dtype(t["dtype"], t["name"], path)
        begin, end = int(t["begin"]), int(t["end"])
        piece = flat[begin:end]
        elem = sizes.get(dtype)
        if elem is None:
            elem = sizes[dtype] = torch.empty((), dtype=dtype).element_size()
        if begin % elem != 0:
            piece = piece.clone()  # not aligned for a view of this dtype: its own copy
        out[t["name"]] = piece.view(dtype).reshape(t["shape"])
    return out


def load_file(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu",
              use_pinmem: bool = False, use_cipher: Optional[bool] = None,
              num_threads: Optional[int] = None, helper: Optional[IOHelper] = None,
              direct_io: bool = False,
              require_integrity: Optional[bool] = None,
              map_file: bool = True) -> Dict[str, torch.Tensor]:
    """Loads a safetensors file into a dict of tensors on `device`.

    map_file: a plain file without an integrity tag loaded to the CPU (not pinned) is mapped
    copy-on-write instead of copied, every page made present before this returns. The tensors
    then share the page cache: no copy, no second 4 GiB for a 4 GiB file. As with any mapped
    file (safetensors does the same), a file changed in place afterwards shows through pages
    not yet written, and one truncated afterwards raises SIGBUS on access; files written by
    save_file are replaced, never changed in place. map_file=False always reads into private
    memory.
    use_cipher: None detects the veTurboIO header; True also reads headerless encrypted
    files (key and IV from DATAPIPE_SOCKET_PATH or VETURBOIO_KEY/VETURBOIO_IV); False refuses
    encrypted files. use_pinmem: CPU tensors in pinned memory (when CUDA is available).
    require_integrity: refuse files without our integrity tag (default: the environment
    CUBE_TORCH_REQUIRE_INTEGRITY=1). The tag lives in the unauthenticated outer header, so
    without this an attacker may strip it and tamper with an encrypted file undetected, as
    with any veTurboIO file.
    Raises FileNotFoundError, LoadError (bad file, failed integrity check, wrong key) or OSError.
    """
    path = os.fspath(path)
    dev = torch.device(device)
    flags = _io.DIRECT_IO if direct_io else 0
    if os.environ.get("CUBE_TORCH_NO_DAEMON_FD", "") not in ("", "0"):
        flags |= _io.NO_DAEMON
    if require_integrity is None:
        require_integrity = os.environ.get("CUBE_TORCH_REQUIRE_INTEGRITY", "") not in ("", "0")
    if require_integrity:
        flags |= _io.REQUIRE_INTEGRITY
    with _io.File(path, _cipher_arg(use_cipher), flags) as f:
        info = json.loads(f.info_json())
        for t in info["tensors"]:  # fail before reading anything
            _torch_dtype(t["dtype"], t["name"], path)
        n = int(info["data_size"])
        threads = _threads(num_threads)
        if dev.type == "cuda":
            index = _cuda_index(dev, path)
            if _io.lib().ctio_cuda_built() and n > 0:
                flat = _device_buffer(n, index, path)
                # The library copies on its own stream: let whatever torch queued on this
                # memory (a freed block may still be in use by queued kernels) finish first.
                torch.cuda.current_stream(index).synchronize()
                staging = helper if helper is not None else _default_helper()
                with staging.lock:
                    f.read_cuda(flat.data_ptr(), n, index, threads, staging._handle(), True)
            else:  # a library without CUDA: read into pinned memory, copy with torch
                host = _host_buffer(n, pinned=True)
                if n:
                    f.read(host.data_ptr(), n, threads)
                flat = _device_buffer(n, index, path)
                flat.copy_(host)
        elif dev.type == "cpu":
            pinned = bool(use_pinmem) and torch.cuda.is_available()
            flat = None
            # Not through our own FUSE mount (no descriptor from the daemon): a page evicted
            # later would be read again through the daemon, which may have been restarted.
            if map_file and not pinned and info.get("source") != "mount":
                flat = _mapped(f, n, _io_threads(num_threads), path)
            if flat is None:
                flat = _host_buffer(n, pinned)
                if n:
                    f.read(flat.data_ptr(), n, threads)
        else:
            flat = _host_buffer(n, False)
            if n:
                f.read(flat.data_ptr(), n, threads)
            flat = flat.to(dev)
        return _views(flat, info["tensors"], path)


_default = None
_default_lock = threading.Lock()


def _default_helper() -> IOHelper:
    global _default
    with _default_lock:
        if _default is None:
            _default = IOHelper()
        return _default


def read_info(path: Union[str, os.PathLike], use_cipher: Optional[bool] = None) -> Dict[str, Any]:
    """The validated header of a model file: tensors (name, dtype, shape, offsets), metadata,
    data_size, encrypted, integrity_tag (the file carries our tag; it is checked only when the
    data is loaded), source. Reads no tensor data."""
    flags = _io.NO_DAEMON
    with _io.File(os.fspath(path), _cipher_arg(use_cipher), flags) as f:
        return json.loads(f.info_json())


def _is_safetensors(path: str) -> bool:
    if path.endswith(".safetensors"):
        return True
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return False
    return head == b"Byte3ncryptM0del"


def load(file: Union[str, os.PathLike], map_location: Union[str, torch.device] = "cpu",
         use_pinmem: bool = False, use_cipher: Optional[bool] = None,
         helper: Optional[IOHelper] = None) -> Any:
    """veTurboIO-style entry point: a safetensors (or encrypted) file through load_file, any
    other file through torch.load(file, map_location=map_location)."""
    path = os.fspath(file)
    if _is_safetensors(path) or use_cipher:
        return load_file(path, device=map_location, use_pinmem=use_pinmem, use_cipher=use_cipher,
                         helper=helper)
    return torch.load(path, map_location=map_location)


def save_file(tensors: Dict[str, torch.Tensor], path: Union[str, os.PathLike],
              metadata: Optional[Dict[str, str]] = None, use_cipher: bool = False,
              num_threads: Optional[int] = None) -> None:
    """Writes `tensors` as a safetensors file, atomically (temporary file, fsync, rename).

    use_cipher=True writes the veTurboIO header format (fresh random IV, key from
    DATAPIPE_SOCKET_PATH or VETURBOIO_KEY) plus an integrity tag that load_file verifies.
    Tensors sharing storage are written as separate copies."""
    path = os.fspath(path)
    if not isinstance(tensors, dict):
        raise TypeError(f"save_file: tensors must be a dict of str -> torch.Tensor, got "
                        f"{type(tensors).__name__}")
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("save_file: metadata must be a dict of str -> str")
    prepared = []
    for key, t in tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"save_file: key {key!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_file: '{key}' is of type {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise TypeError(f"save_file: '{key}' has layout {t.layout}; only dense tensors are saved")
        name = _dtype_name(t.dtype, key)
        data = t.detach().to("cpu")
        # Lazy conjugate/negative views share storage with the original: materialize them.
        if hasattr(data, "resolve_conj"):
            data = data.resolve_conj().resolve_neg()
        data = data.contiguous()
        prepared.append((key, name, data))
    # Larger elements first, then by name: keeps every tensor aligned for a zero-copy view.
    prepared.sort(key=lambda p: (-p[2].element_size(), p[0]))
    keep = []
    arr = (_io._Tensor * max(1, len(prepared)))()
    for i, (key, name, data) in enumerate(prepared):
        shape = (ctypes.c_uint64 * max(1, data.dim()))(*data.shape)
        nbytes = data.numel() * data.element_size()
        keep.append((shape, data))
        arr[i] = _io._Tensor(key.encode("utf-8"), name.encode(), shape, data.dim(),
                             ctypes.c_void_p(data.data_ptr() if nbytes else 0), nbytes)
    lib = _io.lib()
    err = _io.errbuf()
    meta = json.dumps(metadata).encode("utf-8") if metadata else None
    try:
        _io.check(lib.ctio_save(os.fsencode(path), arr, len(prepared), meta,
                                1 if use_cipher else 0, _threads(num_threads), err, len(err)), err)
    except LoadError as e:  # bad input to a save (e.g. no key source): a plain ValueError
        raise ValueError(str(e)) from None
    del keep
