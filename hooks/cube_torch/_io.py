"""ctypes binding of libcubetorch_io (loader/cubetorch_io.h): the model loader's C ABI.

The library is found through CUBE_TORCH_LIB, then next to this package, then build/lib/ of
the source tree. Loaded on first use, never at `import cube_torch`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path
from typing import Optional

ABI_VERSION = 2
LIB_NAME = "libcubetorch_io.so"
NO_DAEMON = 1
DIRECT_IO = 2
REQUIRE_INTEGRITY = 4
_ERR_LEN = 4096

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


class LoadError(ValueError):
    """A model file that breaks a safetensors rule, fails its integrity check, or cannot be
    decrypted with the key given. The message names the file and the problem."""


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_uint64)),
        ("ndim", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("len", ctypes.c_uint64),
    ]


def _candidates():
    env = os.environ.get("CUBE_TORCH_LIB")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    yield here / LIB_NAME
    yield here.parents[1] / "build" / "lib" / LIB_NAME


def lib() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            tried.append(str(path))
            if path.is_file():
                handle = ctypes.CDLL(str(path))
                break
        else:
            raise OSError(errno.ENOENT, f"{LIB_NAME} not found (tried {', '.join(tried)}); "
                          "build the project (scripts/build.sh) or set CUBE_TORCH_LIB")
        handle.ctio_abi_version.restype = ctypes.c_int
        if handle.ctio_abi_version() != ABI_VERSION:
            raise OSError(errno.EINVAL, f"{path}: ABI version {handle.ctio_abi_version()}, "
                          f"this package needs {ABI_VERSION}; rebuild the project")
        c = ctypes
        handle.ctio_cuda_built.restype = c.c_int
        handle.ctio_open.argtypes = [c.c_char_p, c.c_int, c.c_int, c.POINTER(c.c_void_p),
                                     c.c_char_p, c.c_size_t]
        handle.ctio_info_json.restype = c.c_char_p
        handle.ctio_info_json.argtypes = [c.c_void_p]
        handle.ctio_data_size.restype = c.c_uint64
        handle.ctio_data_size.argtypes = [c.c_void_p]
        handle.ctio_default_threads.restype = c.c_int
        handle.ctio_mappable_fd.argtypes = [c.c_void_p, c.POINTER(c.c_uint64)]
        handle.ctio_mappable_fd.restype = c.c_int
        handle.ctio_read.argtypes = [c.c_void_p, c.c_void_p, c.c_uint64, c.c_int, c.c_char_p,
                                     c.c_size_t]
        handle.ctio_read_cuda.argtypes = [c.c_void_p, c.c_void_p, c.c_uint64, c.c_int, c.c_int,
                                          c.c_void_p, c.c_int, c.c_char_p, c.c_size_t]
        handle.ctio_close.argtypes = [c.c_void_p]
        handle.ctio_close.restype = None
        handle.ctio_helper_new.argtypes = [c.c_uint64, c.c_int, c.POINTER(c.c_void_p),
                                           c.c_char_p, c.c_size_t]
        handle.ctio_helper_free.argtypes = [c.c_void_p]
        handle.ctio_helper_free.restype = None
        handle.ctio_save.argtypes = [c.c_char_p, c.POINTER(_Tensor), c.c_int, c.c_char_p,
                                     c.c_int, c.c_int, c.c_char_p, c.c_size_t]
        _lib = handle
        return handle


def check(rc: int, err: ctypes.Array) -> None:
    """Raises the Python exception for a negative return code."""
    if rc == 0:
        return
    msg = err.value.decode("utf-8", "replace")
    code = -rc
    if code == errno.ENOENT:
        raise FileNotFoundError(errno.ENOENT, msg)
    if code in (errno.EINVAL, errno.EBADMSG):
        raise LoadError(msg)
    if code == errno.ENOTSUP:
        raise RuntimeError(msg)
    raise OSError(code, msg)


def errbuf() -> ctypes.Array:
    return ctypes.create_string_buffer(_ERR_LEN)


class File:
    """An open model file (ctio_file); close() or use as a context manager."""

    def __init__(self, path: str, cipher: int, flags: int):
        self._lib = lib()
        self._h = ctypes.c_void_p()
        err = errbuf()
        check(self._lib.ctio_open(os.fsencode(path), cipher, flags, ctypes.byref(self._h), err,
                                  len(err)), err)

    def info_json(self) -> str:
        return self._lib.ctio_info_json(self._h).decode("utf-8")

    def mappable(self):
        """(descriptor, file offset of data byte 0) when the data may be mapped instead of
        read (a plain file without an integrity tag, not O_DIRECT), else None. The descriptor
        belongs to this File."""
        off = ctypes.c_uint64(0)
        fd = self._lib.ctio_mappable_fd(self._h, ctypes.byref(off))
        return (fd, off.value) if fd >= 0 else None

    def read(self, ptr: int, length: int, threads: int) -> None:
        err = errbuf()
        check(self._lib.ctio_read(self._h, ctypes.c_void_p(ptr), length, threads, err, len(err)),
              err)

    def read_cuda(self, ptr: int, length: int, device: int, threads: int, helper,
                  gpu_decrypt: bool) -> None:
        err = errbuf()
        check(self._lib.ctio_read_cuda(self._h, ctypes.c_void_p(ptr), length, device, threads,
                                       helper, 1 if gpu_decrypt else 0, err, len(err)), err)

    def close(self) -> None:
        if self._h:
            self._lib.ctio_close(self._h)
            self._h = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
