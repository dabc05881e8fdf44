"""Capture a non-last stage's output: the hidden state after its last layer.

An eval callback answers "yes" only for the graph node named `l_out-{n_layer-1}`,
copies it out, and returns false so llama.cpp stops the graph there: no output
norm, no vocabulary projection. It fires once per ubatch; rows are appended in
batch order (which holds with a unified KV cache). The callback is asked about
every graph node, so it does nothing but compare a name.
"""

from __future__ import annotations

import ctypes
import pathlib

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

_lib = ctypes.CDLL(str(pathlib.Path(lc.__file__).parent / "lib" / "libggml-base.so"))
_lib.ggml_get_name.argtypes = [ctypes.c_void_p]
_lib.ggml_get_name.restype = ctypes.c_char_p
_lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
_lib.ggml_nbytes.restype = ctypes.c_size_t
_lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
_lib.ggml_backend_tensor_get.restype = None
_GGML_TYPE_F32 = 0


class HiddenCapture:
    """Holds up to `max_rows` captured rows of width `n_embd`."""

    def __init__(self, n_layer: int, n_embd: int, max_rows: int) -> None:
        self.target = f"l_out-{n_layer - 1}".encode()
        self.n_embd = n_embd
        self.buffer: npt.NDArray[np.float32] = np.zeros((max_rows, n_embd), np.float32)
        self.rows = 0
        self.overflow = False
        self.callback = lc.ggml_backend_sched_eval_callback(self._on_eval)

    def reset(self) -> None:
        self.rows = 0
        self.overflow = False

    def _on_eval(self, tensor: int, ask: bool, _user: int) -> bool:
        if ask:
            return bool(_lib.ggml_get_name(tensor) == self.target)
        if ctypes.c_int.from_address(tensor).value != _GGML_TYPE_F32:
            self.overflow = True
            return False
        nbytes = _lib.ggml_nbytes(tensor)
        rows = nbytes // (4 * self.n_embd)
        if self.rows + rows > len(self.buffer):
            self.overflow = True
            return False
        dst = self.buffer[self.rows :].ctypes.data
        _lib.ggml_backend_tensor_get(tensor, dst, 0, nbytes)
        self.rows += rows
        return False
