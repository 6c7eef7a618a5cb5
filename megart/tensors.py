"""Array interop: torch tensors and cupy (or any DLPack / CUDA-array-interface) arrays become
`Tensor` handles with a checked dtype, shape, contiguity and device. torch is the one bridge:
foreign arrays are viewed through `torch.from_dlpack` (zero copy), never copied."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import GraphError

# megart dtype name -> (torch dtype, C++ element type, bytes)
DTYPES: dict[str, tuple[torch.dtype, str, int]] = {
    "bf16": (torch.bfloat16, "__nv_bfloat16", 2),
    "f16": (torch.float16, "__half", 2),
    "f32": (torch.float32, "float", 4),
    "fp8e4m3": (torch.float8_e4m3fn, "__nv_fp8_e4m3", 1),
    "i32": (torch.int32, "int", 4),
    "i64": (torch.int64, "long long", 8),
    "u8": (torch.uint8, "unsigned char", 1),
    # tagged words (megart/tagged.py): int32 storage, each word a bf16 value and its step's tag; chosen with
    # tensor(..., tagged=True), never from the torch dtype alone
    "tagged_bf16": (torch.int32, "unsigned", 4),
}
TAGGED = "tagged_bf16"
_BY_TORCH = {v[0]: k for k, v in DTYPES.items() if k != TAGGED}


def dtype_name(t: torch.dtype) -> str:
    try:
        return _BY_TORCH[t]
    except KeyError:
        raise GraphError(f"dtype {t} is not supported by megart (supported: {sorted(DTYPES)})") from None


def _to_torch(obj, name: str) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    if hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__"):
        try:
            return torch.from_dlpack(obj) if hasattr(obj, "__dlpack__") else torch.as_tensor(obj, device="cuda")
        except Exception as exc:  # the foreign library's own error is the useful part
            raise GraphError(f"tensor {name!r}: cannot view {type(obj).__name__} through DLPack: {exc}") from exc
    raise GraphError(
        f"tensor {name!r}: expected a torch tensor or a DLPack/CUDA-array-interface array (cupy), "
        f"got {type(obj).__name__}")


class Tensor:
    """A device (or, for emulation-only kernels, host) array a task may read or write."""

    def __init__(self, obj, name: str, device: torch.device, tagged: bool = False):
        data = _to_torch(obj, name)
        if data.device.type != device.type or (device.type == "cuda" and data.device.index != device.index):
            raise GraphError(f"tensor {name!r} is on {data.device}, but this kernel runs on {device}")
        if not data.is_contiguous():
            raise GraphError(f"tensor {name!r} is not contiguous (shape {tuple(data.shape)}, "
                             f"strides {data.stride()}); pass .contiguous()")
        if data.numel() == 0:
            raise GraphError(f"tensor {name!r} is empty")
        self.name = name
        self.data = data            # keeps the memory (and any foreign owner) alive
        self.origin = obj
        self.dtype = dtype_name(data.dtype)
        if tagged:
            if data.dtype != torch.int32:
                raise GraphError(f"tensor {name!r}: a tagged tensor holds 32-bit words (torch.int32, one per bf16 "
                                 f"value: megart.tagged.empty(n)), got {data.dtype}")
            self.dtype = TAGGED
        self.shape = tuple(data.shape)
        self.numel = data.numel()
        self.itemsize = DTYPES[self.dtype][2]
        self.nbytes = self.numel * self.itemsize
        self.ptr = data.data_ptr()
        # views of one allocation share this key; distinct allocations can never overlap
        self.storage_key = data.untyped_storage().data_ptr()

    def ref(self, offset: int = 0, count: int | None = None) -> "TensorRef":
        """A slice of `count` elements starting `offset` elements in (flat, row-major)."""
        count = self.numel - offset if count is None else count
        if offset < 0 or count <= 0 or offset + count > self.numel:
            raise GraphError(f"slice [{offset}, {offset + count}) is outside tensor {self.name!r} "
                             f"of {self.numel} elements")
        return TensorRef(self, offset, count)

    @property
    def tagged(self) -> bool:
        """Its words carry a step tag beside each bf16 value (read by polling, megart/tagged.py)."""
        return self.dtype == TAGGED

    def __repr__(self):
        return f"Tensor({self.name!r}, {self.dtype}, {self.shape})"


@dataclass(frozen=True)
class TensorRef:
    """The part of a tensor one task instance touches; the pointer it gets is pre-offset to `offset`."""
    tensor: Tensor
    offset: int
    count: int

    @property
    def byte_range(self) -> tuple[int, int]:
        t = self.tensor
        lo = t.ptr + self.offset * t.itemsize
        return lo, lo + self.count * t.itemsize

    @property
    def address(self) -> int:
        return self.byte_range[0]


def as_ref(value, param_name: str) -> TensorRef:
    """Accept a Tensor (whole) or a TensorRef for a pointer parameter."""
    if isinstance(value, TensorRef):
        return value
    if isinstance(value, Tensor):
        return value.ref()
    raise GraphError(f"parameter {param_name!r} needs a megart tensor (from pk.tensor(...)) or a slice of one, "
                     f"got {type(value).__name__}")
