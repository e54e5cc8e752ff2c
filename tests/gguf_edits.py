"""A GGUF rewritten with one fault, for the bad-input tests: metadata values replaced, a tensor dropped, retyped or
appended again under another name. The raw records are copied as they are (glm5lab.gguf.shards' own stream writer),
so only the edit differs from the source file."""
import struct

import gguf

from glm5lab.gguf.reader import open_reader
from glm5lab.gguf.shards import _pack_str, _raw_kv_records, _write_gguf_stream


class _Retyped:
    """A reader tensor with another type id or name in the tensor table (its bytes unchanged)."""

    def __init__(self, t, tensor_type=None, name=None):
        self._t, self.tensor_type, self.name = t, t.tensor_type if tensor_type is None else tensor_type, name or t.name

    def __getattr__(self, attr):
        return getattr(self._t, attr)


def edited_gguf(src, dst, values=None, drop_tensor=None, add_copy=None, types=None):
    """`src` rewritten to `dst` with metadata values replaced ({key: str or uint32}), one tensor dropped, one tensor
    appended again (a copy of another's bytes under a name), or tensors retyped ({name: type id})."""
    r = open_reader(src)
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    records = _raw_kv_records(r)
    for key, value in (values or {}).items():
        i = keys.index(key)
        typed = (struct.pack("<I", gguf.GGUFValueType.STRING) + _pack_str(value) if isinstance(value, str)
                 else struct.pack("<II", gguf.GGUFValueType.UINT32, value))
        records[i] = _pack_str(key) + typed
    tensors = [_Retyped(t, (types or {}).get(t.name)) for t in r.tensors if t.name != drop_tensor]
    if add_copy:
        name, of = add_copy
        tensors.append(_Retyped(next(t for t in r.tensors if t.name == of), name=name))
    with open(dst, "wb") as f:
        _write_gguf_stream(f, 3, records, tensors, [r.data] * len(tensors), 32, None)
    return dst
