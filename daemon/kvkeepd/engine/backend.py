"""Backend: what the loaded llama.cpp build is and which devices it runs on, its C log routed
to Python logging, pinned host memory for transfers to a GPU, and a start given up.

With context.py, the only module that imports llama_cpp. ggml's device registry is read
through ctypes (llama_cpp._ggml loads ggml's library): each device's name, description, kind
and memory, and, for a GPU, the host buffer type whose allocations are pinned (page-locked),
which the GPU copies from by DMA without staging them first.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as llama
import numpy as np
from llama_cpp import _ggml as llama_ggml

from kvkeepd.errors import KvkeepError, Unavailable

log = logging.getLogger(__name__)
llama_log = logging.getLogger("kvkeepd.llama_cpp")

# enum ggml_backend_dev_type, in its order.
DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")
GPU_KINDS = ("gpu", "igpu")


@dataclass(frozen=True)
class Device:
    """One of ggml's devices: `name` (CUDA0, CPU...), `description` (the card or processor),
    `kind` (cpu, gpu, igpu, accel), `backend` (CUDA, Metal, Vulkan, CPU...), memory in bytes."""

    name: str
    description: str
    kind: str
    backend: str
    memory_total: int
    memory_free: int


def _fn(name: str, restype: Any, *argtypes: Any) -> Any:
    fn = getattr(llama_ggml.libggml, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", "replace")


def devices() -> list[Device]:
    """ggml's devices, as they are now (free memory included)."""
    count = _fn("ggml_backend_dev_count", ctypes.c_size_t)
    get = _fn("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
    name = _fn("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)
    desc = _fn("ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)
    kind = _fn("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
    reg = _fn("ggml_backend_dev_backend_reg", ctypes.c_void_p, ctypes.c_void_p)
    reg_name = _fn("ggml_backend_reg_name", ctypes.c_char_p, ctypes.c_void_p)
    memory = _fn(
        "ggml_backend_dev_memory",
        None,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    )
    out = []
    for i in range(count()):
        dev = get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        memory(dev, ctypes.byref(free), ctypes.byref(total))
        k = int(kind(dev))
        out.append(
            Device(
                name=_text(name(dev)),
                description=_text(desc(dev)),
                kind=DEVICE_KINDS[k] if 0 <= k < len(DEVICE_KINDS) else "unknown",
                backend=_text(reg_name(reg(dev))),
                memory_total=int(total.value),
                memory_free=int(free.value),
            )
        )
    return out


def gpus(found: list[Device]) -> list[Device]:
    """The devices among `found` that offload layers (dedicated or integrated GPUs)."""
    return [d for d in found if d.kind in GPU_KINDS]


def check_offload(gpu_layers: int, found: list[Device]) -> None:
    """Refuse layers asked for a GPU that this build does not have: -1 (all) and 0 run on the
    CPU of a CPU build, a count is a mistake there."""
    if gpu_layers > 0 and not gpus(found):
        raise KvkeepError(
            f"--gpu-layers {gpu_layers}: this llama.cpp build has no GPU backend (devices: "
            f"{', '.join(d.name for d in found) or 'none'}); build one with KVKEEP_ACCEL=cuda "
            "scripts/setup, or give 0 or -1 (all layers run on the CPU here)"
        )


def build_facts() -> dict[str, Any]:
    """What the loaded llama.cpp says of itself: version, library files, the CPU features it
    was built for, and ggml's devices (name and description)."""
    lib = Path(llama.__file__).parent / "lib"
    files = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(lib.glob("*"))]
    return {
        "version": llama.__version__,
        "libraries": files,
        "system": llama.llama_print_system_info().decode("utf-8", "replace"),
        "devices": [[d.name, d.description] for d in devices()],
    }


class PinnedBuffer:
    """Page-locked host memory from a GPU backend's host buffer type, seen as a numpy array.

    The GPU reads such memory by DMA; a state copied in from pageable memory is staged
    through the driver's own pinned buffers first, chunk by chunk. `array` is valid until
    `free()`; whoever holds the buffer keeps no view of it past that.
    """

    def __init__(self, buffer: int, size: int) -> None:
        self._buffer: int | None = buffer
        base = _fn("ggml_backend_buffer_get_base", ctypes.c_void_p, ctypes.c_void_p)(buffer)
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))

    @classmethod
    def allocate(cls, size: int) -> PinnedBuffer | None:
        """`size` bytes of the first GPU's pinned host memory; None where there is no GPU (a
        CPU build) or the allocation failed."""
        size = max(size, 1)
        count = _fn("ggml_backend_dev_count", ctypes.c_size_t)
        get = _fn("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
        kind = _fn("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
        host_type = _fn("ggml_backend_dev_host_buffer_type", ctypes.c_void_p, ctypes.c_void_p)
        alloc = _fn("ggml_backend_buft_alloc_buffer", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        is_host = _fn("ggml_backend_buffer_is_host", ctypes.c_bool, ctypes.c_void_p)
        for i in range(count()):
            dev = get(i)
            if DEVICE_KINDS[int(kind(dev))] not in GPU_KINDS:
                continue
            buft = host_type(dev)
            if not buft:
                continue
            buffer = alloc(buft, size)
            if not buffer:
                log.warning("no pinned host memory of %d bytes: transfers use pageable memory", size)
                return None
            if not is_host(buffer):
                _fn("ggml_backend_buffer_free", None, ctypes.c_void_p)(buffer)
                return None
            return cls(buffer, size)
        return None

    def free(self) -> None:
        if self._buffer is not None:
            _fn("ggml_backend_buffer_free", None, ctypes.c_void_p)(self._buffer)
            self._buffer = None
            self.array = np.empty(0, np.uint8)


class Scratch:
    """A buffer reused for assembling states that llama.cpp copies in at once, so a load
    writes to memory already mapped instead of faulting in tens of MB: pinned where there is a
    GPU (and pinned memory can be had), ordinary memory otherwise."""

    def __init__(self, gpu: bool) -> None:
        self._gpu = gpu
        self._pinned: PinnedBuffer | None = None
        self._array = np.empty(0, np.uint8)

    @property
    def pinned(self) -> bool:
        return self._pinned is not None

    def take(self, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The first `size` bytes of the buffer, grown to hold them (contents not kept)."""
        if self._array.size < size:
            self.free()
            self._pinned = PinnedBuffer.allocate(size) if self._gpu else None
            self._array = self._pinned.array if self._pinned is not None else np.empty(size, np.uint8)
        return self._array[:size]

    def free(self) -> None:
        self._array = np.empty(0, np.uint8)
        if self._pinned is not None:
            self._pinned.free()
            self._pinned = None


class Halt:
    """A start given up from another thread (Ctrl-C while the model loads or the start-up
    probe runs): once `set`, llama.cpp's model load returns at its next progress report and a
    decode at its next graph node (the CPU backend's abort callback; llama_decode then
    returns 2), and `check` raises before every decode, until `release`. Released once the
    engine serves: the abort callback is a Python call at every node of every graph, which
    would wait for the GIL while the event loop holds it."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._released = False
        self._ctx: Any = None
        # Kept referenced while llama.cpp holds their addresses.
        self._on_load = llama.llama_progress_callback(lambda _progress, _data: not self._event.is_set())
        self._on_node = llama.ggml_abort_callback(lambda _data: self._event.is_set())

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def watch_load(self, params: Any) -> None:
        """Make the model load that `params` (llama_model_params) start stop when halted."""
        params.progress_callback = self._on_load

    def watch(self, ctx: Any) -> None:
        """Make the context's decodes stop when halted, until released."""
        self._ctx = ctx
        llama.llama_set_abort_callback(ctx, self._on_node, None)

    def check(self) -> None:
        """Raise Unavailable if halted (and not released)."""
        if self._event.is_set() and not self._released:
            raise Unavailable("the engine was stopped while it started")

    def release(self) -> None:
        """The start is over: decodes go on whatever comes."""
        self._released = True
        if self._ctx is not None:
            llama.llama_set_abort_callback(self._ctx, llama.ggml_abort_callback(), None)
            self._ctx = None


_log_callback: Any = None


def route_llama_log() -> None:
    """Send llama.cpp's C log to Python logging (it prints a lot to stderr otherwise).

    llama.cpp's own INFO is chatty model-loading detail, so it lands at DEBUG here.
    """
    global _log_callback
    if _log_callback is not None:
        return
    # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continue the previous line.
    levels = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
    pending: list[str] = []
    last_level = [logging.DEBUG]

    def on_log(level: int, text: bytes | None, _user: Any) -> None:
        if text is None:
            return
        if level != 5:
            last_level[0] = levels.get(level, logging.DEBUG)
        pending.append(text.decode("utf-8", "replace"))
        if pending[-1].endswith("\n"):
            message = "".join(pending).rstrip()
            pending.clear()
            if message:
                llama_log.log(last_level[0], "%s", message)

    _log_callback = llama.llama_log_callback(on_log)
    llama.llama_log_set(_log_callback, ctypes.c_void_p(0))
