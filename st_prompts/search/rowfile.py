"""A standard 2-D ``.npy`` file written and read a block of rows at a time with plain file I/O (``write``,
``pread``), never memory-mapped: mapped pages count in the process's RSS, page-cache pages do not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


class NpyRowWriter:
    """Writes an ``(rows, columns)`` array of ``dtype`` to ``path`` as ``.npy``, appending blocks of rows."""

    def __init__(self, path: Path, rows: int, columns: int, dtype: Any) -> None:
        self.path = path
        self.shape = (rows, columns)
        self.dtype = np.dtype(dtype)
        self.written = 0
        self._handle = path.open("wb")
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": self.shape}
        np.lib.format.write_array_header_1_0(self._handle, header)

    def add(self, block: np.ndarray) -> None:
        """Append ``block`` (``(n, columns)``; converted to the file's dtype)."""
        block = np.ascontiguousarray(block, dtype=self.dtype)
        if block.ndim != 2 or block.shape[1] != self.shape[1] or self.written + len(block) > self.shape[0]:
            raise ValueError(f"block of shape {block.shape} does not fit {self.shape} after {self.written} rows")
        self._handle.write(block.tobytes())
        self.written += len(block)

    def discard(self) -> None:
        """Close the file unfinished (a failed build; its staging folder is removed)."""
        self._handle.close()

    def close(self) -> None:
        """Finish the file (every row must have been written)."""
        self._handle.close()
        if self.written != self.shape[0]:
            raise ValueError(f"{self.written} rows written to {self.path}, {self.shape[0]} announced")


class NpyRows:
    """A read-only view of a 2-D ``.npy`` file that reads only the rows asked for (``view[3:9]``,
    ``view[np.array([[4, 1], [7, 7]])]``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(handle)
            self._offset = handle.tell()
        if len(shape) != 2 or fortran:
            raise ValueError(f"{path} does not hold a 2-D C-ordered array")
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.ndim = 2
        self._row_bytes = self.shape[1] * self.dtype.itemsize
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.shape[0]

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def _read(self, start: int, stop: int) -> np.ndarray:
        data = os.pread(self._fd, (stop - start) * self._row_bytes, self._offset + start * self._row_bytes)
        return np.frombuffer(data, dtype=self.dtype).reshape(stop - start, self.shape[1])

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            return self._read(start, max(start, stop)) if step == 1 else self[np.arange(start, stop, step)]
        rows = np.asarray(key)
        if rows.dtype.kind not in "iu":
            raise TypeError(f"rows must be integers, got {rows.dtype}")
        flat = rows.ravel().astype(np.int64)
        flat = np.where(flat < 0, flat + self.shape[0], flat)
        if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"row out of range for {self.shape[0]} rows")
        unique, inverse = np.unique(flat, return_inverse=True)
        out = np.empty((len(unique), self.shape[1]), dtype=self.dtype)
        # consecutive rows are read together: one system call per run
        breaks = np.flatnonzero(np.diff(unique) != 1) + 1
        for run in np.split(np.arange(len(unique)), breaks) if len(unique) else []:
            out[run[0] : run[-1] + 1] = self._read(int(unique[run[0]]), int(unique[run[-1]]) + 1)
        return out[inverse].reshape(*rows.shape, self.shape[1])
