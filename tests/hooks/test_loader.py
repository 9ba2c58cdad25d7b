"""cube_torch.load_file / load / save_file / convert over libcubetorch_io: round trips, files
made by independent writers (hand-written safetensors, `openssl enc` ciphertext), every
safetensors rule, tampering, key sources, and CUDA loads (skipped without a GPU)."""

from __future__ import annotations

import base64
import http.server
import json
import os
import shutil
import socketserver
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

import numpy as np
import pytest
import torch

import cube_torch
from cube_torch import LoadError, _loader

_HOOKS = str(Path(__file__).resolve().parents[2] / "hooks")
_KEY_ENV = ("VETURBOIO_KEY", "VETURBOIO_IV", "DATAPIPE_SOCKET_PATH", "CUBE_TORCH_IO_THREADS")
ENC_MAGIC = b"Byte3ncryptM0del"
ENC_HEADER = 262144
SUBPROCESS_S = 120

try:
    from cube_torch import _io
    _io.lib()
    _LIB_ERROR = None
except OSError as e:  # not built: every test here needs the library
    _LIB_ERROR = str(e)

pytestmark = pytest.mark.skipif(_LIB_ERROR is not None, reason=f"libcubetorch_io: {_LIB_ERROR}")
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl CLI")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(autouse=True)
def no_key_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _KEY_ENV:
        monkeypatch.delenv(var, raising=False)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def set_key(monkeypatch: pytest.MonkeyPatch, key: bytes, iv: Optional[bytes] = None) -> None:
    monkeypatch.setenv("VETURBOIO_KEY", b64(key))
    if iv is not None:
        monkeypatch.setenv("VETURBOIO_IV", b64(iv))


def assert_same(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype, k
        assert g.shape == w.shape, k
        assert torch.equal(g.cpu(), w.cpu()), k


def random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -(2 ** 40)), min(info.max, 2 ** 40)
        return torch.randint(lo, hi, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64 if not dtype.is_complex
                       else torch.complex128).to(dtype)


def random_dict(n: int, gen: torch.Generator, max_elems: int = 64) -> Dict[str, torch.Tensor]:
    dtypes = ALL_DTYPES
    out = {}
    for i in range(n):
        dtype = dtypes[i % len(dtypes)]
        size = int(torch.randint(0, max_elems, (1,), generator=gen))
        out[f"layer.{i}.w"] = random_tensor(dtype, (size,), gen)
    return out


# Every dtype torch 1.13 has that safetensors stores.
ALL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


# ---- an independent writer: the format by hand ------------------------------------------------

def raw_file(path: Path, header: Union[dict, str, bytes], data: bytes = b"",
             length: Optional[int] = None) -> Path:
    """8-byte little-endian length, the header bytes, the data: nothing of cube_torch."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    n = len(header) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + header + data)
    return path


_NP = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32,
       "I64": np.int64, "F16": np.float16, "F32": np.float32, "F64": np.float64,
       "C64": np.complex64}


def hand_written(path: Path, arrays: Dict[str, np.ndarray], metadata=None,
                 order: Optional[List[str]] = None) -> Path:
    """A safetensors file written with numpy only (the reference layout: header padded with
    spaces to a multiple of 8, offsets in `order`)."""
    names = {v: k for k, v in _NP.items()}
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    blobs, offset = [], 0
    for name in order or list(arrays):
        a = np.asarray(arrays[name], order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": names[a.dtype.type], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return raw_file(path, text, b"".join(blobs))


# ---- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_round_trip_every_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    want = {"x": random_tensor(dtype, (7, 5), gen), "scalar": random_tensor(dtype, (), gen),
            "empty": random_tensor(dtype, (0,), gen), "empty2d": random_tensor(dtype, (3, 0), gen)}
    path = tmp_path / "m.safetensors"
    cube_torch.save_file(want, path)
    assert_same(cube_torch.load_file(path), want)
    assert_same(cube_torch.load_file(path, num_threads=1), want)


def test_only_empty_tensors(tmp_path: Path) -> None:
    want = {"a": torch.empty(0), "b": torch.empty(2, 0, 3, dtype=torch.int64)}
    cube_torch.save_file(want, tmp_path / "e.safetensors")
    assert cube_torch.read_info(tmp_path / "e.safetensors")["data_size"] == 0
    assert_same(cube_torch.load_file(tmp_path / "e.safetensors"), want)


def test_metadata_round_trip(tmp_path: Path) -> None:
    meta = {"format": "pt", "note": "ünïcode ✓", "empty": ""}
    want = {"w": torch.arange(6.0).reshape(2, 3)}
    cube_torch.save_file(want, tmp_path / "m.safetensors", metadata=meta)
    info = cube_torch.read_info(tmp_path / "m.safetensors")
    assert info["metadata"] == meta
    assert info["encrypted"] is False
    assert [(t["name"], t["dtype"], t["shape"]) for t in info["tensors"]] == [("w", "F32", [2, 3])]
    assert_same(cube_torch.load_file(tmp_path / "m.safetensors"), want)
    with pytest.raises(TypeError, match="metadata"):
        cube_torch.save_file(want, tmp_path / "bad.safetensors", metadata={"n": 1})
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("n", [1, 500])
def test_many_tensors(tmp_path: Path, n: int) -> None:
    want = random_dict(n, torch.Generator().manual_seed(n))
    cube_torch.save_file(want, tmp_path / "m.safetensors")
    got = cube_torch.load_file(tmp_path / "m.safetensors")
    assert_same(got, want)
    assert len(cube_torch.read_info(tmp_path / "m.safetensors")["tensors"]) == n


def test_save_rejects_non_tensors(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="'epoch' is of type int, not a torch.Tensor"):
        cube_torch.save_file({"w": torch.ones(1), "epoch": 3}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_non_contiguous_and_shared_storage_saved_as_copies(tmp_path: Path) -> None:
    base = torch.arange(24.0)
    want = {"base": base, "view": base[3:9], "t": base.view(4, 6).t(), "step": base[::5]}
    cube_torch.save_file(want, tmp_path / "m.safetensors")
    got = cube_torch.load_file(tmp_path / "m.safetensors")
    assert_same(got, want)
    assert cube_torch.read_info(tmp_path / "m.safetensors")["data_size"] == (24 + 6 + 24 + 5) * 4


# ---- files from an independent writer ---------------------------------------------------------

def test_hand_written_file_loads(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    arrays = {
        "f32": rng.standard_normal((4, 3)).astype(np.float32),
        "i64": rng.integers(-10**12, 10**12, size=(5,)),
        "f16": rng.standard_normal((2, 2, 2)).astype(np.float16),
        "u8": rng.integers(0, 256, size=(9,), dtype=np.uint8),
        "c64": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64),
        "scalar": np.array(2.5, dtype=np.float64),
    }
    path = hand_written(tmp_path / "h.safetensors", arrays, metadata={"by": "hand"},
                        order=["u8", "f32", "scalar", "i64", "c64", "f16"])  # odd offsets
    got = cube_torch.load_file(path)
    assert_same(got, {k: torch.from_numpy(v.copy()) for k, v in arrays.items()})
    assert cube_torch.read_info(path)["metadata"] == {"by": "hand"}


def test_header_whitespace_allowed(tmp_path: Path) -> None:
    data = np.arange(4, dtype=np.int32).tobytes()
    header = '\n  {"a": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}}  \t\n'
    got = cube_torch.load_file(raw_file(tmp_path / "w.safetensors", header, data))
    assert torch.equal(got["a"], torch.arange(4, dtype=torch.int32))


def test_misaligned_offsets(tmp_path: Path) -> None:
    # 3 bools, then float32 at byte 3 and int64 at byte 11: neither can be a view of the
    # buffer at its natural alignment.
    flags = np.array([True, False, True])
    f = np.array([1.5, -2.25], dtype=np.float32)
    i = np.array([2 ** 40 + 3], dtype=np.int64)
    path = hand_written(tmp_path / "odd.safetensors", {"flags": flags, "f": f, "i": i},
                        order=["flags", "f", "i"])
    info = cube_torch.read_info(path)
    assert [t["begin"] for t in info["tensors"]] == [0, 3, 11]
    got = cube_torch.load_file(path)
    assert_same(got, {"flags": torch.tensor([True, False, True]), "f": torch.from_numpy(f),
                      "i": torch.from_numpy(i)})
    assert got["f"].data_ptr() % 4 == 0 and got["i"].data_ptr() % 8 == 0


# ---- every safetensors rule -------------------------------------------------------------------

_F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
_8B = bytes(range(1, 9))

# (rule id, header, data, length override); None header means the file is `data` alone.
RULE_CASES = [
    ("length-prefix", None, b"\x05\x00\x00", None),
    ("header-size-limit", b"{}", b"", 100_000_001),
    ("header-within-file", b"{}", b"", 1000),
    ("header-utf8-json", b'{"a\xff": 1}', b"", None),
    ("header-utf8-json", b'{"a": {"dtype": "F32",', b"", None),
    ("header-json-object", b"[1, 2]", b"", None),
    ("unique-keys", '{"a": %s, "a": %s}' % (json.dumps(_F32x2), json.dumps(_F32x2)), _8B, None),
    ("entry-keys", {"a": {**_F32x2, "extra": 1}}, _8B, None),
    ("entry-keys", {"a": {"dtype": "F32", "data_offsets": [0, 8]}}, _8B, None),
    ("known-dtype", {"a": {**_F32x2, "dtype": "F99"}}, _8B, None),
    ("shape-integers", {"a": {**_F32x2, "shape": [-2]}}, _8B, None),
    ("shape-integers", {"a": {**_F32x2, "shape": ["2"]}}, _8B, None),
    ("data-offsets", {"a": {**_F32x2, "data_offsets": [8, 0]}}, _8B, None),
    ("data-offsets", {"a": {**_F32x2, "data_offsets": [0]}}, _8B, None),
    ("metadata-strings", {"__metadata__": {"k": 1}, "a": _F32x2}, _8B, None),
    ("offsets-start-at-zero", {"a": {**_F32x2, "data_offsets": [4, 12]}}, _8B + b"1234", None),
    ("offsets-contiguous", {"a": _F32x2, "b": {**_F32x2, "data_offsets": [12, 20]}},
     _8B * 2 + b"1234", None),
    ("offsets-contiguous", {"a": _F32x2, "b": {**_F32x2, "data_offsets": [4, 12]}},
     _8B + b"1234", None),
    ("size-overflow", {"a": {**_F32x2, "shape": [2 ** 40, 2 ** 40]}}, _8B, None),
    ("byte-aligned-size", {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}},
     b"\x12\x34", None),
    ("size-matches-shape", {"a": {**_F32x2, "data_offsets": [0, 4]}}, b"1234", None),
    ("data-ends-at-eof", {"a": _F32x2}, _8B + b"!", None),
    ("data-ends-at-eof", {"a": _F32x2}, b"1234", None),
]


@pytest.mark.parametrize("rule,header,data,length", RULE_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(RULE_CASES)])
def test_rule_violation_names_rule(tmp_path: Path, rule: str, header, data: bytes,
                                   length: Optional[int]) -> None:
    path = tmp_path / "bad.safetensors"
    if header is None:
        path.write_bytes(data)
    else:
        raw_file(path, header, data, length)
    with pytest.raises(LoadError) as info:
        cube_torch.load_file(path)
    msg = str(info.value)
    assert f"rule {rule}" in msg, msg
    assert str(path) in msg or "bad.safetensors" in msg, msg
    with pytest.raises(LoadError, match=rule):  # read_info applies the same rules
        cube_torch.read_info(path)


def test_rule_message_names_tensor(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "bad.safetensors",
                    {"good": _F32x2, "weird.name": {**_F32x2, "dtype": "Q7", "data_offsets": [8, 16]}},
                    _8B * 2)
    with pytest.raises(LoadError, match=r"known-dtype.*weird\.name|weird\.name.*known-dtype"):
        cube_torch.load_file(path)


@pytest.mark.parametrize("dtype,shape,nbytes,torch_name", [
    ("U16", [2], 4, "uint16"), ("U32", [1], 4, "uint32"), ("F8_E4M3", [3], 3, "float8_e4m3fn"),
    ("F4", [4], 2, None)])
def test_dtype_torch_lacks(tmp_path: Path, dtype: str, shape, nbytes: int,
                           torch_name: Optional[str]) -> None:
    """A dtype this torch lacks is refused naming the tensor; one it has (torch 2.3+ has
    uint16 and uint32, 2.1+ float8) loads with its bytes as stored."""
    payload = bytes(range(1, 1 + nbytes))
    path = raw_file(tmp_path / "x.safetensors",
                    {"ok": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                     "odd": {"dtype": dtype, "shape": shape, "data_offsets": [1, 1 + nbytes]}},
                    b"\x07" + payload)
    info = cube_torch.read_info(path)  # the file itself is valid
    assert [t["dtype"] for t in info["tensors"]] == ["U8", dtype]
    if torch_name is not None and hasattr(torch, torch_name):
        tensors = cube_torch.load_file(path)
        odd = tensors["odd"]
        assert odd.dtype == getattr(torch, torch_name) and list(odd.shape) == shape
        assert odd.contiguous().view(torch.uint8).numpy().tobytes() == payload
        assert tensors["ok"].tolist() == [7]
        return
    with pytest.raises(LoadError) as e:
        cube_torch.load_file(path)
    assert "'odd'" in str(e.value) and dtype in str(e.value)


# ---- encrypted files made by openssl ----------------------------------------------------------

def openssl_ctr(plain: Path, out: Path, key: bytes, iv: bytes) -> bytes:
    cipher = {16: "-aes-128-ctr", 32: "-aes-256-ctr"}[len(key)]
    subprocess.run(["openssl", "enc", cipher, "-K", key.hex(), "-iv", iv.hex(), "-nosalt",
                    "-in", str(plain), "-out", str(out)], check=True, timeout=SUBPROCESS_S,
                   capture_output=True)
    return out.read_bytes()


def veturbo_header(iv: bytes, mode: str, **extra: Any) -> bytes:
    text = json.dumps({"mode": mode, "iv": b64(iv), "file_timestamp": 1700000000, **extra})
    head = ENC_MAGIC + text.encode()
    assert len(head) < ENC_HEADER
    return head + bytes(ENC_HEADER - len(head))


@pytest.fixture
def plain_model(tmp_path: Path) -> tuple:
    # Several MB: many read chunks, decrypted at unaligned counter positions.
    gen = torch.Generator().manual_seed(9)
    want = {"emb": torch.randn(300, 1001, generator=gen), "b": random_tensor(torch.int8, (13,), gen),
            "h": torch.randn(77, generator=gen).half()}
    path = tmp_path / "plain.safetensors"
    cube_torch.save_file(want, path)
    return path, want


@needs_openssl
@pytest.mark.parametrize("key_len", [16, 32])
def test_openssl_headerless(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain_model,
                            key_len: int) -> None:
    plain, want = plain_model
    key, iv = os.urandom(key_len), bytes.fromhex("0123456789abcdef" + "ff" * 8)  # low-64 carry
    enc = tmp_path / "enc.safetensors"
    openssl_ctr(plain, enc, key, iv)
    assert enc.read_bytes() != plain.read_bytes()
    set_key(monkeypatch, key, iv)
    got = cube_torch.load_file(enc, use_cipher=True)
    assert_same(got, want)
    assert_same(cube_torch.load_file(enc, use_cipher=True, num_threads=1), want)
    info = cube_torch.read_info(enc, use_cipher=True)
    assert info["encrypted"] is True and info["integrity_tag"] is False
    # Without use_cipher a headerless file is just a broken plain file.
    with pytest.raises(LoadError):
        cube_torch.load_file(enc)


@needs_openssl
@pytest.mark.parametrize("key_len,mode", [(16, "CTR-128"), (32, "CTR-256")])
def test_openssl_with_veturbo_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     plain_model, key_len: int, mode: str) -> None:
    plain, want = plain_model
    key, iv = os.urandom(key_len), os.urandom(16)
    body = openssl_ctr(plain, tmp_path / "body.bin", key, iv)
    enc = tmp_path / "enc.safetensors"
    enc.write_bytes(veturbo_header(iv, mode, unknown_field={"x": 1}) + body)
    # The header's IV wins over VETURBOIO_IV.
    set_key(monkeypatch, key, os.urandom(16))
    got = cube_torch.load_file(enc)  # auto-detected
    assert_same(got, want)
    assert cube_torch.read_info(enc)["encrypted"] is True
    assert_same(cube_torch.load(enc), want)


@needs_openssl
def test_header_mode_key_size_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       plain_model) -> None:
    plain, _ = plain_model
    key, iv = os.urandom(16), os.urandom(16)
    body = openssl_ctr(plain, tmp_path / "body.bin", key, iv)
    enc = tmp_path / "enc.safetensors"
    enc.write_bytes(veturbo_header(iv, "CTR-256") + body)
    set_key(monkeypatch, key)
    with pytest.raises(LoadError, match="CTR-256"):
        cube_torch.load_file(enc)


def test_kms_key_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    enc = tmp_path / "kms.safetensors"
    enc.write_bytes(veturbo_header(os.urandom(16), "CTR-128", meta_data_key="AAAA") + bytes(64))
    with pytest.raises(RuntimeError, match="meta_data_key needs a KMS"):
        cube_torch.load_file(enc)


# ---- save_file(use_cipher=True) and tampering -------------------------------------------------

def enc_header_json(path: Path) -> dict:
    raw = path.read_bytes()[:ENC_HEADER]
    assert raw[:16] == ENC_MAGIC
    return json.loads(raw[16:].rstrip(b"\0"))


@pytest.fixture
def encrypted_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple:
    set_key(monkeypatch, os.urandom(32))
    gen = torch.Generator().manual_seed(3)
    # ~9.6 MB of data: several integrity chunks.
    want = {"a.weight": torch.randn(1200, 2000, generator=gen), "b": torch.arange(10)}
    path = tmp_path / "enc.safetensors"
    cube_torch.save_file(want, path, use_cipher=True)
    return path, want


def test_encrypted_round_trip_and_fresh_iv(tmp_path: Path, encrypted_model) -> None:
    path, want = encrypted_model
    assert_same(cube_torch.load_file(path), want)
    assert_same(cube_torch.load_file(path, use_cipher=True, num_threads=1), want)
    second = tmp_path / "again.safetensors"
    cube_torch.save_file(want, second, use_cipher=True)
    h1, h2 = enc_header_json(path), enc_header_json(second)
    assert h1["mode"] == h2["mode"] == "CTR-256"
    assert len(base64.b64decode(h1["iv"])) == 16
    assert h1["iv"] != h2["iv"]
    assert path.read_bytes()[ENC_HEADER:ENC_HEADER + 4096] != second.read_bytes()[ENC_HEADER:ENC_HEADER + 4096]
    info = cube_torch.read_info(path)
    assert info["encrypted"] is True and info["integrity_tag"] is True
    plain = tmp_path / "plain.safetensors"
    cube_torch.save_file(want, plain)
    assert os.path.getsize(path) == os.path.getsize(plain) + ENC_HEADER


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ mask]))


@pytest.mark.parametrize("where", ["length-prefix", "json-name", "json-digit", "data-first",
                                   "data-middle", "data-last", "iv"])
def test_tampering_detected(tmp_path: Path, encrypted_model, where: str) -> None:
    path, want = encrypted_model
    plain = tmp_path / "p.safetensors"
    cube_torch.save_file(want, plain)  # same layout, unencrypted: tells where things are
    praw = plain.read_bytes()
    n = struct.unpack("<Q", praw[:8])[0]
    offsets = {
        "length-prefix": ENC_HEADER + 1,
        # CTR: flipping a ciphertext bit flips the same plaintext bit, so the JSON stays valid
        # with another tensor name ('a.weight' -> '`.weight') or another offset digit.
        "json-name": ENC_HEADER + praw.index(b'"a.weight"') + 1,
        "json-digit": ENC_HEADER + praw.index(b"[0,") + 1 if b"[0," in praw
        else ENC_HEADER + praw.index(b"[0, ") + 1,
        "data-first": ENC_HEADER + 8 + n,
        "data-middle": ENC_HEADER + 8 + n + 5_000_000,
        "data-last": os.path.getsize(path) - 1,
        "iv": path.read_bytes()[:ENC_HEADER].index(b'"iv":"') + 8,
    }
    flip(path, offsets[where], 0x01 if where != "json-digit" else 0x02)  # '0' -> '2'
    with pytest.raises(LoadError) as e:
        cube_torch.load_file(path)
    msg = str(e.value)
    # A change the JSON parser cannot see (a valid name, the data) must fail the tag check.
    expect = {"json-name": ("integrity check failed",), "length-prefix": ("rule ",),
              "json-digit": ("rule ",)}.get(where, ("integrity check failed", "rule ", "header"))
    if where.startswith("data-"):
        expect = ("integrity check failed",)
    assert any(word in msg for word in expect), msg


def test_truncated_encrypted_file(tmp_path: Path, encrypted_model) -> None:
    path, _ = encrypted_model
    size = os.path.getsize(path)
    for cut in (size - 1, size - 4096, ENC_HEADER + 5, 1000):
        short = tmp_path / f"short{cut}.safetensors"
        short.write_bytes(path.read_bytes()[:cut])
        with pytest.raises(LoadError):
            cube_torch.load_file(short)


def test_appended_bytes_detected(tmp_path: Path, encrypted_model) -> None:
    path, _ = encrypted_model
    with open(path, "ab") as fh:
        fh.write(b"\0" * 16)
    with pytest.raises(LoadError):
        cube_torch.load_file(path)


def test_wrong_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encrypted_model) -> None:
    path, _ = encrypted_model
    set_key(monkeypatch, os.urandom(32))
    with pytest.raises(LoadError) as e:
        cube_torch.load_file(path)
    assert os.environ["VETURBOIO_KEY"] not in str(e.value)  # never echo the key


def test_plain_only_refuses_encrypted(encrypted_model) -> None:
    path, _ = encrypted_model
    with pytest.raises(LoadError, match="use_cipher"):
        cube_torch.load_file(path, use_cipher=False)


def test_no_key_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encrypted_model) -> None:
    path, _ = encrypted_model
    monkeypatch.delenv("VETURBOIO_KEY")
    # No key is a usage error (ValueError), never a "file not found".
    with pytest.raises(LoadError, match="VETURBOIO_KEY"):
        cube_torch.load_file(path)
    with pytest.raises(ValueError, match="VETURBOIO_KEY") as info:
        cube_torch.save_file({"a": torch.ones(1)}, tmp_path / "n.safetensors", use_cipher=True)
    assert not isinstance(info.value, OSError)
    assert not any(p.name.startswith("n.safetensors") for p in tmp_path.iterdir())


# ---- DATAPIPE_SOCKET_PATH ---------------------------------------------------------------------

class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class KeyServer:
    """An HTTP server on a unix socket that hands out {"Key", "IV"} to requests carrying
    X-Datapipe-Task-Type: encrypt-key and 403 to any other."""

    def __init__(self, path: str, key: bytes, iv: bytes):
        self.requests: List[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 5

            def do_GET(self) -> None:  # noqa: N802
                kind = self.headers.get("X-Datapipe-Task-Type", "")
                outer.requests.append(kind)
                if kind != "encrypt-key":
                    self.send_response(403)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps({"Key": b64(key), "IV": b64(iv)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = _UnixHTTPServer(path, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def key_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    key, iv = os.urandom(16), os.urandom(16)
    sock = str(tmp_path / "datapipe.sock")
    server = KeyServer(sock, key, iv)
    monkeypatch.setenv("DATAPIPE_SOCKET_PATH", sock)
    try:
        yield server, key, iv
    finally:
        server.stop()


@needs_openssl
def test_datapipe_socket_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain_model,
                             key_server) -> None:
    server, key, iv = key_server
    plain, want = plain_model
    headerless = tmp_path / "hl.safetensors"
    openssl_ctr(plain, headerless, key, iv)
    assert_same(cube_torch.load_file(headerless, use_cipher=True), want)
    # The socket comes before the environment: a wrong VETURBOIO_KEY is not used.
    set_key(monkeypatch, os.urandom(16), os.urandom(16))
    assert_same(cube_torch.load_file(headerless, use_cipher=True), want)
    saved = tmp_path / "saved.safetensors"
    cube_torch.save_file(want, saved, use_cipher=True)
    monkeypatch.delenv("VETURBOIO_KEY")
    monkeypatch.delenv("VETURBOIO_IV")
    assert_same(cube_torch.load_file(saved), want)
    assert enc_header_json(saved)["mode"] == "CTR-128"
    assert server.requests and set(server.requests) == {"encrypt-key"}


# ---- load() -----------------------------------------------------------------------------------

def test_load_dispatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = {"w": torch.randn(3, 3), "n": torch.arange(4)}
    st, pt = tmp_path / "m.safetensors", tmp_path / "m.pt"
    cube_torch.save_file(want, st)
    torch.save(want, pt)
    calls: List[str] = []
    real = _loader.load_file

    def spy(path, **kw):
        calls.append(os.fspath(path))
        return real(path, **kw)

    monkeypatch.setattr(_loader, "load_file", spy)
    assert_same(cube_torch.load(st), want)
    assert calls == [str(st)]
    assert_same(cube_torch.load(pt), want)
    assert calls == [str(st)]  # the .pt went to torch.load


# ---- threads and O_DIRECT ---------------------------------------------------------------------

def test_thread_counts_and_direct_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    want = {"big": torch.randn(3_000_000, generator=gen), "odd": torch.randint(0, 9, (1001,), dtype=torch.uint8),
            "tail": torch.randn(5, 7, generator=gen).double()}
    path = tmp_path / "t.safetensors"
    cube_torch.save_file(want, path)
    one = cube_torch.load_file(path, num_threads=1)
    eight = cube_torch.load_file(path, num_threads=8)
    assert_same(one, want)
    assert_same(eight, want)
    assert_same(cube_torch.load_file(path, direct_io=True, num_threads=3), want)
    set_key(monkeypatch, os.urandom(16))
    enc = tmp_path / "e.safetensors"
    cube_torch.save_file(want, enc, use_cipher=True)
    for threads in (1, 8):
        assert_same(cube_torch.load_file(enc, num_threads=threads), want)
    assert_same(cube_torch.load_file(enc, direct_io=True), want)
    with pytest.raises(ValueError, match="num_threads"):
        cube_torch.load_file(path, num_threads=0)


def mapping_of(ptr: int) -> Dict[str, str]:
    """The /proc/self/smaps entry holding address `ptr`: its path ('' when anonymous) and Rss."""
    entry: Dict[str, str] = {}
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                entry = {"path": head[5] if len(head) > 5 else ""} if lo <= ptr < hi else {}
            elif entry and head[0] == "Rss:":
                entry["rss"] = str(int(head[1]) * 1024)
                return entry
    raise AssertionError(f"address {ptr:#x} is in no mapping")


def test_cpu_load_maps_plain_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small populate chunks, so that several threads share even this small file.
    monkeypatch.setattr(_loader, "_POPULATE_CHUNK", 1 << 20)
    gen = torch.Generator().manual_seed(7)
    want = {"w": torch.randn(1_500_000, generator=gen), "b": torch.randint(0, 9, (333,), dtype=torch.int16)}
    path = tmp_path / "m.safetensors"
    cube_torch.save_file(want, path)
    got = cube_torch.load_file(path, num_threads=4)
    where = mapping_of(got["w"].data_ptr())  # before anything here touches the pages
    assert where["path"] == str(path)
    assert int(where["rss"]) >= want["w"].numel() * 4, "pages not made present before returning"
    assert_same(got, want)
    # Copy-on-write: a write stays in this process, the file and later loads are unchanged.
    got["w"].add_(1.0)
    assert_same(cube_torch.load_file(path, map_file=False), want)
    # The tensors hold the file: replacing it (save_file renames) or removing it changes nothing.
    again = cube_torch.load_file(path)
    cube_torch.save_file({"w": torch.zeros(3)}, path)
    os.unlink(path)
    assert_same(again, want)


def test_files_that_must_be_read_are_not_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = {"x": torch.arange(100_000, dtype=torch.float32)}
    plain = tmp_path / "p.safetensors"
    cube_torch.save_file(want, plain)
    set_key(monkeypatch, os.urandom(16))
    enc = tmp_path / "e.safetensors"
    cube_torch.save_file(want, enc, use_cipher=True)
    # An unpadded header leaves the data at an odd file offset: tensors read, not mapped.
    raw = want["x"].numpy().tobytes()
    odd = raw_file(tmp_path / "odd.safetensors",
                   '{"x":{"dtype":"F32","shape":[100000],"data_offsets":[0,400000]}} ', raw)
    assert (odd.stat().st_size - len(raw)) % 8  # the data's file offset
    cases = {"map_file=False": lambda: cube_torch.load_file(plain, map_file=False),
             "direct_io": lambda: cube_torch.load_file(plain, direct_io=True),
             "encrypted": lambda: cube_torch.load_file(enc),
             "odd offset": lambda: cube_torch.load_file(odd)}
    for name, load in cases.items():
        got = load()
        assert_same(got, want)
        assert mapping_of(got["x"].data_ptr())["path"] == "", name


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        cube_torch.load_file(tmp_path / "nope.safetensors")


# ---- convert ----------------------------------------------------------------------------------

def run_convert(*args: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = _HOOKS + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["CUBE_TORCH_DISABLE"] = "1"
    return subprocess.run([sys.executable, "-m", "cube_torch.convert", *args], env=e,
                          capture_output=True, text=True, timeout=SUBPROCESS_S)


def test_convert_shared_and_non_contiguous(tmp_path: Path) -> None:
    base = torch.randn(6, 4)
    sd = {"enc.weight": base, "dec.weight": base, "dec.bias": base[1], "t": base.t(),
          "nested": {"x": torch.arange(5, dtype=torch.int16)}}
    torch.save({"state_dict": sd, "epoch": 7, "step_name": "final"}, tmp_path / "ckpt.pt")
    out = tmp_path / "m.safetensors"
    r = run_convert("-i", str(tmp_path / "ckpt.pt"), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "'state_dict'" in r.stdout
    assert "5 tensors" in r.stdout and "4 tensors sharing storage" in r.stdout
    assert "1 non-contiguous" in r.stdout
    got = cube_torch.load_file(out)
    assert_same(got, {"enc.weight": base, "dec.weight": base, "dec.bias": base[1],
                      "t": base.t().contiguous(), "nested.x": torch.arange(5, dtype=torch.int16)})
    # The copies are independent tensors.
    got["enc.weight"][0, 0] += 1
    assert got["dec.weight"][0, 0] == base[0, 0]


def test_convert_rejects_non_tensor(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "epoch": 3}, tmp_path / "mixed.pt")
    out = tmp_path / "m.safetensors"
    r = run_convert("-i", str(tmp_path / "mixed.pt"), "-o", str(out))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "'epoch'" in r.stderr and "int" in r.stderr
    assert not out.exists()
    assert not list(tmp_path.glob("m.safetensors*"))  # no temporary left behind either


def test_convert_key_and_cipher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = {"w": torch.randn(4, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}
    torch.save({"ema": sd, "model": {"w": torch.ones(1)}, "epoch": 1}, tmp_path / "ckpt.pt")
    out = tmp_path / "m.safetensors"
    env = dict(os.environ, VETURBOIO_KEY=b64(os.urandom(16)))
    r = run_convert("-i", str(tmp_path / "ckpt.pt"), "-o", str(out), "--key", "ema",
                    "--use-cipher", env=env)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:16] == ENC_MAGIC
    monkeypatch.setenv("VETURBOIO_KEY", env["VETURBOIO_KEY"])
    assert_same(cube_torch.load_file(out), sd)
    r = run_convert("-i", str(tmp_path / "ckpt.pt"), "-o", str(out) + "2", "--key", "nope")
    assert r.returncode == 2 and "'nope'" in r.stderr


def test_convert_help() -> None:
    r = run_convert("--help")
    assert r.returncode == 0
    for word in ("--use-cipher", "--key", "--unsafe-pickle", "weights_only", "trust"):
        assert word in r.stdout, word


# ---- CUDA (skipped without a GPU) -------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("encrypted", [False, True])
@pytest.mark.parametrize("with_helper", [False, True])
def test_cuda_load_equals_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encrypted: bool,
                              with_helper: bool) -> None:
    if encrypted:
        set_key(monkeypatch, os.urandom(32))
    want = random_dict(40, torch.Generator().manual_seed(8), max_elems=300_000)
    path = tmp_path / "c.safetensors"
    cube_torch.save_file(want, path, use_cipher=encrypted)
    cpu = cube_torch.load_file(path)
    helper = cube_torch.init_io_helper(slot_bytes=1 << 20, slots=4) if with_helper else None
    for _ in range(2 if with_helper else 1):  # the helper is reusable
        gpu = cube_torch.load_file(path, device="cuda", helper=helper)
        assert all(t.is_cuda for t in gpu.values())
        assert_same(gpu, cpu)
    assert_same(cpu, want)



@needs_cuda
def test_cuda_errors_name_the_file_and_the_device(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    cube_torch.save_file({"w": torch.ones(16 << 20, dtype=torch.uint8)}, path)
    bad = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"{bad} requested but this machine has"):
        cube_torch.load_file(path, device=bad)
    # Out of memory: the caching allocator may hold at most 8 MiB, the file needs 16.
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((8 << 20) / total, 0)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError, match="e.safetensors: not enough memory"):
            cube_torch.load_file(path, device="cuda:0")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    out = cube_torch.load_file(path, device="cuda:0")  # and it works again
    assert out["w"].is_cuda and int(out["w"].sum()) == 16 << 20


@needs_cuda
def test_cuda_load_of_every_dtype_torch_has(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every safetensors dtype this torch has (float8 and unsigned types with torch 2.x), plain
    and encrypted, at offsets that are and are not aligned for the dtype, equals the CPU load."""
    from cube_torch._loader import _DTYPE_ATTR
    gen = torch.Generator().manual_seed(9)
    want = {}
    for i, attr in enumerate(sorted(set(_DTYPE_ATTR.values()))):
        dtype = getattr(torch, attr, None)
        if not isinstance(dtype, torch.dtype):
            continue
        elem = torch.empty((), dtype=dtype).element_size()
        for j, n in enumerate((1, 3, 1000, 70_001)):
            raw = torch.randint(0, 256, (n * elem,), dtype=torch.uint8, generator=gen)
            if dtype == torch.bool:
                raw = raw % 2
            want[f"{attr}.{j}"] = raw.view(dtype)
    set_key(monkeypatch, os.urandom(16))
    for encrypted in (False, True):
        path = tmp_path / f"d{int(encrypted)}.safetensors"
        cube_torch.save_file(want, path, use_cipher=encrypted)
        cpu = cube_torch.load_file(path)
        gpu = cube_torch.load_file(path, device="cuda")
        assert sorted(gpu) == sorted(want)
        for k, t in gpu.items():
            assert t.is_cuda and t.dtype == want[k].dtype and t.shape == want[k].shape, k
            assert torch.equal(t.cpu().view(torch.uint8), want[k].view(torch.uint8)), k
            assert torch.equal(cpu[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_require_integrity_refuses_untagged_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    plain = tmp_path / "plain.safetensors"
    cube_torch.save_file(want, plain)
    set_key(monkeypatch, os.urandom(32))
    enc = tmp_path / "enc.safetensors"
    cube_torch.save_file(want, enc, use_cipher=True)
    with pytest.raises(LoadError, match="no integrity tag"):
        cube_torch.load_file(plain, require_integrity=True)
    assert_same(cube_torch.load_file(enc, require_integrity=True), want)
    monkeypatch.setenv("CUBE_TORCH_REQUIRE_INTEGRITY", "1")
    with pytest.raises(LoadError, match="no integrity tag"):
        cube_torch.load_file(plain)
    assert_same(cube_torch.load_file(plain, require_integrity=False), want)


def test_mapped_load_in_a_forked_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The parent's populate threads do not exist in a fork (a DataLoader worker): the child
    # must make its own instead of waiting on them forever.
    monkeypatch.setattr(_loader, "_POPULATE_CHUNK", 1 << 20)
    want = {"w": torch.arange(1_000_000, dtype=torch.float32)}
    path = tmp_path / "f.safetensors"
    cube_torch.save_file(want, path)
    assert_same(cube_torch.load_file(path, num_threads=3), want)  # the parent's pool
    time.sleep(0.5)  # its threads now idle: a child inheriting the pool would not start its own
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # As a DataLoader worker does: torch's own OpenMP pool does not survive a fork.
            torch.set_num_threads(1)
            if _loader._pools:  # the parent's pools, whose threads this process does not have
                os._exit(3)
            code = 0 if torch.equal(cube_torch.load_file(path, num_threads=3)["w"], want["w"]) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's load_file hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
