"""Warnings raised under the hook keep their own place: torch's iterator warns with
stacklevel=2 from its __init__, whose caller is the hook's wrapper; the user must see torch's
line (and their filters must match torch's module), never cube_torch's."""
from __future__ import annotations

import sys
import warnings

import torch
from torch.utils.data import DataLoader

from cube_torch import _hook


def _warns_one_frame_up() -> None:
    warnings.warn("from the frame above", UserWarning, stacklevel=2)


def _warns_here() -> None:
    warnings.warn("from here", UserWarning)


def test_a_warning_that_names_the_wrapper_is_moved_to_its_caller() -> None:
    caller = sys._getframe(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe(0).f_lineno + 1
        _hook._with_torch_warnings_attributed(_warns_one_frame_up, caller)
        _hook._with_torch_warnings_attributed(_warns_here, caller)
    assert [str(w.message) for w in caught] == ["from the frame above", "from here"]
    assert caught[0].filename == __file__  # not cube_torch/_hook.py
    assert caught[0].lineno == line  # where the wrapper was called
    assert caught[1].filename == __file__ and caught[1].lineno == _warns_here.__code__.co_firstlineno + 1


def test_filters_and_once_per_place_still_apply() -> None:
    caller = sys._getframe(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):  # one place: shown once
            _hook._with_torch_warnings_attributed(_warns_here, caller)
        warnings.filterwarnings("ignore", message="from the frame above")
        _hook._with_torch_warnings_attributed(_warns_one_frame_up, caller)
    assert [str(w.message) for w in caught] == ["from here"]


def test_torch_warnings_in_a_loader_do_not_name_the_hook() -> None:
    data = torch.arange(8.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in DataLoader(data, batch_size=4, pin_memory=True):  # no accelerator here
            pass
    hook_file = _hook.__file__
    assert not [w for w in caught if w.filename == hook_file], \
        [(str(w.message), w.filename) for w in caught]
