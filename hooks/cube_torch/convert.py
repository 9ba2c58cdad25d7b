"""Converts a PyTorch checkpoint (.pt/.pth/.bin, torch.save format) to a safetensors file that
cube_torch.load_file reads with many threads (optionally veTurboIO-encrypted).

    python -m cube_torch.convert -i model.pt -o model.safetensors [--use-cipher] [--key NAME]

What is stored:
  - the checkpoint itself when it is a dict of tensors (a state dict);
  - else the dict under --key NAME; else, when the top level is a dict that also holds
    non-tensor entries (epoch, optimizer state, ...), its "state_dict" entry, or its "model"
    entry, if that is a dict of tensors (the choice is printed);
  - nested dicts of tensors are flattened with dotted names: {"enc": {"w": t}} -> "enc.w";
  - tensors that share storage (tied weights, views) are saved as separate copies, and
    non-contiguous tensors as contiguous copies; both are counted in the summary.
Anything else — an int, a string, a list, a sparse tensor, a dtype safetensors lacks — is
rejected with a message naming the entry, exit status 2, and nothing is written.

Exit status: 0 converted; 1 an I/O error (reading or writing); 2 the input cannot be
converted (not loadable with weights_only, non-tensor entries, bad arguments).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

EXIT_OK = 0
EXIT_IO = 1
EXIT_INPUT = 2

_CANDIDATE_KEYS = ("state_dict", "model")


class ConvertError(Exception):
    """The input cannot be converted; the message says why (exit status 2)."""


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor" if value.layout == torch.strided else f"a {value.layout} tensor"
    cls = type(value)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return f"of type {name}"


def _is_tensor_tree(value: Any) -> bool:
    """A non-empty dict whose leaves are all tensors (nested dicts allowed)."""
    if not isinstance(value, dict) or not value:
        return False
    return all(isinstance(v, torch.Tensor) or _is_tensor_tree(v) for v in value.values())


def flatten(tree: Dict[Any, Any], where: str = "") -> Dict[str, torch.Tensor]:
    """{"a": {"b": t}} -> {"a.b": t}. Raises ConvertError naming the first entry that is not a
    tensor or a dict, a non-string key, or two entries that flatten to the same name."""
    out: Dict[str, torch.Tensor] = {}

    def walk(node: Dict[Any, Any], prefix: str) -> None:
        for key, value in node.items():
            if not isinstance(key, str):
                raise ConvertError(f"key {key!r}{' under ' + repr(prefix[:-1]) if prefix else ''} "
                                   f"is {_describe(key)}, not a string")
            name = prefix + key
            if isinstance(value, dict):
                walk(value, name + ".")
                continue
            if not isinstance(value, torch.Tensor):
                raise ConvertError(f"entry '{name}' is {_describe(value)}, not a tensor; "
                                   "safetensors stores tensors only (pick the dict of tensors "
                                   "with --key NAME)")
            if value.layout != torch.strided:
                raise ConvertError(f"entry '{name}' is {_describe(value)}; only dense tensors "
                                   "can be stored (convert it with .to_dense() first)")
            if name in out:
                raise ConvertError(f"two entries flatten to the same name '{name}'")
            out[name] = value

    walk(tree, where)
    return out


def select(obj: Any, key: Optional[str]) -> Tuple[Dict[Any, Any], Optional[str]]:
    """The dict of tensors to store and, when it is not the top level, the key it came from."""
    if isinstance(obj, torch.nn.Module):  # only reachable with --unsafe-pickle
        obj = obj.state_dict()
    if not isinstance(obj, dict):
        raise ConvertError(f"the checkpoint is {_describe(obj)}, not a dict of tensors")
    if key is not None:
        if key not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:20])
            raise ConvertError(f"--key {key!r}: no such entry at the top level (entries: {keys})")
        chosen = obj[key]
        if isinstance(chosen, torch.nn.Module):
            chosen = chosen.state_dict()
        if not isinstance(chosen, dict):
            raise ConvertError(f"--key {key!r}: the entry is {_describe(chosen)}, not a dict of "
                               "tensors")
        return chosen, key
    if _is_tensor_tree(obj):
        return obj, None
    for candidate in _CANDIDATE_KEYS:
        if _is_tensor_tree(obj.get(candidate)):
            return obj[candidate], candidate
    return obj, None  # flatten() names the first entry that is not a tensor


def _storage_key(t: torch.Tensor) -> Tuple[str, int]:
    return (str(t.device), t.storage().data_ptr())


def convert(src: str, dst: str, use_cipher: bool = False, key: Optional[str] = None,
            unsafe_pickle: bool = False, out=sys.stdout) -> Dict[str, Any]:
    """Converts src to dst; returns the summary. Raises ConvertError for an input that cannot
    be converted (nothing is written then) and OSError for I/O errors."""
    from . import _loader

    if os.path.abspath(src) == os.path.abspath(dst):
        raise ConvertError("the output would overwrite the input")
    start = time.monotonic()
    try:
        obj = torch.load(src, map_location="cpu", weights_only=not unsafe_pickle)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as e:  # UnpicklingError, RuntimeError from a damaged zip, ...
        hint = ""
        if not unsafe_pickle:
            hint = (" — it cannot be read with torch.load(weights_only=True) (it may hold "
                    "Python objects other than tensors and containers; torch "
                    f"{torch.__version__} cannot read floats that way either). If and only "
                    "if you trust the file, retry with --unsafe-pickle")
        raise ConvertError(f"{src}: {type(e).__name__}: {str(e)[:500]}{hint}") from None
    tree, chosen = select(obj, key)
    tensors = flatten(tree)
    if not tensors:
        raise ConvertError(f"{src}: no tensors to store")
    for name, t in tensors.items():
        try:
            _loader._dtype_name(t.dtype, name)
        except TypeError as e:
            raise ConvertError(str(e)) from None

    groups: Dict[Tuple[str, int], List[str]] = {}
    for name, t in tensors.items():
        if t.numel() > 0:
            groups.setdefault(_storage_key(t), []).append(name)
    shared = sum(len(names) for names in groups.values() if len(names) > 1)
    noncontig = sum(1 for t in tensors.values() if not t.is_contiguous())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    _loader.save_file({k: v.detach() for k, v in tensors.items()}, dst, use_cipher=use_cipher)
    if chosen is not None:
        print(f"stored the '{chosen}' entry of {src}"
              + ("" if key is not None else " (other top-level entries are not stored; "
                 "--key NAME picks another)"), file=out)
    seconds = time.monotonic() - start
    summary = {"tensors": len(tensors), "bytes": nbytes, "seconds": seconds,
               "shared": shared, "noncontiguous": noncontig, "encrypted": bool(use_cipher),
               "key": chosen}
    extra = []
    if shared:
        extra.append(f"{shared} tensors sharing storage saved as separate copies")
    if noncontig:
        extra.append(f"{noncontig} non-contiguous tensors made contiguous")
    print(f"converted {len(tensors)} tensors, {nbytes} bytes ({nbytes / 2**20:.1f} MiB) in "
          f"{seconds:.2f} s: {src} -> {dst}{' (encrypted)' if use_cipher else ''}"
          + ("; " + "; ".join(extra) if extra else ""), file=out)
    return summary


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cube_torch.convert",
        description="Convert a PyTorch checkpoint (torch.save format) to safetensors for "
                    "cube_torch.load_file. The checkpoint is read with "
                    "torch.load(weights_only=True): no code in it runs. A dict of tensors is "
                    "stored as is; from a training checkpoint (a dict with non-tensor entries) "
                    "the 'state_dict' or else the 'model' entry is stored, or the one named "
                    "by --key. Nested dicts of tensors are flattened with dotted names "
                    "(a.b.c). Tensors sharing storage are stored as separate copies and "
                    "non-contiguous ones as contiguous copies.",
        epilog="Exit status: 0 converted; 1 I/O error; 2 the input cannot be converted (a "
               "non-tensor entry, named in the message; nothing is written). Encryption "
               "(--use-cipher) takes the key from DATAPIPE_SOCKET_PATH or VETURBOIO_KEY "
               "(base64 of 16 or 32 bytes) and writes the veTurboIO header format with a "
               "fresh IV and an integrity tag.")
    p.add_argument("-i", "--input", required=True, metavar="MODEL.pt",
                   help="checkpoint written by torch.save")
    p.add_argument("-o", "--output", required=True, metavar="MODEL.safetensors",
                   help="file to write (atomically: nothing appears if conversion fails)")
    p.add_argument("--use-cipher", action="store_true",
                   help="write a veTurboIO-encrypted file (key from DATAPIPE_SOCKET_PATH or "
                        "VETURBOIO_KEY)")
    p.add_argument("--key", metavar="NAME",
                   help="store the dict of tensors under this top-level entry (default: the "
                        "whole checkpoint if it holds only tensors, else 'state_dict', else "
                        "'model')")
    p.add_argument("--unsafe-pickle", action="store_true",
                   help="read the checkpoint with full pickle (weights_only=False). UNSAFE: "
                        "loading a pickle can run arbitrary code; use only for files you "
                        "trust (e.g. ones holding floats, which torch 1.13's weights_only "
                        "reader rejects, or pickled modules)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        convert(args.input, args.output, use_cipher=args.use_cipher, key=args.key,
                unsafe_pickle=args.unsafe_pickle)
    except ConvertError as e:
        print(f"cube_torch.convert: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as e:
        print(f"cube_torch.convert: error: {e.strerror if e.filename is None and e.strerror else e}",
              file=sys.stderr)
        return EXIT_IO
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
