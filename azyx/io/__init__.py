"""azyx.io: lazy, asynchronous safetensors loading, streaming and saving.

- `load_safetensors(path)`: every tensor of a file as a lazy tensor on device "disk" (reads the header only);
  `Tensor.from_safetensors(path, name)` does the same for one tensor.
- `async for name, t in stream_safetensors(path, device=...)`: realized tensors one by one, with bounded read-ahead.
- `await save_safetensors(path, {name: tensor})`: realizes what is lazy, writes atomically.

Reads run on worker threads (positional reads, never on the event loop) straight into pooled host buffers; only
the bytes a realize needs are read (a slice of a row-major tensor is a narrower file range). Malformed files raise
`SafetensorsError` (an `azyx.AzyxIOError`) naming the file and the problem, at the call that opened them.
"""

from azyx.fileformat import SafetensorsError
from azyx.io.lazy import load_safetensors, metadata_of
from azyx.io.save import save_safetensors
from azyx.io.stream import SafetensorsStream, stream_safetensors
from azyx.storage import disk_device

__all__ = ["SafetensorsError", "SafetensorsStream", "disk_device", "load_safetensors", "metadata_of",
           "save_safetensors", "stream_safetensors"]
